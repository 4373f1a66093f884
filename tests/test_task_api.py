"""The public task API (workflows.api) and the examples users copy (examples/tasks/): what a plug-in
imports, the checks at config load (a missing method, a wrong signature), the platform's reduction of
the tasks' metric states across ranks, and the classification example through the whole pipeline
(the regression example's run: tests/test_plugin_task.py)."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import ROOT, run_cli, shutdown_serve
from tests.helpers import free_port
from tests.test_plugin_task import PLUGINS as EXAMPLES
from tests.test_plugin_task import plugin_env, write_config
from workflows.config import load_config
from workflows.errors import UserError
from workflows.registry import EVAL_FILE
from workflows.runtime import runtime
from workflows.tasks import check_task

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.py"))
TASK = "tabular_classification:TabularClassification"


def test_the_examples_import_nothing_of_workflows_but_its_api():
    import workflows.api

    assert {p.name for p in EXAMPLE_FILES} == {"tabular_classification.py", "tabular_regression.py"}
    for path in EXAMPLE_FILES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "", a.name) for a in node.names]
            else:
                continue
            for module, name in names:
                if module == "workflows" or module.startswith("workflows."):
                    assert module == "workflows.api", f"{path.name}:{node.lineno} imports {module}"
                    assert name is None or name in workflows.api.__all__, f"{path.name}:{node.lineno}: {name}"


def test_each_example_is_at_most_80_lines():
    for path in EXAMPLE_FILES:
        assert len(path.read_text().splitlines()) <= 80, path.name


def test_every_public_name_is_documented():
    import workflows.api

    assert workflows.api.__doc__ and "loss" in workflows.api.__doc__ and "metric_states" in workflows.api.__doc__
    for name in workflows.api.__all__:
        obj = getattr(workflows.api, name)
        assert (obj.__doc__ or "").strip(), name  # its own, not inherited
    for owner, names in ((workflows.api.Task, ("preprocess", "collate", "build_model", "metric_states",
                                              "compute_metrics", "inputs", "predict_batch", "evaluate_rows")),
                         (workflows.api.TrainingSeam, ("loss",)),
                         (workflows.api.ServingSeam, ("export", "predictor", "http_contract"))):
        for name in names:
            assert (getattr(owner, name).__doc__ or "").strip(), name


def test_the_required_methods_are_abstract_and_the_built_ins_define_them():
    from workflows.api import Task
    from workflows.tasks import BUILTIN, task_class

    assert Task.__abstractmethods__ == {"preprocess", "collate", "build_model", "metric_states", "compute_metrics"}
    for name in BUILTIN:
        task_class(name)  # checked as a plug-in is


def _broken(tmp_path: Path, case: str) -> tuple[Path, str]:
    """The classification example with one edit (BROKEN[case]), as a user's module in its own folder
    (named after the case: a module imported once stays in sys.modules); its model.task."""
    old, new, _ = BROKEN[case]
    src = (EXAMPLES / "tabular_classification.py").read_text()
    assert old in src
    folder = tmp_path / "plugin"
    folder.mkdir(exist_ok=True)
    (folder / f"broken_{case}.py").write_text(src.replace(old, new))
    return folder, f"broken_{case}:TabularClassification"


BROKEN = {  # edit of the example -> the one line it must fail with ({m}: the module)
    "missing": (
        "    def build_model(self, data) -> nn.Module:",
        "    def build_mode(self, data) -> nn.Module:",
        r"^model.task '{m}:TabularClassification': {m}.TabularClassification does not define "
        r"build_model\(self, data\), which a task must \(see workflows.api.Task\)$"),
    "signature": (
        "    def collate(self, data, *, train, seed=None):",
        "    def collate(self, data, train):",
        r"^model.task '{m}:TabularClassification': {m}.TabularClassification.collate takes \(self, data, "
        r"train\); a task's collate takes \(self, data, train, seed\)$"),
    "serving": (
        "    def inputs(self) -> dict[str, type]:",
        "    def input(self) -> dict[str, type]:",
        r"^model.task '{m}:TabularClassification': {m}.TabularClassification does not define inputs\(self\)"),
}


def _config(path: Path, task: str, **sections) -> Path:
    return write_config(path, {"data": {"source": str(path.parent / "raw")},
                               "model": {"task": task, "options": {"features": ["a"], "label": "y"}}, **sections})


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_plugin_fails_when_its_config_loads(tmp_path, monkeypatch, case):
    """The config checks the task's form only (it imports no task); check_task, which the CLI's load
    and workflows.runtime call once the config has loaded, imports the plug-in and checks its class."""
    folder, task = _broken(tmp_path, case)
    monkeypatch.syspath_prepend(str(folder))
    cfg = load_config(_config(tmp_path / "c.yaml", task))
    with pytest.raises(UserError) as err:
        check_task(cfg)
    assert re.match(BROKEN[case][2].format(m=f"broken_{case}"), str(err.value)), str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError) as err:  # a runtime started from such a config: before the store or Ray
        with runtime(cfg, ray_needed=False):
            pass
    assert re.match(BROKEN[case][2].format(m=f"broken_{case}"), str(err.value)), str(err.value)
    # the example itself loads (so the check above fails for the edit, not for the file)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    check_task(load_config(_config(tmp_path / "c.yaml", TASK)))


@pytest.mark.parametrize("case", ["missing", "signature"])
def test_the_cli_stops_on_a_broken_plugin_before_anything_is_created(tmp_path, case):
    folder, task = _broken(tmp_path, case)
    cwd = tmp_path / "project"
    cwd.mkdir()
    config = _config(tmp_path / "c.yaml", task, storage={"root": str(tmp_path / "store")},
                     output_dir=str(tmp_path / "runs"))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    res = run_cli("preprocess", "--config", str(config), env=env, cwd=cwd, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert re.match(BROKEN[case][2].format(m=f"broken_{case}"), line.removeprefix("error: ")), line
    assert not list(cwd.iterdir()), list(cwd.rglob("*"))
    assert not (tmp_path / "store").exists() and not (tmp_path / "runs").exists()


# --- the platform's reduction of metric states ------------------------------------------------------
def _tasks():
    import sys

    if str(EXAMPLES) not in sys.path:  # as a user's project has them on its path
        sys.path.insert(0, str(EXAMPLES))
    from tabular_classification import TabularClassification
    from tabular_regression import TabularRegression

    from workflows.api import ProcessedDataset

    cfg = load_config(None, ["data.source=raw"])
    info = {"features": ["a", "b"], "label": "y", "mean": [0.0, 1.0], "std": [1.0, 2.0], "target_mean": 0.5,
            "target_std": 2.0}
    data = ProcessedDataset(uri="", version="", labels=["p", "q", "r"], label_column="y", files={}, counts={},
                            label_counts={}, source="", info=info)
    classify = TabularClassification(cfg)
    classify.__dict__["options"] = classify.Options(features=["a", "b"], label="y", hidden=4)
    regress = TabularRegression(cfg)
    regress.__dict__["options"] = regress.Options(features=["a", "b"], target="y", hidden=4)
    return [(classify, data, "label_id"), (regress, data, "y")]


def _batches(label: str, rank: int = 0, world: int = 1) -> list[dict]:
    """10 batches of 7 rows (the same on every call); a rank takes every world-th."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(10):
        x = rng.normal(size=(7, 2))
        y = rng.integers(0, 3, 7) if label == "label_id" else x @ [1.0, -2.0] + rng.normal(size=7)
        out.append({"a": x[:, 0], "b": x[:, 1], label: y})
    return out[rank::world]


def _validate(rank: int = 0, world: int = 1) -> list[dict]:
    from workflows.train.loop import validate

    results = []
    for task, data, label in _tasks():
        torch.manual_seed(0)
        model = task.build_model(data)
        collate = task.collate(data, train=False)
        results.append(validate(task, model, [collate(b) for b in _batches(label, rank, world)],
                                torch.device("cpu"), data))
    return results


def _validate_ranks(rank: int, world: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(_validate(rank, world), f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_loop's ranks: skip the interpreter's teardown


def test_the_platform_reduces_metric_states_over_batches_and_ranks(tmp_path):
    """One process over all 10 batches scores exactly what two ranks score over 5 each: the states are
    summed across ranks (one all-reduce in workflows.train.loop.validate), not averaged or kept per rank."""
    from sklearn.metrics import accuracy_score, f1_score, r2_score

    single = _validate()
    classify, regress = single
    # the classification states are sklearn's weighted F1 and accuracy of the predictions
    (ctask, data, _), (rtask, _, _) = _tasks()
    torch.manual_seed(0)
    model = ctask.build_model(data).eval()
    collate = ctask.collate(data, train=False)
    gold, pred, losses = [], [], []
    with torch.no_grad():
        for b in _batches("label_id"):
            out = model(**collate(b))
            gold += list(b["label_id"])
            pred += out.logits.argmax(-1).tolist()
            losses.append(out.loss.item() * len(b["label_id"]))
    assert classify["val_f1"] == pytest.approx(f1_score(gold, pred, average="weighted"), abs=1e-12)
    assert classify["val_accuracy"] == pytest.approx(accuracy_score(gold, pred), abs=1e-12)
    # the loss state is the batch's float32 loss times its rows, kept on the device (no host read per batch)
    assert classify["val_loss"] == pytest.approx(sum(losses) / len(gold), rel=1e-6)
    torch.manual_seed(0)
    model = rtask.build_model(data).eval()
    with torch.no_grad():
        batches = _batches("y")
        y = np.concatenate([b["y"] for b in batches])
        p = np.concatenate([model(**rtask.collate(data, train=False)(b)).logits.double().numpy() for b in batches])
    assert regress["val_r2"] == pytest.approx(r2_score(y, p), abs=1e-9)

    mp.spawn(_validate_ranks, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # every rank reports the same metrics
    for two, one in zip(ranks[0], single):
        assert two == pytest.approx(one, rel=1e-12), (two, one)


def test_a_task_whose_states_change_shape_is_told_so():
    from workflows.api import Task
    from workflows.train.loop import validate

    class Shifty(Task):
        preprocess = collate = build_model = compute_metrics = None  # type: ignore[assignment]

        def metric_states(self, model, batch):
            return {"s": torch.zeros(int(batch["n"]))}

    with pytest.raises(UserError, match=r"Shifty.metric_states: every batch must return the same keys and shapes"):
        validate(Shifty(load_config(None, ["data.source=raw"])), torch.nn.Linear(1, 1),
                 [{"n": torch.tensor(1)}, {"n": torch.tensor(2)}], torch.device("cpu"), None)


# --- the classification example through the pipeline ----------------------------------------------
def write_wine(raw: Path, shards: int = 2) -> list[str]:
    """scikit-learn's wine set (178 rows, 13 numeric columns, 3 cultivars) as CSV shards; its features."""
    from sklearn.datasets import load_wine

    wine = load_wine(as_frame=True)
    frame = wine.frame.rename(columns={"target": "cultivar"})
    frame["cultivar"] = [str(wine.target_names[i]) for i in frame["cultivar"]]
    raw.mkdir(parents=True)
    for i, part in enumerate(np.array_split(np.arange(len(frame)), shards)):
        frame.iloc[part].to_csv(raw / f"wine-{i}.csv", index=False)
    return list(wine.feature_names)


@pytest.mark.extended  # the gate runs the plug-in path with the regression example (test_plugin_task)
def test_the_classification_example_runs_the_whole_pipeline(tmp_path, ray_join):
    import requests

    features = write_wine(tmp_path / "raw")
    cfg = {
        "name": "wine", "output_dir": f"{tmp_path}/runs",
        "storage": {"root": f"{tmp_path}/store", "embedded": {"enabled": False}}, "cache": {"dir": f"{tmp_path}/cache"},
        "data": {"source": f"{tmp_path}/raw", "format": "csv"}, "preprocess": {"concurrency": 1},
        "model": {"task": TASK, "options": {"features": features, "label": "cultivar", "hidden": 32}},
        "train": {"num_workers": 2, "epochs": 12, "batch_size": 16, "lr": 1e-2, "max_failures": 0},
        "tune": {"enabled": False}, "registry": {"name": "wine"}, "tracking": {"enabled": False},
        "serve": {"enabled": True, "host": "127.0.0.1", "port": free_port(), "demo_requests": 2},
    }
    config = write_config(tmp_path / "wine.yaml", cfg)
    try:
        res = run_cli("pipeline", "--config", str(config), "--set", f"ray.address={ray_join.address}",
                      env=plugin_env(**ray_join.env), timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        summary = json.loads((tmp_path / "runs" / "wine" / "pipeline.json").read_text())
        # real requests to the served model: the first row of each class, and one with an unknown key
        url = summary["serve"]["url"]
        wine = pd.concat(pd.read_csv(p) for p in sorted((tmp_path / "raw").glob("*.csv")))
        rows = wine.groupby("cultivar").head(1)
        resp = requests.post(f"{url}/predict", json={"instances": rows[features].to_dict("records")}, timeout=60)
        assert resp.status_code == 200, resp.text
        answers = resp.json()["predictions"]
        bad = requests.post(f"{url}/predict", json={"instances": [{**rows[features].iloc[0].to_dict(), "x": 1}]},
                            timeout=60)
    finally:
        shutdown_serve()  # the replica holds a CPU of the session's cluster
    manifest = json.loads(Path(summary["dataset"]["uri"], "manifest.json").read_text())
    assert manifest["task"] == TASK and manifest["labels"] == ["class_0", "class_1", "class_2"]
    assert sum(manifest["counts"].values()) == 178 and len(manifest["info"]["mean"]) == 13
    card = json.loads(Path(summary["model"]["uri"], "workflows.json").read_text())
    assert card["task"] == TASK and card["labels"] == manifest["labels"] and card["majority_label"] in card["labels"]
    assert card["val_metrics"]["val_f1"] == pytest.approx(summary["train"]["best_metrics"]["val_f1"])
    # evaluate: held-out accuracy (written back beside the registered model), and the per-class report
    evaluation = json.loads(Path(summary["model"]["uri"], EVAL_FILE).read_text())
    assert evaluation["rows"] == summary["evaluate"]["rows"] == manifest["counts"]["test"]
    assert evaluation["accuracy"] >= 0.9, evaluation
    assert set(evaluation["per_class"]) == set(manifest["labels"])
    out = res.stdout + res.stderr
    for label in manifest["labels"]:
        assert re.search(rf"^\s*{label}\s+\d\.\d+\s+\d\.\d+\s+\d\.\d+\s+\d+", out, re.M), out[-3000:]
    # serving: the demo requests and ours were answered with a label, its score and every probability
    assert len(summary["serve"]["requests"]) == 2
    assert [a["label"] for a in answers] == rows["cultivar"].tolist(), answers
    assert all(set(a) == {"label", "score", "probabilities"} and set(a["probabilities"]) == set(card["labels"])
               for a in answers)
    assert bad.status_code == 422 and "instances[0].x: Extra inputs are not permitted" in bad.text, bad.text


def test_the_readme_shows_the_classification_example_as_it_is():
    """The README's "Your own task" code is the example's, line for line (comments aside), and names
    the public API."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Your own task"):]
    section = section[:section.index("\n## ", 1)]
    assert "`workflows.api`" in section and "examples/tasks/tabular_classification.py" in section
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)

    def lines(text: str) -> set[str]:
        return {ln.split("  #")[0].strip() for ln in text.splitlines()} - {""}

    example = lines((EXAMPLES / "tabular_classification.py").read_text())
    assert lines(code) <= example, sorted(lines(code) - example)


# --- what a dataset version is made of ------------------------------------------------------------
def test_a_changed_plug_in_option_makes_a_new_dataset_version(monkeypatch):
    """Everything that changes what preprocessing writes enters the version, the task's options too:
    the example's `label: color` is another dataset than `label: cultivar` (it was the same version,
    so the old data were reused silently). An option that shapes the model alone (`hidden`, the
    example's `model_only_options`) keeps the version, and so does an unchanged config."""
    from workflows.storage.shards import Shard
    from workflows.tasks import get_task

    monkeypatch.syspath_prepend(str(EXAMPLES))
    shards = [Shard(uri=f"s3://b/raw/wine-{i}.csv", version=str(i), size=100 + i) for i in range(2)]

    def version(*sets: str) -> str:
        cfg = load_config(None, ["data.source=s3://b/raw/", f"model.task={TASK}", "model.options.features=[a,b]",
                                 "model.options.label=cultivar", *sets])
        return get_task(cfg).dataset.version(shards, None)

    base = version()
    assert version() == base
    assert version("model.options.hidden=64") == base
    assert version("model.options.label=color") != base
    assert version("model.options.features=[a,c]") != base
    assert version("preprocess.rows_per_shard=10") != base

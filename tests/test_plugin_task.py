"""A user's own task, outside the package (examples/tasks/tabular_regression.py: tabular regression
with an MLP, written on workflows.api), run by the real CLI through every stage: preprocess on Ray
Data, train on Ray Train, evaluate, register, serve. Nothing in the package knows it:
`model.task=tabular_regression:TabularRegression`. (`ray job submit` of the same task, imported from
the job's working directory: tests/test_jobs.py; the classification example and the checks of the
public API: tests/test_task_api.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from tests.conftest import run_cli, shutdown_serve
from tests.helpers import free_port
from workflows.config import load_config
from workflows.errors import UserError
from workflows.model_card import CARD_FILE
from workflows.registry import EVAL_FILE

PLUGINS = Path(__file__).resolve().parent.parent / "examples" / "tasks"  # the examples users copy
TASK = "tabular_regression:TabularRegression"
FEATURES = ["x1", "x2", "x3"]


def write_regression_shards(raw: Path, rows: int = 600, shards: int = 2, seed: int = 0) -> None:
    """y = 3 x1 - 0.4 x2 + 5 x3 + 1 + noise, features on different scales, as CSV shards."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)) * [1.0, 5.0, 0.1] + [0.0, 10.0, 3.0]
    frame = pd.DataFrame(x, columns=FEATURES)
    frame["y"] = 3 * x[:, 0] - 0.4 * x[:, 1] + 5 * x[:, 2] + 1 + rng.normal(scale=0.1, size=rows)
    raw.mkdir(parents=True)
    for i, rows_of_shard in enumerate(np.array_split(np.arange(rows), shards)):
        frame.iloc[rows_of_shard].to_csv(raw / f"part-{i}.csv", index=False)


def regression_config(tmp: Path, **sections) -> dict:
    """A user's workflow YAML for the plug-in: local storage and data, no tuning, serving on."""
    cfg = {
        "name": "tabular",
        "output_dir": f"{tmp}/runs",
        "storage": {"root": f"{tmp}/store", "embedded": {"enabled": False}},
        "cache": {"dir": f"{tmp}/cache"},
        "data": {"source": f"{tmp}/raw", "format": "csv"},
        "preprocess": {"concurrency": 1},
        "model": {"task": TASK, "options": {"features": FEATURES, "target": "y", "hidden": 32}},
        "train": {"num_workers": 2, "epochs": 4, "batch_size": 16, "lr": 1e-2, "max_failures": 0},
        "tune": {"enabled": False},
        "registry": {"name": "tabular"},
        "serve": {"enabled": True, "host": "127.0.0.1", "port": free_port(), "demo_requests": 2},
        "tracking": {"enabled": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def plugin_env(**extra: str) -> dict:
    """PYTHONPATH with the user's plug-in folder first, as a user's project would have it."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(PLUGINS), os.environ.get("PYTHONPATH")) if p), **extra}


@pytest.fixture
def plugin_path(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))


def test_a_bad_option_is_a_user_error_naming_it(tmp_path, plugin_path):
    from workflows.tasks import get_task

    cfg = regression_config(tmp_path)
    for options, named in (({"hiden": 8}, "model.options.hiden: unknown option"),
                           ({"hidden": "wide"}, "model.options.hidden: Input should be a valid integer"),
                           ({"target": None}, "model.options.target: required option is missing")):
        opts = {k: v for k, v in {**cfg["model"]["options"], **options}.items() if v is not None}
        wcfg = load_config(write_config(tmp_path / "c.yaml", {**cfg, "model": {"task": TASK, "options": opts}}))
        with pytest.raises(UserError, match="model.options") as err:
            get_task(wcfg).check_config()
        assert named in str(err.value) and "its options: features, target, hidden, layers" in str(err.value)
    # a built-in's options are checked the same way
    wcfg = load_config(write_config(tmp_path / "c.yaml", {**cfg, "model": {"options": {"hidden": 8}}}))
    with pytest.raises(UserError, match=r"task classification: model.options.hidden: unknown option \(its options: "
                                        r"pooling, head_init, linear_probe_l2, head_lr, freeze_embeddings\)"):
        get_task(wcfg).check_config()
    wcfg = load_config(write_config(tmp_path / "c.yaml", {**cfg, "model": {"task": "causal_lm", "options": {"x": 1}}}))
    with pytest.raises(UserError, match=r"task causal_lm: model.options.x: unknown option \(its options: size, "):
        get_task(wcfg).check_config()


def test_a_task_without_options_takes_none():
    from workflows.tasks.base import Task
    from workflows.tasks.options import parse_options

    class NoOptions(Task):
        name = "no_options"

    assert parse_options(NoOptions, {}) is None
    with pytest.raises(UserError, match="model.options: task no_options takes no options \\(got x\\)"):
        parse_options(NoOptions, {"x": 1})


def test_a_task_that_does_not_import_is_a_clear_user_error(plugin_path):
    from workflows.tasks import task_class

    with pytest.raises(UserError, match=r"model.task 'no_such_module:Task': cannot import module 'no_such_module'"):
        task_class("no_such_module:Task")
    with pytest.raises(UserError, match=r"tabular_regression.Nope is not a workflows.tasks.base.Task subclass"):
        task_class("tabular_regression:Nope")
    with pytest.raises(UserError, match=r"is not a workflows.tasks.base.Task subclass"):
        task_class("tabular_regression:Options")  # a class, not a task


def test_a_plugin_that_does_not_import_stops_the_cli_before_anything_is_created(tmp_path):
    """A plug-in task that is not on the path, from a new user's empty directory: one line naming it
    and saying how to make it importable, and no embedded store (`.workflows/`) left there."""
    from tests.conftest import ROOT

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    res = run_cli("preprocess", "--set", "model.task=no_such_module:Task", env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert "cannot import module 'no_such_module'" in line and "PYTHONPATH" in line and "pip install -e" in line
    assert "--working-dir" in line, line
    assert not list(tmp_path.iterdir()), list(tmp_path.rglob("*"))


def test_tuning_ranks_trials_by_the_tasks_own_metric_unless_told(tmp_path, plugin_path):
    from workflows.tune.search import with_task_metric

    cfg = regression_config(tmp_path)
    tuned = with_task_metric(load_config(write_config(tmp_path / "c.yaml", cfg))).tune
    assert (tuned.metric, tuned.mode) == ("val_r2", "max")
    told = with_task_metric(load_config(write_config(tmp_path / "c.yaml", {**cfg, "tune": {"metric": "val_mse"}})))
    assert (told.tune.metric, told.tune.mode) == ("val_mse", "max")  # another metric: the mode is the user's to set
    text = with_task_metric(load_config(write_config(tmp_path / "c.yaml", {**cfg, "model": {}}))).tune
    assert (text.metric, text.mode) == ("val_f1", "max")  # the built-in classifier's, as before


def test_the_cli_refuses_a_bad_option_before_starting_ray(tmp_path):
    cfg = regression_config(tmp_path)
    cfg["model"]["options"]["hiden"] = 8
    res = run_cli("preprocess", "--config", str(write_config(tmp_path / "c.yaml", cfg)), env=plugin_env(),
                  timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "error: task tabular_regression: model.options.hiden: unknown option" in res.stderr, res.stderr
    assert not (tmp_path / "runs" / "tabular" / "logs").exists()  # failed before Ray started (and its log)


@pytest.mark.integration
def test_a_users_regression_task_runs_the_whole_pipeline(tmp_path, ray_join, mlflow_server):
    write_regression_shards(tmp_path / "raw")
    # tracked, with one tuning trial: the task's own val_* metrics must reach MLflow per epoch
    config = write_config(tmp_path / "tabular.yaml", regression_config(
        tmp_path, tracking={"enabled": True, "uri": mlflow_server.url},
        tune={"enabled": True, "num_samples": 1, "max_epochs": 2, "num_workers": 1,
              "space": {"train.lr": {"choice": [1e-2]}}}))
    try:
        res = run_cli("pipeline", "--config", str(config), "--set", f"ray.address={ray_join.address}",
                      env=plugin_env(**ray_join.env), timeout=600)
    finally:
        shutdown_serve()  # the replica holds a CPU of the session's cluster
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout + res.stderr
    summary = json.loads((tmp_path / "runs" / "tabular" / "pipeline.json").read_text())

    # preprocessing: a dataset whose manifest names the task and holds the train split's statistics
    manifest = json.loads(Path(summary["dataset"]["uri"], "manifest.json").read_text())
    assert manifest["task"] == TASK and manifest["label_column"] == "y" and manifest["labels"] == []
    assert sum(manifest["counts"].values()) == 600 and manifest["counts"]["test"] > 50
    info = manifest["info"]
    assert info["features"] == FEATURES and len(info["mean"]) == len(info["std"]) == 3
    assert info["mean"][1] == pytest.approx(10, abs=1) and info["std"][1] == pytest.approx(5, rel=0.2)

    # training: every epoch shows the task's own metric; the registered card names the task
    assert "shipping the plug-in task's module" in out and "tabular_regression.py" in out, out[-3000:]
    assert "val_r2" in out and "val_mse" in out, out[-3000:]
    train = summary["train"]["best_metrics"]
    assert train["val_r2"] > 0.9, train
    card = json.loads(Path(summary["model"]["uri"], "workflows.json").read_text())
    assert card["task"] == TASK and card["label_column"] == "y" and card["info"]["features"] == FEATURES
    assert card["options"] == {"features": FEATURES, "target": "y", "hidden": 32, "layers": 2}
    assert card["val_metrics"]["val_r2"] == pytest.approx(train["val_r2"]) and "majority_label" not in card
    assert (Path(summary["model"]["uri"]) / "model.safetensors").is_file()
    evaluation = json.loads(Path(summary["model"]["uri"], EVAL_FILE).read_text())  # written back beside it
    assert evaluation["r2"] > 0.9 and evaluation["target"] == "y", evaluation

    # tracking: the task's own metrics at their epoch step, in the train run and in the tuning trial
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server.url)
    runs = client.search_runs([client.get_experiment_by_name("tabular").experiment_id], max_results=100)
    by_name = {r.info.run_name: r for r in runs}
    history = json.loads((tmp_path / "runs" / "tabular" / "train.json").read_text())["train"]["history"]
    for key in ("val_r2", "val_mse"):
        series = sorted(client.get_metric_history(by_name["train"].info.run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in series] == [(h["epoch"], pytest.approx(h[key])) for h in history], key
    tune_id = by_name["tune"].info.run_id
    (trial,) = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == tune_id]
    assert len(client.get_metric_history(trial.info.run_id, "val_r2")) == 2

    # the registered model is the validated one: `evaluate --split val` scores the card's val R2
    val_out = tmp_path / "val.json"
    res = run_cli("evaluate", "--config", str(config), "--model", "tabular", "--split", "val", "--output",
                  str(val_out), "--set", f"ray.address={ray_join.address}", env=plugin_env(**ray_join.env), timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    val = json.loads(val_out.read_text())
    assert val["rows"] == manifest["counts"]["val"]
    assert val["r2"] == pytest.approx(card["val_metrics"]["val_r2"], abs=0.005), (val, card["val_metrics"])

    # evaluation on the held-out split: R2 far above the train-mean baseline
    head = summary["evaluate"]["headline"]
    assert head["name"] == "r2" and head["value"] > 0.9, head
    assert summary["evaluate"]["baseline"]["r2"] < 0.1 and summary["evaluate"]["rows"] == manifest["counts"]["test"]

    # serving: the demo requests got {"value": float} answers close to the rows' targets
    sent = summary["serve"]["requests"]
    assert len(sent) == 2, summary["serve"]
    for r in sent:
        assert set(r["instance"]) == set(FEATURES) and set(r["prediction"]) == {"value"}, r
        x = r["instance"]
        truth = 3 * x["x1"] - 0.4 * x["x2"] + 5 * x["x3"] + 1
        assert r["prediction"]["value"] == pytest.approx(truth, abs=1.0), r  # the target's std is 3.6



def test_every_validation_number_a_task_reports_is_an_epoch_metric():
    from workflows.tracking.calls import epoch_metrics

    rows = epoch_metrics({"epoch": 3, "val_r2": 0.9, "val_mse": 0.1, "val_f1": 0.5, "val_report": {"a": 1},
                          "train_loss": 0.2, "resumed": True}, None, 1)
    assert sorted(rows) == [("train_loss", 0.2, 3), ("val_f1", 0.5, 3), ("val_mse", 0.1, 3), ("val_r2", 0.9, 3)]


def test_a_card_edited_in_the_store_cannot_choose_the_code_that_runs(tmp_path, monkeypatch):
    """The model card is read from the store: a card whose `task` was changed there to some module must
    not make serve, evaluate or predict import it (they refuse before Ray starts), unless the command's
    config trusts that task. Its version's signature refuses the edit first (tests/test_signing.py); this
    is the layer behind it, for versions registered unsigned (registry.allow_unsigned)."""
    from typer.testing import CliRunner

    import workflows.runtime
    from workflows import registry
    from workflows.cli import app
    from workflows.storage.uri import StorageContext
    from workflows.tasks import task_for_card

    def no_ray(cfg):
        raise AssertionError("Ray started before the card's task was checked")

    monkeypatch.setattr(workflows.runtime, "init_ray", no_ray)
    cfg_dict = regression_config(tmp_path)
    cfg_dict["model"] = {"task": "classification"}
    cfg_dict["registry"] = {**cfg_dict.get("registry", {}), "allow_unsigned": True}
    config = write_config(tmp_path / "user.yaml", cfg_dict)
    cfg = load_config(config)
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "model.safetensors").write_bytes(b"")
    ref = registry.register(cfg, StorageContext.from_config(cfg.storage), str(artifact), "victim",
                            {"task": "classification", "labels": ["a", "b"]})
    (Path(ref.uri) / "model.sig").unlink()  # as a version registered before signing
    card_file = Path(ref.uri) / CARD_FILE
    card = json.loads(card_file.read_text())
    card["task"] = "evil_mod:Evil"  # what someone who can write to the bucket could do
    card_file.write_text(json.dumps(card))
    marker = tmp_path / "imported"
    (tmp_path / "evil_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for command in (["serve", "--model", "victim"], ["evaluate", "--model", "victim", "--split", "val"],
                    ["predict", "--model", "victim", "--data", str(tmp_path), "--output", str(tmp_path / "out")]):
        out = CliRunner().invoke(app, [*command, "--config", str(config)])
        assert out.exit_code != 0, command
        assert "'evil_mod:Evil'" in out.output and "model.trusted_tasks" in out.output, out.output
        assert not marker.exists(), f"{command[0]} imported the module the card named"
    # the same card, trusted by the config: the module is imported (so the checks above can fail)
    trusting = load_config(config, ["model.trusted_tasks=[evil_mod:Evil]"])
    with pytest.raises(UserError, match="not a workflows.tasks.base.Task subclass"):
        task_for_card(trusting, registry.model_card(trusting, StorageContext.from_config(trusting.storage), "victim"))
    assert marker.exists()

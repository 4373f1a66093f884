"""Ray Tune + ASHA on the session's 2-CPU cluster: one-worker trials train in their Tune actor,
trials of more workers are Ray Train runs."""

import json

import pytest
import yaml

from tests.conftest import QUICKSTART
from tests.helpers import tiny_overrides
from tests.test_engine import EPOCH_STATE_KEYS
from workflows.config import load_config
from workflows.pipeline.stages import stage_preprocess, stage_tune
from workflows.runtime import runtime
from workflows.storage.uri import filesystem
from workflows.train.checkpoint import STATE_FILE


def tune_cfg(tmp_path, space: dict, *overrides: str):
    """The tiny quickstart with its own search space (dotted keys cannot be --set)."""
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["tune"]["space"] = space
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_config(path, [*tiny_overrides(tmp_path), *overrides])


@pytest.mark.integration
def test_one_worker_trials_train_in_their_tune_actor(ray_cluster, tmp_path):
    # One worker per trial: the loop runs in the trial's Tune actor (no Ray Train run). With 2 CPUs
    # per worker, one trial at a time in grid order, so the sound trial sets the bar at epoch 1 and
    # ASHA stops the poor one (lr 1.0 wrecks the pretrained weights; its val_loss shoots up).
    cfg = tune_cfg(tmp_path, {"train.lr": {"grid": [1.0e-4, 1.0]}}, "tune.num_workers=1", "train.cpus_per_worker=2",
                   "tune.scheduler=asha", "tune.max_epochs=2", "tune.grace_period=1", "tune.reduction_factor=2",
                   "tune.metric=val_loss",
                   "tune.mode=min", "tune.num_samples=1", "tune.checkpoint=false")
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        outcome = stage_tune(rt, data)
        fs, runs = filesystem(cfg.uri("runs"), rt.storage)
        train_runs = fs.ls(runs) if fs.exists(runs) else []
    assert not train_runs, f"one-worker trials started Ray Train runs: {train_runs}"
    by_lr = {t.params["train.lr"]: t for t in outcome.trials}
    assert all(t.error is None for t in outcome.trials), outcome.trials
    assert by_lr[1.0].epochs == 1 and by_lr[1.0].stopped_early, outcome.trials
    assert by_lr[1e-4].epochs == 2 and outcome.best_params == {"train.lr": 1e-4}
    for t in outcome.trials:  # reported by the in-actor loop only; no checkpoint was asked for
        assert {"read_rows", "startup", "train_steps", "validation"} <= set(t.seconds) and "checkpoint" not in t.seconds
    table = (cfg_dir(cfg) / "tune_trials.md").read_text()
    assert "| trial | train.lr | val_loss | epochs | stopped early | error |" in table and "| 1/2 | yes |" in table
    assert (cfg_dir(cfg) / "tune_trials.png").stat().st_size > 1000
    summary = json.loads((cfg_dir(cfg) / "tune.json").read_text())
    # every trial reads through the node's shard cache: each file fetched once, later reads hit
    cache = summary["shard_cache"]
    assert 0 < cache["misses"] <= len(data.files["train"]) + len(data.files["val"]) and cache["hits"] >= cache["misses"]


def cfg_dir(cfg):
    from pathlib import Path

    return Path(cfg.output_dir) / cfg.name


@pytest.mark.extended  # a search algorithm beside the default; the gate's searches are random/grid with ASHA and FIFO
def test_optuna_search(ray_cluster, tmp_path):
    pytest.importorskip("optuna")
    cfg = tune_cfg(tmp_path, {"train.lr": {"loguniform": [1.0e-4, 1.0e-3]}, "train.batch_size": {"choice": [8, 16]}},
                   "tune.search=optuna", "tune.num_samples=1", "tune.max_epochs=1", "tune.checkpoint=true")
    with runtime(cfg) as rt:
        outcome = stage_tune(rt, stage_preprocess(rt))
        # the trial's checkpoint: engine.Trainer.checkpoint_state's layout, as Ray Train's and torchrun's
        fs, root = filesystem(outcome.experiment_uri, rt.storage)
        states = [json.loads(fs.cat_file(p)) for p in fs.glob(f"{root.rstrip('/')}/**/{STATE_FILE}")]
    assert states and all(set(s) == EPOCH_STATE_KEYS for s in states), [sorted(s) for s in states]
    assert len(outcome.trials) == 1 and all(t.error is None for t in outcome.trials)
    assert outcome.trials[0].seconds["checkpoint"] > 0  # the one-worker trial's epoch checkpoint (quickstart: off)
    assert outcome.trials[0].params["train.batch_size"] in (8, 16)
    assert all(1e-4 <= t.params["train.lr"] <= 1e-3 for t in outcome.trials)


def test_bad_tune_settings_fail_fast(ray_cluster, tiny_cfg, tmp_path):
    from workflows.errors import UserError
    from workflows.tune.search import max_concurrent_trials, search_algorithm

    cfg = tiny_cfg("tune.num_workers=3")
    with pytest.raises(UserError, match=r"3 worker\(s\) x 1 CPU = 3 CPUs, but the Ray cluster has 2"):
        max_concurrent_trials(cfg)
    cfg = tune_cfg(tmp_path, {"train.lr": {"grid": [1.0e-3, 1.0e-4]}}, "tune.search=optuna")
    with pytest.raises(UserError, match="cannot expand grid"):
        search_algorithm(cfg, 1)


def _finished_trials(experiment_dir) -> dict[str, str]:
    """trial_id -> its result.json, for the trials the newest saved experiment state calls TERMINATED."""
    states = sorted(experiment_dir.glob("experiment_state-*.json"))
    if not states:
        return {}
    try:
        doc = json.loads(states[-1].read_text())
    except ValueError:  # being written
        return {}
    out = {}
    for trial_json, _ in doc.get("trial_data", []):
        trial = json.loads(trial_json)
        if trial.get("status") == "TERMINATED":
            results = [p for p in experiment_dir.glob(f"*{trial['trial_id']}*/result.json") if p.stat().st_size]
            if results:
                out[trial["trial_id"]] = results[0].read_text()
    return out


@pytest.mark.extended  # the gate resumes training after a kill; a search's resume is in make test-all
def test_interrupted_search_resumes_without_rerunning_finished_trials(tmp_path):
    """`workflows tune` SIGKILLed (driver, its Ray cluster, trials) once a trial has finished;
    `workflows tune --resume` then runs only the others. Local storage: the embedded endpoint
    keeps its objects in memory between stage boundaries, so a killed run could not leave state.
    Its trials of 2 workers x 1 CPU are Ray Train runs (TuneReportCallback), one at a time on 2 CPUs:
    the suite's test of that trial path (ASHA's decisions are tested on one-worker trials above)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["tune"]["space"] = {"train.lr": {"grid": [1.0e-4, 2.0e-4]}}  # one finished, one cut short
    config = tmp_path / "tune.yaml"
    config.write_text(yaml.safe_dump(doc))
    store = tmp_path / "store"
    sets = [*tiny_overrides(tmp_path), "storage.embedded.enabled=false", f"storage.root={store}",
            f"data.source={store}/raw/quickstart/", "data.write_builtin=true", "ray.num_cpus=2", "tune.num_workers=2",
            "tune.max_epochs=1",
            "tune.num_samples=1", "tracking.enabled=true"]
    args = [
        sys.executable,
        "-m",
        "workflows",
        "tune",
        "--config",
        str(config),
        *[a for s in sets for a in ("--set", s)],
    ]
    experiment = store / "tune" / "quickstart-tune"
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 600
        while not (finished := _finished_trials(experiment)) and first.poll() is None and time.time() < deadline:
            time.sleep(1)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(60)
    assert finished, f"no trial finished before the kill:\n{(tmp_path / 'first.log').read_text()[-3000:]}"
    assert len(finished) < 2, "the search ended before it could be interrupted"

    resumed = subprocess.run(args + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "quickstart" / "tune.json").read_text())
    assert sorted(t["params"]["train.lr"] for t in summary["trials"]) == [1e-4, 2e-4]
    assert all(t["error"] is None and t["epochs"] == 1 for t in summary["trials"])
    after = _finished_trials(experiment)
    assert len(after) == 2
    for trial_id, result in finished.items():  # the finished trials' results are the ones from before
        assert after[trial_id] == result, f"trial {trial_id} ran again"
    # tracked (the default SQLite store): one MLflow run per trial, the interrupted one continued
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("quickstart")
    trial_runs = client.search_runs([exp.experiment_id], "tags.`workflows.stage` = 'trial'")
    assert sorted(r.data.tags["ray.trial_id"] for r in trial_runs) == sorted(after)
    (tune_run,) = client.search_runs([exp.experiment_id], "tags.`workflows.stage` = 'tune' and attributes.status = "
                                     "'FINISHED'")  # the resumed command's (the killed one's stays RUNNING)
    for r in trial_runs:  # all under the resumed search's run, ended as their trials did
        assert r.info.status == "FINISHED", (r.data.tags["ray.trial_id"], r.info.status)
        assert r.data.tags["mlflow.parentRunId"] == tune_run.info.run_id


def test_asha_ratio_model_uses_rays_rule():
    """The bench's expectation for asha_epochs_ratio, simulated with Ray's own bracket: a lone
    trial always runs its full budget; Ray's async rule trains more than synchronous halving
    (21 of 81 epochs for 9 trials, rungs 1/3/9), and less as more trials share the rungs."""
    from workflows.bench.tune import asha_ratio_model

    assert asha_ratio_model(1, 3, 1, 9, reps=20)["mean"] == 1.0
    nine, many = asha_ratio_model(9, 3, 1, 9, reps=300), asha_ratio_model(27, 3, 1, 9, reps=300)
    assert 21 / 81 < many["mean"] < nine["mean"] < 0.6
    assert nine["p10"] <= nine["p50"] <= nine["p90"] and 0 < nine["p_meets_goal"] < 1


def test_the_quickstarts_search_does_not_depend_on_which_trial_reports_first():
    """ASHA stops a trial at a rung by the values reported there so far, so which trials continue
    depends on the order they report in, which a busy machine changes: the quickstart's 4 trials
    scored within noise of each other and `python -m benchmarks.quickstart` and the same command run by
    hand registered different models. Its search runs every trial to the end (fifo, or one epoch)
    and ranks them by a metric a short trial moves (val_loss), on the whole val split."""
    cfg = load_config(QUICKSTART)
    t = cfg.tune
    assert t.scheduler == "fifo" or t.max_epochs <= t.grace_period, t
    assert (t.metric, t.mode) == ("val_loss", "min") and t.max_val_rows is None, t

"""Resuming is exact: a 2-epoch run resumed after epoch 0 (`fit(resume=True)`, i.e.
`workflows train --resume`), and a run whose worker is SIGKILLed mid-epoch and restarted by Ray
Train, both reproduce the per-step losses of an uninterrupted run. Plus the Ray-free loop
(workflows.train.standalone) under torchrun, stopped and resumed too.

Real parts throughout: the session's 2-CPU Ray cluster, 2 FSDP2 workers, the embedded S3 endpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import QUICKSTART, ROOT

from reliability.faults import TrainFault
from tests.helpers import free_port, tiny_overrides
from tests.test_engine import EPOCH_STATE_KEYS
from workflows.config import load_config
from workflows.errors import UserError
from workflows.pipeline.stages import stage_preprocess
from workflows.runtime import runtime
from workflows.storage.uri import filesystem, pyarrow_filesystem
from workflows.train.checkpoint import (
    STATE_FILE,
    consolidated_model_state,
    local_listing,
    missing_locally,
    private_copy,
    read_state,
)
from workflows.train.export import download_checkpoint
from workflows.train.ray_worker import restart_point
from workflows.train.trainer import fit, latest_checkpoint

# Same process, same thread count, same data order and seeds: the losses should agree to float
# rounding; this tolerance still fails at once if a resumed epoch saw other batches, other
# dropout masks, another LR or a fresh optimizer.
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    """The tiny dataset, and the uninterrupted 2-epoch, 2-worker FSDP reference run."""
    tmp = tmp_path_factory.mktemp("resume")
    cfg = load_config(QUICKSTART, [*tiny_overrides(tmp), "train.epochs=2", "train.strategy=fsdp",
                                   "train.num_workers=2", "train.num_to_keep=2"])
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        reference = fit(cfg, rt.storage, data, run_prefix="reference")
        yield SimpleNamespace(cfg=cfg, rt=rt, data=data, reference=reference, tmp=tmp)


def step_losses(outcome, epoch: int) -> list[float]:
    (row,) = [h for h in outcome.history if h["epoch"] == epoch]
    return row["step_losses"]


@pytest.mark.integration
def test_reference_history_has_per_step_losses(run):
    h = run.reference.history
    assert [r["epoch"] for r in h] == [0, 1]
    assert all(r["resumed_from_epoch"] is None for r in h)
    # 48 rows / 2 workers / batch 8 = 3 steps per epoch
    assert [len(r["step_losses"]) for r in h] == [3, 3] and [r["global_step"] for r in h] == [3, 6]
    assert all(np.isfinite(r["step_losses"]).all() for r in h)
    assert np.isclose(np.mean(h[0]["step_losses"]), h[0]["train_loss"], rtol=1e-6)


@pytest.mark.integration
def test_resume_reproduces_the_uninterrupted_run(run):
    """`workflows train --resume` after a 2-epoch run stopped after epoch 0.

    What such a run leaves behind is its epoch-0 checkpoint; the reference run's (the same bytes,
    as the run is deterministic) is copied to a run named interrupted-*, then fit(resume=True)
    finds it with latest_checkpoint and trains epoch 1 only."""
    fs, _ = filesystem(run.reference.run_uri, run.rt.storage)
    ref_path = run.reference.run_uri.split("://", 1)[1]
    checkpoints = [e["name"] for e in fs.ls(ref_path, detail=True)
                   if e["type"] == "directory" and e["name"].rsplit("/", 1)[-1].startswith("checkpoint_")]
    epoch0 = [c for c in checkpoints if json.loads(fs.cat_file(f"{c}/{STATE_FILE}"))["epoch"] == 0]
    assert len(epoch0) == 1, "num_to_keep=2 keeps epoch 0's checkpoint"
    interrupted = f"{ref_path.rsplit('/', 1)[0]}/interrupted-20000101-000000-0000/{epoch0[0].rsplit('/', 1)[-1]}"
    for f in fs.ls(epoch0[0], detail=False):
        fs.copy(f, f"{interrupted}/{f.rsplit('/', 1)[-1]}")

    uri = latest_checkpoint(run.cfg, run.rt.storage, "interrupted")
    assert uri == f"s3://{interrupted}"
    with tempfile.TemporaryDirectory() as d:
        state = read_state(download_checkpoint(uri, run.rt.storage, d))
    # the data position (epoch), the step and the LR schedule are in train_state.json
    assert state["epoch"] == 0 and state["global_step"] == 3 and state["scheduler"]["last_epoch"] == 3
    assert set(state) == EPOCH_STATE_KEYS, sorted(state)  # engine.Trainer.checkpoint_state's, as torchrun's

    # tracked (a SQLite store): rank 0 logs the epoch it trained, not the finished one again
    from mlflow import MlflowClient

    from workflows.tracking.session import Tracking

    tracked_cfg = run.cfg.model_copy(update={"tracking": run.cfg.tracking.model_copy(update={"enabled": True})})
    tracking = Tracking(tracked_cfg, run.rt.storage)
    tracked = tracking.start("train")
    resumed = fit(run.cfg, run.rt.storage, run.data, run_prefix="interrupted", resume=True, tracking=tracked.spec())
    tracked.end()
    tracking.close()
    logged = MlflowClient(tracking.uri).get_metric_history(tracked.id, "train_loss")
    assert [(m.step, m.value) for m in logged] == [(1, pytest.approx(resumed.history[1]["train_loss"]))]
    assert [h["epoch"] for h in resumed.history] == [0, 1]
    assert resumed.history[1]["resumed_from_epoch"] == 0
    np.testing.assert_allclose(step_losses(resumed, 0), step_losses(run.reference, 0), rtol=0, atol=0)
    # the resumed epoch 1 continues exactly where the uninterrupted run went on: same batches,
    # same dropout masks, same LR, same optimizer moments
    np.testing.assert_allclose(step_losses(resumed, 1), step_losses(run.reference, 1), rtol=RTOL, atol=ATOL)
    ref1, res1 = run.reference.history[1], resumed.history[1]
    assert res1["global_step"] == ref1["global_step"] == 6
    assert np.isclose(res1["lr"], ref1["lr"]) and np.isclose(res1["val_loss"], ref1["val_loss"], rtol=RTOL, atol=ATOL)


def test_a_checkpoint_cut_short_in_upload_is_never_resumed_from(run):
    """A crash while the ranks upload leaves a folder with rank 0's .metadata and train_state.json
    but not every shard. Made here from the reference run's real files: epoch 0's checkpoint
    whole, then epoch 1's without one shard under a newer name, as the crash would leave them."""
    fs, _ = filesystem(run.reference.run_uri, run.rt.storage)
    ref_path = run.reference.run_uri.split("://", 1)[1]
    by_epoch = {
        json.loads(fs.cat_file(f"{e['name']}/{STATE_FILE}"))["epoch"]: e["name"]
        for e in fs.ls(ref_path, detail=True)
        if e["type"] == "directory" and e["name"].rsplit("/", 1)[-1].startswith("checkpoint_")
    }
    run_dir = f"{ref_path.rsplit('/', 1)[0]}/cut-20000101-000000-0000"
    files1 = json.loads(fs.cat_file(f"{by_epoch[1]}/{STATE_FILE}"))["files"]
    shard = next(n for n in sorted(files1) if n.endswith(".distcp") and not n.startswith("__0_"))
    for epoch, name, drop in (
        (0, "checkpoint_2000-01-01_00-00-00", None),
        (1, "checkpoint_2000-01-02_00-00-00", shard),
    ):
        for f in fs.ls(by_epoch[epoch], detail=False):
            if f.rsplit("/", 1)[-1] != drop:
                fs.copy(f, f"{run_dir}/{name}/{f.rsplit('/', 1)[-1]}")
    assert fs.exists(f"{run_dir}/checkpoint_2000-01-02_00-00-00/.metadata")  # looks like a checkpoint

    assert latest_checkpoint(run.cfg, run.rt.storage, "cut") == f"s3://{run_dir}/checkpoint_2000-01-01_00-00-00"
    # a restarted group of that run resumes from the same one, whatever Ray Train's controller collected
    restart = restart_point(f"s3://{run_dir}", run.rt.storage)
    assert restart is not None and restart.path.endswith(f"{run_dir}/checkpoint_2000-01-01_00-00-00")
    with private_copy(restart) as d:
        assert read_state(d)["epoch"] == 0
    assert restart_point(f"s3://{run_dir}-none", run.rt.storage) is None  # a first start: no checkpoint
    with tempfile.TemporaryDirectory() as d:  # read directly, it is refused with what is missing
        local = download_checkpoint(f"s3://{run_dir}/checkpoint_2000-01-02_00-00-00", run.rt.storage, d)
        with pytest.raises(UserError, match=f"incomplete checkpoint .*{shard} missing"):
            consolidated_model_state(local)


@pytest.mark.integration
def test_ranks_on_one_node_each_read_a_checkpoint_from_their_own_copy(run):
    """Ray's Checkpoint.as_directory shares one download directory per node and checkpoint; a rank
    that arrives after the download downloads again over the files another rank is reading (in CI,
    a restarted group's DCP load read a cut-short .metadata). Each rank gets its own copy."""
    import ray.train

    fs, path = pyarrow_filesystem(latest_checkpoint(run.cfg, run.rt.storage, "reference"), run.rt.storage)
    checkpoint = ray.train.Checkpoint(path=path, filesystem=fs)  # what each rank unpickles: one uuid
    with private_copy(checkpoint) as first:
        listing = local_listing(first)
        metadata = open(os.path.join(first, ".metadata"), "rb").read()
        with private_copy(checkpoint) as late:  # a rank that comes later, while the first reads
            assert late != first and local_listing(late) == listing and not missing_locally(late)
        assert open(os.path.join(first, ".metadata"), "rb").read() == metadata and not missing_locally(first)
    assert not os.path.exists(first) and not os.path.exists(late)  # nothing left behind in /tmp


@pytest.mark.integration
def test_killed_worker_is_restarted_from_the_last_checkpoint(run, monkeypatch):
    # Ray Train's controller takes in a report when it polls the ranks; polling every 20 s (not 2 s),
    # the kill below lands before it took in epoch 0's, the case a restart must not lose
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "20")
    marker = run.tmp / "killed-once"
    assert run.cfg.train.max_failures >= 1
    # SIGKILL worker rank 1 in the middle of epoch 1 (its second step), once
    kill = TrainFault(epoch=1, step=1, rank=1, action="kill", once=str(marker))
    out = fit(run.cfg, run.rt.storage, run.data, run_prefix="killed", on_step=kill)
    assert marker.exists(), "the fault never fired"

    # completed, with each epoch once: the restarted group began at epoch 1 from epoch 0's checkpoint
    assert [h["epoch"] for h in out.history] == [0, 1]
    assert out.history[0]["resumed_from_epoch"] is None and out.history[1]["resumed_from_epoch"] == 0
    # and it reproduces the uninterrupted run: epoch 0 run-to-run, epoch 1 across the restart
    np.testing.assert_allclose(step_losses(out, 0), step_losses(run.reference, 0), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(step_losses(out, 1), step_losses(run.reference, 1), rtol=RTOL, atol=ATOL)

    # the final result is a valid, complete checkpoint of the last epoch
    assert out.best_metrics["epoch"] in (0, 1) and 0 <= out.best_metrics["val_f1"] <= 1
    last = latest_checkpoint(run.cfg, run.rt.storage, "killed")
    with tempfile.TemporaryDirectory() as d:
        local = download_checkpoint(last, run.rt.storage, d)
        assert read_state(local)["epoch"] == 1
        weights = consolidated_model_state(local)
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())


@pytest.mark.extended  # the gate trains under torchrun in test_images_e2e (DDP, resume)
def test_standalone_loop_under_torchrun(run, tmp_path):
    """The Ray-free loop: torchrun, 2 processes, FSDP2 over gloo, parquet read from the embedded
    S3 endpoint this test's runtime holds; then one plain process resuming from its checkpoint."""
    overrides = [*tiny_overrides(run.tmp), "train.epochs=2", "train.strategy=fsdp"]
    sets = [a for o in overrides for a in ("--set", o)]
    out, ckdir = tmp_path / "standalone.json", tmp_path / "ck"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    standalone = [*torchrun, "-m", "workflows.train.standalone", "--config", str(QUICKSTART), *sets,
                  "--output", str(out), "--checkpoint-dir", str(ckdir)]
    opts = dict(cwd=ROOT, capture_output=True, text=True, timeout=300)
    # stop after epoch 0 (train.epochs stays 2, so the LR schedule is that of a 2-epoch run)
    proc = subprocess.run([*standalone, "--stop-after-epoch", "0"], **opts)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads(out.read_text())
    assert first["world_size"] == 2 and first["train_rows"] == 48 and [h["epoch"] for h in first["history"]] == [0]
    assert len(first["history"][0]["step_losses"]) == 3
    assert set(read_state(str(ckdir / "epoch_0000"))) == EPOCH_STATE_KEYS  # the Ray Train worker's layout

    # resumed, and tracked: rank 0 logs the epochs it trains into a run of its own
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = [a for o in ("tracking.enabled=true", f"tracking.uri={store}", "tracking.step_loss_every=1")
                for a in ("--set", o)]
    proc = subprocess.run([*standalone, "--resume", *tracking], **opts)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(out.read_text())
    assert [h["epoch"] for h in second["history"]] == [0, 1] and second["history"][1]["resumed_from_epoch"] == 0
    assert second["history"][1]["global_step"] == 6 and np.isfinite(second["history"][1]["step_losses"]).all()

    from mlflow import MlflowClient

    client = MlflowClient(store)
    (tracked,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert tracked.info.run_name == "train (torchrun)" and tracked.info.status == "FINISHED"
    assert tracked.data.params["train.strategy"] == "fsdp"
    f1 = client.get_metric_history(tracked.info.run_id, "val_f1")
    assert [(m.step, m.value) for m in f1] == [(1, pytest.approx(second["history"][1]["val_f1"]))]
    steps = client.get_metric_history(tracked.info.run_id, "train_step_loss")
    assert sorted(m.step for m in steps) == [4, 5, 6]  # epoch 1's optimizer steps

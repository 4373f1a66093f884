"""A one-worker tuning trial, run in the trial's own Tune actor: no Train controller, no worker group.

A trial that asks for one worker needs no process group; starting a Ray Train controller and a
worker group for it, and streaming its rows through a Ray Data split coordinator every epoch,
cost several times the trial's own steps on a small machine (docs/BENCHMARKS.md, quickstart).
Here the same engine.Trainer as Ray Train's and torchrun's runs in the actor Tune already
started, on rows read once per trial through the node's shard cache (train.loader=stream: on the
stream loader's batches, as Ray Train's workers read them), and each epoch is reported
to Tune (ASHA decides on it) with a checkpoint when tune.checkpoint asks for one. Trials of more
than one worker still run as Ray Train runs (search._trial).
"""

from __future__ import annotations

import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from workflows.config import WorkflowConfig
from workflows.dataset import ProcessedDataset
from workflows.storage.uri import StorageContext
from workflows.tasks import get_task
from workflows.tracking.run_logger import RunLogger, TrackingSpec
from workflows.tracking.session import config_params
from workflows.train.checkpoint import private_copy
from workflows.train.engine import Trainer
from workflows.train.standalone import local_input, read_split
from workflows.train.worker_setup import set_torch_threads


def trial_logger(cfg: WorkflowConfig, tracking: TrackingSpec | None, dataset_version: str) -> RunLogger | nullcontext:
    """The trial's own MLflow run, a child of the tune run, created from this process (its params: the
    trial's config, with the sampled train.* values); a retried trial, or one `tune --resume`
    continues, logs on into the run it had (found by its trial id and Tune experiment). A context
    manager (an inert one when not tracked): the run ends FINISHED, or FAILED on an exception."""
    import ray.tune

    if tracking is None:
        return nullcontext()
    ctx = ray.tune.get_context()
    trial_id = ctx.get_trial_id()
    # the experiment's directory name: the same when `tune --resume` restores the experiment
    key = {"ray.trial_id": trial_id, "tune.experiment": Path(ctx.get_trial_dir()).parent.name}
    tags = {"ray.trial_name": ctx.get_trial_name(), "workflows.stage": "trial", "dataset.version": dataset_version}
    return RunLogger(tracking, child={"name": f"trial-{trial_id}", "tags": tags, "params": config_params(cfg),
                                      "key": key})


def run_local_trial(cfg: WorkflowConfig, storage: StorageContext, data: ProcessedDataset,
                    tracking: TrackingSpec | None = None) -> None:
    """Train one trial's config in this process, reporting every epoch to Tune (and to the trial's
    MLflow run, as it goes: an ASHA-stopped trial has its epochs logged)."""
    with trial_logger(cfg, tracking, data.version) as logger:
        _run_local_trial(cfg, storage, data, logger)


class TrialTrainer(Trainer):
    """The Trainer in a Tune trial's actor: each epoch reported to Tune (ASHA decides on it), with a
    checkpoint when tune.checkpoint asks for one, and the trial's start-up times."""

    startup: dict[str, float]  # read and start-up seconds, in every report: set before fit

    def end_of_epoch(self, epoch: int, metrics: dict) -> None:
        import ray.tune

        t0 = time.perf_counter()
        report: dict[str, Any] = {**metrics, **self.startup}
        if not self.cfg.tune.checkpoint:
            ray.tune.report(report)
            return
        with tempfile.TemporaryDirectory() as d:
            self.save_checkpoint(d, epoch, metrics)
            report["checkpoint_seconds"] = round(time.perf_counter() - t0, 3)
            ray.tune.report(report, checkpoint=ray.tune.Checkpoint.from_directory(d))


def _run_local_trial(cfg: WorkflowConfig, storage: StorageContext, data: ProcessedDataset,
                     logger: RunLogger | None) -> None:
    import ray.tune
    import torch

    tc = cfg.train
    task = get_task(cfg)
    t_start = time.perf_counter()
    set_torch_threads(tc)
    device = torch.device("cuda", 0) if tc.use_gpu and torch.cuda.is_available() else torch.device("cpu")
    # the input a Ray Train run of this config reads (train.loader, an image task's model.options.image_input)
    source, train_rows = local_input(cfg, task, data, storage,
                                     lambda split, limit: read_split(data, split, storage, cfg, limit))
    read_seconds = time.perf_counter() - t_start

    # the logger logs each epoch before its report: Tune may stop the trial inside the report
    trainer = TrialTrainer(cfg, task, data, device, source, train_rows, logger)
    checkpoint = ray.tune.get_checkpoint()
    trainer.build(probe=checkpoint is None)
    if checkpoint is not None:  # a restarted trial (failure, or `tune --resume`) continues its epochs
        with private_copy(checkpoint) as d:
            trainer.resume(d)
    trainer.startup = {"read_seconds": round(read_seconds, 3),
                       "startup_seconds": round(time.perf_counter() - t_start, 3)}
    trainer.fit()

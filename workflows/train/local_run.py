"""A one-worker training run in one Ray actor: no Train controller, no worker group, no process group.

`train.num_workers: auto` on a node of CPUs trains one worker holding every CPU (workflows.train.layout).
A group of one has nothing to shard or exchange, while Ray Train's controller and worker group cost
seconds a run on a small machine: on 2 cores a TorchTrainer of one worker took 10.6-11.7 s to fit a
function that returns at once, an actor 2.7 s (docs/BENCHMARKS.md, quickstart). So such a run trains
as a one-worker Tune trial does: the same engine.Trainer in one actor that holds the worker's CPUs, on
the input a Ray Train worker of the config reads (standalone.local_input). Each epoch's checkpoint goes
into the run's directory as Ray Train lays it out (`checkpoint_<time>/`, the same files: `--resume`,
restart_point and the registry's export read it alike), and this driver keeps the best
train.num_to_keep (and the newest), as Ray Train's checkpoint manager does. A failure (an error, the
actor's death) starts a new actor, up to train.max_failures times, which goes on from the run's
newest complete checkpoint. What only Ray Train's workers have (step checkpoints, a test's sample
hook) keeps a run on Ray Train (`runs_here`).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from workflows.config import WorkflowConfig
from workflows.runtime import warn
from workflows.storage.uri import pyarrow_filesystem
from workflows.train.ray_worker import RayTrainWorker, WorkerSpec

Report = tuple[str, dict[str, Any]]  # (checkpoint URI, the epoch's metrics)


def runs_here(asked: WorkflowConfig, chosen: WorkflowConfig, on_samples) -> bool:
    """Whether the run trains in one actor: train.num_workers auto chose one worker of CPUs (one node),
    with no step checkpoints and no sample hook (tests)."""
    tc = chosen.train
    return (asked.train.num_workers == "auto" and tc.num_workers == 1 and not tc.use_gpu
            and not tc.checkpoint_every_steps and on_samples is None)


class ActorTrainer(RayTrainWorker):
    """The Ray Train worker's Trainer without Ray Train: each epoch's checkpoint uploaded into the run's
    directory by this process (`published`: its URI and the metrics, what the actor yields)."""

    published: Report | None = None

    def publish(self, directory: str, metrics: dict) -> None:
        from pyarrow.fs import LocalFileSystem, copy_files

        # Ray Train's name for a checkpoint folder: the newest sorts last (checkpoint.newest_stored)
        name = f"checkpoint_{datetime.now().strftime('%Y-%m-%d_%H-%M-%S.%f')}"
        uri = f"{self.spec.run_uri}/{name}"
        fs, path = pyarrow_filesystem(uri, self.spec.storage)
        # train_state.json lists every file with its size: a folder cut short is never read as whole
        copy_files(directory, path, source_filesystem=LocalFileSystem(), destination_filesystem=fs)
        self.published = (uri, metrics)


def _train(spec: WorkerSpec):
    """The actor's run: its epochs from where the run stands, each yielded as (checkpoint URI, metrics)
    once its checkpoint is stored."""
    import torch

    from workflows.tasks import get_task
    from workflows.tracking.run_logger import RunLogger
    from workflows.train.ray_worker import started, starting_checkpoint
    from workflows.train.standalone import local_input, read_split
    from workflows.train.worker_setup import set_torch_threads

    started_at = time.time()
    cfg = WorkflowConfig.model_validate(spec.cfg)
    task = get_task(cfg)
    set_torch_threads(cfg.train)
    source, rows = local_input(cfg, task, spec.data, spec.storage,
                               lambda split, limit: read_split(spec.data, split, spec.storage, cfg, limit))
    logger = RunLogger(spec.tracking) if spec.tracking is not None else None
    trainer = ActorTrainer(cfg, task, spec.data, torch.device("cpu"), source, rows, logger,
                           spec=spec, stream=None, started_at=started_at)
    try:
        if started(trainer, starting_checkpoint(spec)):
            assert trainer.published is not None
            yield trainer.published
            return
        for epoch in range(trainer.start_epoch, cfg.train.epochs):
            trainer.end_of_epoch(epoch, trainer.run_epoch(epoch))
            assert trainer.published is not None
            yield trainer.published
    finally:
        if logger is not None:
            logger.close(timeout=30)


def fit_here(cfg: WorkflowConfig, spec: WorkerSpec, callbacks: list, metric: str, mode: str) -> list[Report]:
    """Train `spec`'s run in one actor holding train.cpus_per_worker CPUs, restarted after a failure up to
    train.max_failures times; every `callbacks`' after_report sees each epoch's metrics as Ray Train's
    controller shows them. Returns the checkpoints kept, oldest first."""
    import ray

    tc = cfg.train
    worker = ray.remote(num_cpus=tc.cpus_per_worker, max_restarts=0)(_Worker)
    reports: list[Report] = []
    for attempt in range(tc.max_failures + 1):
        actor = worker.remote()
        try:
            for ref in actor.run.remote(spec):
                uri, metrics = ray.get(ref)
                reports.append((uri, metrics))
                for callback in callbacks:
                    callback.after_report(None, [metrics], None)
                reports = _pruned(reports, tc, metric, mode, spec)
            return reports
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
            if attempt == tc.max_failures:
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
            warn(f"train: the worker failed ({first}); starting it again from the run's newest checkpoint "
                 f"({attempt + 1} of train.max_failures={tc.max_failures})")
        finally:
            ray.kill(actor)
    raise AssertionError("unreachable")  # the last attempt returns or raises


class _Worker:
    """The actor: a generator method, so each epoch reaches the driver as it ends (Ray's streaming
    generator), not when the run does."""

    def run(self, spec: WorkerSpec):
        yield from _train(spec)


def _pruned(reports: list[Report], tc, metric: str, mode: str, spec: WorkerSpec) -> list[Report]:
    """The best train.num_to_keep checkpoints by `metric` (train.checkpoint_select best; else the newest)
    and the newest (what a restart goes on from); the others' folders deleted."""
    if tc.checkpoint_select == "best":  # among equal scores the earliest stays (select_checkpoint's pick)
        sign = 1 if mode == "max" else -1
        ranked = sorted(reports, key=lambda r: sign * r[1][metric], reverse=True)
    else:
        ranked = list(reversed(reports))
    keep = {uri for uri, _ in ranked[:tc.num_to_keep]} | {reports[-1][0]}
    for uri, _ in reports:
        if uri not in keep:
            fs, path = pyarrow_filesystem(uri, spec.storage)
            fs.delete_dir(path)
    return [r for r in reports if r[0] in keep]


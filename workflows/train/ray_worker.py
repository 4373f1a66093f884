"""The Ray Train worker: an engine.Trainer fed by Ray Data shards (or train.loader=stream), its
checkpoints reported to Ray Train. trainer.fit starts these workers (TorchTrainer(worker_loop)).

Ray supplies the process group, the dataset shards (`get_dataset_shard` + `iter_torch_batches`),
checkpoint upload to object storage and restarts after worker failures; the model, optimizer,
schedule, epoch loop and checkpoint state are the Trainer's (engine.py).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workflows.cluster_scoped import per_cluster
from workflows.config import WorkflowConfig
from workflows.dataset import ProcessedDataset
from workflows.seeds import augment_seed, data_seed
from workflows.storage.uri import StorageContext, filesystem, pyarrow_filesystem, write_json
from workflows.tasks import get_task
from workflows.tracking.run_logger import RunLogger, TrackingSpec
from workflows.train.checkpoint import newest_stored, private_copy
from workflows.train.engine import Trainer
from workflows.train.report import STEP_CHECKPOINT
from workflows.train.stream_input import SampleHook, StreamInput
from workflows.train.worker_setup import set_torch_threads, val_positions

SHUFFLE_BUFFER = 2048


def ray_collate(fn):
    """A task's collate function as the collate-function class Ray Data's iter_torch_batches expects."""
    from ray.data.collate_fn import NumpyBatchCollateFn

    class Collate(NumpyBatchCollateFn):
        def __call__(self, batch):
            return fn(batch)

    return Collate()


RankStepHook = Callable[[int, int, int], None]  # (world rank, epoch, step in epoch), before each step


@dataclass(frozen=True)
class WorkerSpec:
    """What every Ray Train worker gets from the driver (pickled, in `train_loop_config`)."""

    cfg: dict[str, Any]  # the WorkflowConfig as JSON, validated again in the worker
    data: ProcessedDataset
    train_rows: int  # rows (or causal-LM blocks) per epoch, after train.max_train_rows
    run_uri: str
    storage: StorageContext
    resume_from: str | None = None  # `--resume`: an earlier run's checkpoint
    on_step: RankStepHook | None = None  # fit's on_step, pickled to every worker
    on_samples: SampleHook | None = None  # loader=stream: called with each batch's global sample ids
    tracking: TrackingSpec | None = None  # the MLflow run rank 0 logs its epochs into


class RayInput:
    """A Ray Train worker's batches: training from its Ray Data shard (seeded local shuffle) or, with
    train.loader=stream, from its share of one global order (workflows.loader); validation from the
    val split, which reaches every rank whole (ingest_config, or read by the loader), at this rank's
    val_positions."""

    def __init__(self, cfg: WorkflowConfig, task, spec: WorkerSpec, rank: int, world_size: int):
        import ray.train

        self.cfg, self.task, self.data = cfg, task, spec.data
        tc = cfg.train
        # loader=stream: the worker reads its share of one global order itself (workflows.loader)
        self.stream = (StreamInput(cfg, spec.data, spec.storage, rank, world_size, spec.train_rows, spec.on_samples,
                                   task)
                       if tc.loader == "stream" else None)
        self.train_shard = ray.train.get_dataset_shard("train") if self.stream is None else None
        self.val_shard = ray.train.get_dataset_shard("val") if self.stream is None else None
        self.eval_batch = ray_collate(task.collate(spec.data, train=False))
        self.rank = rank
        self.val_rows = min(spec.data.counts["val"], tc.max_val_rows or spec.data.counts["val"])
        self.share = val_positions(self.val_rows, rank, world_size)

    def train(self, epoch: int, skip: int):
        # The shard's rows come in a fixed order (preserve_order, see fit); the shuffle is seeded
        # by (seed, epoch, rank), the task's augmentation by (seed, epoch) and the sample (never the
        # rank), so an epoch sees the same batches and crops however the run got there.
        if self.stream is not None:  # the global order of the epoch, from the checkpoint's position on
            return self.stream.train_batches(epoch, skip)
        assert self.train_shard is not None
        tc = self.cfg.train
        collate = self.task.collate(self.data, train=True, seed=augment_seed(tc.seed, epoch))
        return self.train_shard.iter_torch_batches(
            batch_size=tc.batch_size, collate_fn=ray_collate(collate),
            local_shuffle_buffer_size=SHUFFLE_BUFFER, local_shuffle_seed=data_seed(tc.seed, epoch, self.rank),
            pin_memory=tc.use_gpu,  # the copy to the worker's GPU from pinned memory, in Ray's thread
        )

    def val(self):
        if self.stream is not None:
            return self.stream.val_batches(self.val_rows, self.share, self.eval_batch)
        assert self.val_shard is not None
        size = self.cfg.evaluate.batch_size
        if self.share == slice(None):
            return self.val_shard.iter_torch_batches(batch_size=size, collate_fn=self.eval_batch)
        return (self.eval_batch({k: v[self.share] for k, v in batch.items()})
                for batch in self.val_shard.iter_batches(batch_size=size * self.share.step, batch_format="numpy"))

    def probe(self):
        if not self.task.training.needs_probe_batches():
            return None
        if self.stream is not None:
            return self.stream.batches(0, 0, self.task.collate(self.data, train=False), record=False)
        assert self.train_shard is not None
        return self.train_shard.iter_torch_batches(batch_size=self.cfg.evaluate.batch_size,
                                                   collate_fn=self.eval_batch)


class RayTrainWorker(Trainer):
    """The Trainer on a Ray Train worker: each epoch's checkpoint reported to Ray Train (which uploads
    it and hands it back after a restart), step checkpoints, rank 0's history.json and metrics."""

    def __init__(self, *args, spec: WorkerSpec, stream: StreamInput | None, started_at: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.spec, self.stream, self.started_at = spec, stream, started_at
        self.step_checkpoints = {"count": 0, "seconds": 0.0}

    def before_step(self, epoch: int, step: int) -> None:
        if self.spec.on_step is not None:
            self.spec.on_step(self.rank, epoch, step)

    def after_step(self, epoch: int, step: int) -> None:
        """A step checkpoint every train.checkpoint_every_steps optimizer steps (not at an epoch's
        end: the epoch's own follows). Reported like the epoch ones, with the score metric NaN, so
        Ray keeps it only while it is the latest (what a restart resumes from)."""
        import ray.train

        every, stream = self.cfg.train.checkpoint_every_steps, self.stream
        if stream is None or not every or self.scheduler.last_epoch % every or stream.consumed >= stream.samples:
            return
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            self.save_checkpoint(d, epoch, {}, consumed=stream.consumed)
            ray.train.report({"epoch": epoch, "global_step": int(self.scheduler.last_epoch),
                              "consumed": stream.consumed, STEP_CHECKPOINT: True, self.task.score[0]: float("nan")},
                             checkpoint=ray.train.Checkpoint.from_directory(d))
        self.step_checkpoints["count"] += 1
        self.step_checkpoints["seconds"] += time.perf_counter() - t0

    def end_of_epoch(self, epoch: int, metrics: dict) -> None:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            self.save_checkpoint(d, epoch, metrics)
            self.publish(d, metrics)
        # where the run's time went (the summary's breakdown): this process's start, the
        # checkpoint's save and upload
        self.history[-1].update(worker_started_at=self.started_at, checkpoint_seconds=time.perf_counter() - t0,
                                step_checkpoints=self.step_checkpoints["count"],
                                step_checkpoint_seconds=round(self.step_checkpoints["seconds"], 3),
                                resumed_at_sample=self.resume_at if epoch == self.start_epoch else 0)
        self.step_checkpoints.update(count=0, seconds=0.0)
        if self.rank == 0:  # every epoch's metrics and step losses, for summaries and curves
            write_json(f"{self.spec.run_uri}/history.json", self.history, self.spec.storage)
            record_throughput(self.spec.run_uri.rsplit("/", 1)[-1], metrics)

    def publish(self, directory: str, metrics: dict) -> None:
        """The epoch's checkpoint (in `directory`) and metrics to Ray Train, which uploads the checkpoint
        into the run's directory and keeps the best train.num_to_keep."""
        import ray.train

        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def worker_loop(config: dict[str, WorkerSpec]) -> None:
    """Runs on every Ray Train worker: an engine.Trainer fed by the worker's Ray Data shards.

    After a worker failure Ray Train restarts the group, which resumes from the newest checkpoint the
    run stored (`restart_point`), so training continues after it, not from scratch.
    """
    import ray.train
    import ray.train.torch

    started_at = time.time()
    spec = config["spec"]  # Ray Train hands the train function a dict
    cfg = WorkflowConfig.model_validate(spec.cfg)
    task = get_task(cfg)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    set_torch_threads(cfg.train)
    device = ray.train.torch.get_device()
    source = RayInput(cfg, task, spec, rank, ctx.get_world_size())
    # MLflow from rank 0, where the numbers are (Train V2 has no tracking callback)
    logger = RunLogger(spec.tracking) if rank == 0 and spec.tracking is not None else None
    trainer = RayTrainWorker(cfg, task, spec.data, device, source, spec.train_rows, logger,
                             spec=spec, stream=source.stream, started_at=started_at)

    try:
        if not started(trainer, starting_checkpoint(spec, ray.train.get_checkpoint())):
            trainer.fit()
    finally:
        if logger is not None:
            logger.close(timeout=30)


def starting_checkpoint(spec: WorkerSpec, given=None):
    """The checkpoint a run's worker starts from: after a failure, the newest this run stored (or
    `given`, Ray Train's); otherwise, with `--resume`, the checkpoint of an earlier run (Train V2 has
    no resume_from_checkpoint); None: from scratch."""
    import ray.train

    checkpoint = restart_point(spec.run_uri, spec.storage) or given
    if checkpoint is None and spec.resume_from:
        fs, path = pyarrow_filesystem(spec.resume_from, spec.storage)
        checkpoint = ray.train.Checkpoint(path=path, filesystem=fs)
    return checkpoint


def started(trainer: RayTrainWorker, checkpoint) -> bool:
    """Build the trainer and load `checkpoint` (None: none) into it. True when that checkpoint ends the run:
    a finished run resumed (or a restart after the last report) has nothing left to train, and its final
    state is reported again, so that this run has a result and a checkpoint."""
    trainer.build(probe=checkpoint is None)
    if checkpoint is None:
        return False
    with private_copy(checkpoint) as d:
        trainer.resume(d)
    if trainer.start_epoch < trainer.cfg.train.epochs:
        return False
    assert trainer.resumed_from is not None and trainer.saved is not None  # a checkpoint was loaded
    trainer.end_of_epoch(trainer.resumed_from, trainer.saved["metrics"])
    return True


def restart_point(run_uri: str, storage: StorageContext):
    """The newest complete checkpoint in this run's directory (a restarted group's), or None (a first
    start). Not Ray Train's `get_checkpoint()` alone: its controller takes a report in only when it
    polls every rank (every 2 s), so a rank that dies after reporting and before that poll loses a
    checkpoint that is already whole in storage, and the restarted group would train its epoch again."""
    import ray.train

    found = newest_stored(*filesystem(run_uri, storage))
    if found is None:
        return None
    fs, path = pyarrow_filesystem(f"{run_uri}/{found.rsplit('/', 1)[-1]}", storage)
    return ray.train.Checkpoint(path=path, filesystem=fs)


@per_cluster  # one Gauge per process and cluster: Ray metrics register by name with the core worker
def _gauges() -> dict:
    from ray.util import metrics as ray_metrics

    return {
        name: ray_metrics.Gauge(f"workflows_train_{name}", tag_keys=("run",),
                                description=f"training throughput, {name.replace('_per_', '/')}")
        for name in ("samples_per_second", "tokens_per_second")
    }


def record_throughput(run: str, metrics: dict) -> None:
    """The epoch's samples/s and tokens/s (all ranks) as Ray metrics, for Prometheus/Grafana."""
    gauges = _gauges()
    for name, key in (("samples_per_second", "samples_per_s"), ("tokens_per_second", "tokens_per_s")):
        gauges[name].set(float(metrics[key]), tags={"run": run})

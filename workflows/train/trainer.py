"""Training under Ray Train, the driver's side: `fit` starts a TorchTrainer whose workers run
ray_worker.worker_loop (the thin Ray Train adapter over engine.Trainer), then picks the result.

Ray supplies the process group, the dataset shards, checkpoint upload to object storage and
restarts after worker failures; the model, optimizer, schedule, epoch loop and checkpoint state
are the Trainer's (engine.py).
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass, field
from typing import Any

from workflows.cluster_state import cluster_resources
from workflows.config import WorkflowConfig
from workflows.dataset import ProcessedDataset
from workflows.errors import UserError
from workflows.seeds import data_seed
from workflows.storage.uri import StorageContext, exists, filesystem, pyarrow_filesystem, read_json, with_protocol
from workflows.tasks import get_task
from workflows.tracking.run_logger import TrackingSpec
from workflows.train import checkpoint as ckpt
from workflows.train.local_run import fit_here, runs_here
from workflows.train.ray_worker import RankStepHook, WorkerSpec, worker_loop
from workflows.train.report import is_step_checkpoint
from workflows.train.stream_input import SampleHook, stream_refused
from workflows.train.worker_setup import row_limits, train_rows_kept


def select_checkpoint(checkpoints: list[tuple[Any, dict]], select: str, metric: str, mode: str) -> tuple[Any, dict]:
    """(checkpoint, metrics) of the best epoch by `metric`, or of the last epoch; the earliest of equals.
    Step checkpoints (mid-epoch, unvalidated) are for resuming only, never the result."""
    checkpoints = [cm for cm in checkpoints if not is_step_checkpoint(cm[1])] or checkpoints
    if select == "last":
        return max(checkpoints, key=lambda cm: cm[1]["epoch"])
    sign = 1 if mode == "max" else -1
    return max(checkpoints, key=lambda cm: (sign * cm[1][metric], -cm[1]["epoch"]))


def ingest_config():
    """Ray Data ingest with a fixed row order: `limit` keeps the same rows and every worker gets
    the same rows in the same order each epoch (and after a restart), so the seeded shuffle makes
    the batches reproducible. Without it the order follows read-task completion."""
    import ray.train

    options = ray.train.DataConfig.default_ingest_options()
    options.preserve_order = True
    # "train" split equally among the workers; "val" reaches each whole (worker_setup.val_positions:
    # Ray's equal split would leave out up to world_size - 1 rows of it)
    return ray.train.DataConfig(datasets_to_split=["train"], execution_options=options)


def mixed_block_order(ds, seed: int):
    """The training blocks (a causal LM's: its packed blocks) in a seeded random order, after `limit`
    (which keeps the first rows, as torchrun and Tune trials read them). With preserve_order each
    worker gets a contiguous run of blocks: the stored rows are shuffled when written
    (dataset.shuffled), and this spreads the files too. The order is fixed by train.seed, not
    reseeded per epoch: Ray Data's per-execution reseed counts executions from 0 again after a
    restart or a --resume, so epoch N would not see the blocks of an uninterrupted run's epoch N.
    The per-epoch order comes from the local shuffle, seeded by (seed, epoch, rank)."""
    return ds.randomize_block_order(seed=data_seed(seed, -1))


@dataclass
class TrainOutcome:
    run_name: str
    run_uri: str
    best_checkpoint_uri: str  # the checkpoint train.checkpoint_select chose (best or last epoch); likewise best_metrics
    best_metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)  # where `seconds` went (time_breakdown)


def time_breakdown(history: list[dict], fit_started: float, fit_seconds: float) -> dict[str, float]:
    """A run's wall time split, from the epochs this run trained (`history`), into the worker group's
    start (until the first worker ran), its training steps (of which waiting for data), validation,
    checkpoints (save + upload), and the rest (Ray Train's controller, restarts, the group's shutdown)."""
    if not history:
        return {}
    out = {"worker_group_start": max(0.0, history[0].get("worker_started_at", fit_started) - fit_started)}
    for key, column in (
        ("train_steps", "epoch_seconds"),
        ("data_wait", "data_wait_seconds"),
        ("validation", "val_seconds"),
        ("checkpoint", "checkpoint_seconds"),
    ):
        out[key] = sum(h.get(column) or 0.0 for h in history)
    accounted = out["worker_group_start"] + out["train_steps"] + out["validation"] + out["checkpoint"]
    out["other"] = max(0.0, fit_seconds - accounted)
    return {k: round(v, 2) for k, v in out.items()}


def check_resources(num_workers: int, cpus_per_worker: float, use_gpu: bool, what: str = "train") -> None:
    """Fail fast with the numbers instead of waiting for resources that never come."""
    total = cluster_resources()
    need_cpu = num_workers * cpus_per_worker
    if need_cpu > total.get("CPU", 0):
        raise UserError(
            f"{what} asks for {num_workers} worker(s) x {cpus_per_worker:g} CPU = {need_cpu:g} CPUs, "
            f"but the Ray cluster has {total.get('CPU', 0):g}; lower {what}.num_workers or cpus_per_worker"
        )
    if use_gpu and num_workers > total.get("GPU", 0):
        raise UserError(
            f"{what} asks for {num_workers} GPU worker(s), but the Ray cluster has {total.get('GPU', 0):g} GPUs"
        )


def _runs_root(cfg: WorkflowConfig) -> str:
    return cfg.uri("runs")


def latest_checkpoint(cfg: WorkflowConfig, ctx: StorageContext, prefix: str) -> str | None:
    """URI of the newest complete checkpoint of the newest run named `prefix-*`: a folder that lacks
    any file its train_state.json lists (a crash during upload) is passed over."""
    fs, root = filesystem(_runs_root(cfg), ctx)
    try:
        runs = sorted(
            (p for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[-1].startswith(prefix + "-")), reverse=True
        )
    except FileNotFoundError:
        return None
    for run in runs:
        found = ckpt.newest_stored(fs, run)
        if found is not None:
            return with_protocol(cfg.storage.root, found)
    return None


def resume_point(cfg: WorkflowConfig, storage: StorageContext, prefix: str) -> str:
    """The checkpoint `--resume` continues from (latest_checkpoint), its .metadata read here the way
    the workers will read it (checkpoint.read_metadata): one that names code or paths is refused in
    one line before a worker starts."""
    uri = latest_checkpoint(cfg, storage, prefix)
    if uri is None:
        raise UserError(f"--resume: no checkpoint of a run named {prefix}-* under {_runs_root(cfg)}")
    fs, path = filesystem(f"{uri}/{ckpt.METADATA_FILE}", storage)
    with ckpt.refused_in_one_line(uri):
        ckpt.read_metadata(io.BytesIO(fs.cat_file(path)))
    return uri


def _worker_datasets(cfg: WorkflowConfig, task, data: ProcessedDataset, storage: StorageContext) -> tuple[dict, int]:
    """The Ray datasets the workers are handed with loader=ray_data ("train" in a seeded block order,
    "val"; none with loader=stream), within train.max_rows and the like (row_limits) and as the task prepares
    them, and how many training examples they hold. UserError for fewer examples than workers."""
    tc = cfg.train
    train_ds = data.read("train", storage, num_cpus=0, cache=cfg.cache)
    train_rows = data.counts["train"]
    train_limit, val_limit = row_limits(tc, train_rows)
    if train_limit is not None:
        train_ds = train_ds.limit(train_limit)
        train_rows = train_limit
    prepared = task.dataset.prepare(train_ds)
    if prepared is not train_ds and tc.loader == "stream":
        raise stream_refused(cfg)
    # the val split only where it is handed over (loader=stream: each worker reads it itself)
    val_ds = data.read("val", storage, num_cpus=0, cache=cfg.cache) if tc.loader == "ray_data" else None
    if val_ds is not None and val_limit is not None:
        val_ds = val_ds.limit(val_limit)
    if prepared is not train_ds:  # rows become other examples (a causal LM's blocks): count them
        train_ds, val_ds = prepared, task.dataset.prepare(val_ds)
        train_rows = train_ds.count()
    if train_rows < tc.max_workers:
        raise UserError(f"{train_rows} training example(s) ({task.name}) for {tc.max_workers} workers; lower "
                        "train.num_workers, bring more data, or (a causal LM) lower model.options.seq_len")
    if tc.loader == "ray_data":
        return {"train": mixed_block_order(train_ds, tc.seed), "val": val_ds}, train_rows
    return {}, train_rows  # loader=stream: each worker reads both splits itself (no Ray Data start)


def _torch_trainer(tc, spec: WorkerSpec, run_config, datasets: dict):
    """Ray Train's TorchTrainer of worker_loop over `spec`: its worker group (elastic for a [min, max]
    train.num_workers), the process group's backend, the datasets and their fixed-order ingest."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        worker_loop,
        train_loop_config={"spec": spec},
        torch_config=TorchConfig(backend="nccl" if tc.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            # [min, max]: an elastic group, restarted on as many workers as the cluster has room for
            num_workers=tc.num_workers if isinstance(tc.num_workers, int) else tuple(tc.num_workers),
            use_gpu=tc.use_gpu,
            resources_per_worker={"CPU": tc.cpus_per_worker},
        ),
        run_config=run_config,
        datasets=datasets,
        dataset_config=ingest_config(),
    )


def fit(
    cfg: WorkflowConfig,
    storage: StorageContext,
    data: ProcessedDataset,
    *,
    run_prefix: str | None = None,
    callbacks: list | None = None,
    resume: bool = False,
    check: bool = True,
    on_step: RankStepHook | None = None,  # run in every worker before each step (faults: reliability/); pickled
    on_samples: SampleHook | None = None,  # loader=stream: every worker's batch sample ids (tests); pickled
    tracking: TrackingSpec | None = None,  # an MLflow run for rank 0's epochs
) -> TrainOutcome:
    import ray.train

    from workflows.train.layout import resolved

    asked, cfg = cfg, resolved(cfg)[0]  # train.num_workers auto: chosen for this cluster
    tc = cfg.train
    if check:
        check_resources(tc.min_workers, tc.cpus_per_worker, tc.use_gpu)
    task = get_task(cfg)
    task.training.check(data)

    in_actor = runs_here(asked, cfg, on_samples)  # one worker of CPUs: one actor, no Ray Train (local_run)
    datasets, train_rows = ({}, train_rows_kept(tc, data.counts["train"])) if in_actor \
        else _worker_datasets(cfg, task, data, storage)
    prefix = run_prefix or f"{cfg.name}-train"
    resume_from = resume_point(cfg, storage, prefix) if resume else None
    metric, mode = task.score
    run_name = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid() % 10000:04d}"
    pa_fs, runs_path = pyarrow_filesystem(_runs_root(cfg), storage)
    run_uri = f"{_runs_root(cfg)}/{run_name}"
    spec = WorkerSpec(
        cfg=cfg.model_dump(mode="json"),
        data=data,
        train_rows=train_rows,
        run_uri=run_uri,
        storage=storage,
        resume_from=resume_from,
        on_step=on_step,
        on_samples=on_samples,
        tracking=tracking,
    )
    run_config = ray.train.RunConfig(
        name=run_name,
        storage_path=runs_path,
        storage_filesystem=pa_fs,
        checkpoint_config=ray.train.CheckpointConfig(
            # without a score attribute Ray keeps the most recent checkpoints
            num_to_keep=tc.num_to_keep,
            checkpoint_score_order=mode,
            checkpoint_score_attribute=metric if tc.checkpoint_select == "best" else None,
        ),
        failure_config=ray.train.FailureConfig(max_failures=tc.max_failures),
        callbacks=callbacks or None,
    )
    t0 = time.time()
    if in_actor:
        kept: list = fit_here(cfg, spec, callbacks or [], metric, mode)
    else:
        kept = [(with_protocol(cfg.storage.root, c.path), m)
                for c, m in _torch_trainer(tc, spec, run_config, datasets).fit().best_checkpoints]
    fit_seconds = time.time() - t0
    if not kept:
        raise RuntimeError(f"training run {run_name} finished without a checkpoint")
    best_uri, best_metrics = select_checkpoint(kept, tc.checkpoint_select, metric, mode)
    history_uri = f"{run_uri}/history.json"
    history = read_json(history_uri, storage) if exists(history_uri, storage) else []
    return TrainOutcome(
        run_name=run_name,
        run_uri=run_uri,
        best_checkpoint_uri=best_uri,
        best_metrics=dict(best_metrics),
        history=history,
        seconds=fit_seconds,
        breakdown=time_breakdown([h for h in history if h.get("worker_started_at", 0) >= t0], t0, fit_seconds),
    )

"""The thin Ray Train adapter: TorchTrainer around the plain loop in loop.py.

Ray supplies the process group, the dataset shards (`get_dataset_shard` + `iter_torch_batches`),
checkpoint upload to object storage and restarts after worker failures; everything else is loop.py.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from workflows.config import WorkflowConfig
from workflows.errors import UserError
from workflows.preprocess.encoding import resolve_model_dir
from workflows.preprocess.materialize import ProcessedDataset
from workflows.storage.uri import StorageContext, exists, filesystem, pyarrow_filesystem, read_json, with_protocol, write_json
from workflows.train import checkpoint as ckpt
from workflows.train.loop import collate, evaluate, make_optimizer, make_scheduler, steps_per_epoch, train_epoch
from workflows.train.models import load_classifier
from workflows.train.parallel import parallelize

SHUFFLE_BUFFER = 2048


def _pad_collate(pad_id: int):
    """loop.collate as the collate-function class Ray Data's iter_torch_batches expects."""
    from ray.data.collate_fn import NumpyBatchCollateFn

    class PadCollate(NumpyBatchCollateFn):
        def __call__(self, batch):
            return collate(batch, pad_id)

    return PadCollate()


def worker_loop(spec: dict) -> None:
    """Runs on every Ray Train worker."""
    import ray.train
    import ray.train.torch

    cfg = WorkflowConfig.model_validate(spec["cfg"])
    tc = cfg.train
    ctx = ray.train.get_context()
    world_size = ctx.get_world_size()
    torch.set_num_threads(tc.torch_threads or max(1, int(tc.cpus_per_worker)))
    torch.manual_seed(tc.seed)
    device = ray.train.torch.get_device()

    model = load_classifier(spec["model_dir"], spec["labels"], cfg.model.dropout)
    if tc.freeze_embeddings:
        model.get_input_embeddings().requires_grad_(False)
    model = parallelize(model, tc.strategy, device)
    optimizer = make_optimizer(model, tc.lr, tc.weight_decay)
    total_steps = steps_per_epoch(spec["train_rows"], world_size, tc.batch_size) * tc.epochs
    scheduler = make_scheduler(optimizer, total_steps, tc.warmup_fraction)

    start_epoch, history = 0, []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = ckpt.load(d, model, optimizer, scheduler)
        start_epoch, history = saved["epoch"] + 1, saved.get("history", [])

    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    to_batch = _pad_collate(spec["pad_id"])
    for epoch in range(start_epoch, tc.epochs):
        batches = train_shard.iter_torch_batches(
            batch_size=tc.batch_size, collate_fn=to_batch,
            local_shuffle_buffer_size=SHUFFLE_BUFFER, local_shuffle_seed=tc.seed + epoch,
        )
        stats = train_epoch(model, batches, optimizer, scheduler, device, tc.grad_clip)
        val = evaluate(model, val_shard.iter_torch_batches(batch_size=cfg.evaluate.batch_size, collate_fn=to_batch), len(spec["labels"]), device)
        metrics = {**stats, "epoch": epoch, "val_f1": val["f1"], "val_accuracy": val["accuracy"], "val_loss": val["loss"]}
        history.append(metrics)
        with tempfile.TemporaryDirectory() as d:
            ckpt.save(d, model, optimizer, scheduler, {"epoch": epoch, "metrics": metrics, "history": history})
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        if ctx.get_world_rank() == 0:  # every epoch's metrics, for summaries and curves
            write_json(f"{spec['run_uri']}/history.json", history, spec["storage"])


@dataclass
class TrainOutcome:
    run_name: str
    run_uri: str
    best_checkpoint_uri: str
    best_metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def check_resources(num_workers: int, cpus_per_worker: float, use_gpu: bool, what: str = "train") -> None:
    """Fail fast with the numbers instead of waiting for resources that never come."""
    import ray

    total = ray.cluster_resources()
    need_cpu = num_workers * cpus_per_worker
    if need_cpu > total.get("CPU", 0):
        raise UserError(
            f"{what} asks for {num_workers} worker(s) x {cpus_per_worker:g} CPU = {need_cpu:g} CPUs, "
            f"but the Ray cluster has {total.get('CPU', 0):g}; lower {what}.num_workers or cpus_per_worker"
        )
    if use_gpu and num_workers > total.get("GPU", 0):
        raise UserError(f"{what} asks for {num_workers} GPU worker(s), but the Ray cluster has {total.get('GPU', 0):g} GPUs")


def _runs_root(cfg: WorkflowConfig) -> str:
    return cfg.uri("runs")


def latest_checkpoint(cfg: WorkflowConfig, ctx: StorageContext, prefix: str) -> str | None:
    """URI of the newest complete checkpoint of the newest run named `prefix-*`."""
    fs, root = filesystem(_runs_root(cfg), ctx)
    try:
        runs = sorted((p for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[-1].startswith(prefix + "-")), reverse=True)
    except FileNotFoundError:
        return None
    for run in runs:
        checkpoints = sorted((p for p in fs.ls(run, detail=False) if p.rsplit("/", 1)[-1].startswith("checkpoint_")), reverse=True)
        for c in checkpoints:
            if fs.exists(f"{c}/.metadata") and fs.exists(f"{c}/{ckpt.STATE_FILE}"):
                return with_protocol(cfg.storage.root, c)
    return None


def fit(cfg: WorkflowConfig, storage: StorageContext, data: ProcessedDataset, *, run_prefix: str | None = None,
        callbacks: list | None = None, resume: bool = False, check: bool = True) -> TrainOutcome:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    tc = cfg.train
    if check:
        check_resources(tc.num_workers, tc.cpus_per_worker, tc.use_gpu)
    model_dir = resolve_model_dir(cfg.model.name_or_path)
    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(resolve_model_dir(data.tokenizer)).pad_token_id or 0

    train_ds = data.read("train", storage, num_cpus=0, cache=cfg.cache)
    train_rows = data.counts["train"]
    if tc.max_train_rows is not None and tc.max_train_rows < train_rows:
        train_ds = train_ds.limit(tc.max_train_rows)
        train_rows = tc.max_train_rows
    val_ds = data.read("val", storage, num_cpus=0, cache=cfg.cache)
    if tc.max_val_rows is not None:
        val_ds = val_ds.limit(tc.max_val_rows)
    datasets = {"train": train_ds, "val": val_ds}

    prefix = run_prefix or f"{cfg.name}-train"
    resume_from = None
    if resume:
        uri = latest_checkpoint(cfg, storage, prefix)
        if uri is None:
            raise UserError(f"--resume: no checkpoint of a run named {prefix}-* under {_runs_root(cfg)}")
        fs, path = pyarrow_filesystem(uri, storage)
        resume_from = ray.train.Checkpoint(path=path, filesystem=fs)
    run_name = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid() % 10000:04d}"
    pa_fs, runs_path = pyarrow_filesystem(_runs_root(cfg), storage)
    run_uri = f"{_runs_root(cfg)}/{run_name}"
    spec = {"cfg": cfg.model_dump(mode="json"), "labels": data.labels, "model_dir": model_dir,
            "train_rows": train_rows, "pad_id": pad_id, "run_uri": run_uri, "storage": storage}
    trainer = TorchTrainer(
        worker_loop,
        train_loop_config=spec,
        torch_config=TorchConfig(backend="nccl" if tc.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=tc.num_workers, use_gpu=tc.use_gpu, resources_per_worker={"CPU": tc.cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=run_name, storage_path=runs_path, storage_filesystem=pa_fs,
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=tc.num_to_keep, checkpoint_score_attribute="val_f1", checkpoint_score_order="max",
            ),
            failure_config=ray.train.FailureConfig(max_failures=tc.max_failures),
            callbacks=callbacks or None,
        ),
        datasets=datasets,
        resume_from_checkpoint=resume_from,
    )
    t0 = time.time()
    result = trainer.fit()
    best = result.get_best_checkpoint("val_f1", "max") if result.best_checkpoints else None
    if best is None:
        raise RuntimeError(f"training run {run_name} finished without a checkpoint")
    best_metrics = next(m for c, m in result.best_checkpoints if c.path == best.path)
    history_uri = f"{run_uri}/history.json"
    history = read_json(history_uri, storage) if exists(history_uri, storage) else []
    return TrainOutcome(
        run_name=run_name, run_uri=run_uri, best_checkpoint_uri=with_protocol(cfg.storage.root, best.path),
        best_metrics=dict(best_metrics), history=history, seconds=time.time() - t0,
    )

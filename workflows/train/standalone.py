"""The training loop without Ray: torchrun (or one plain process) over the processed parquet files.

    torchrun --nproc_per_node=N -m workflows.train.standalone --config FILE [--set k=v ...]
    python -m workflows.train.standalone --config FILE [--set k=v ...]          # world size 1

Same model building, FSDP2/DDP wrapping, epochs, seeds and checkpoint format as the Ray Train
path (one engine.Trainer; this module is its torchrun adapter); only the plumbing differs: the
process group comes from torchrun's environment, each rank reads its contiguous equal share of
the split's rows straight from the parquet files (pyarrow, from the object store through the
storage context, or a local directory) or, with train.loader=stream, its share of the epoch's
global order as a Ray Train worker does (local_input), and checkpoints go to a local `--checkpoint-dir`.
It measures what Ray adds (`workflows bench train`) and runs on GPU machines without Ray.

The processed dataset is the one `workflows preprocess` materialized for this config (found by
its version, computed as preprocessing does, without Ray), or `--data URI` (a processed-dataset
directory holding manifest.json and split=<name>/*.parquet, in the object store or local).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from workflows.config import WorkflowConfig, load_config
from workflows.dataset import ProcessedDataset
from workflows.errors import UserError
from workflows.loader.columns import column_values
from workflows.parallel import exit_rank, world
from workflows.runtime import runtime
from workflows.seeds import augment_seed, data_seed
from workflows.storage import cache_stats
from workflows.storage.atomic import atomic_write
from workflows.storage.shards import read_parquet
from workflows.storage.uri import StorageContext, exists, join
from workflows.tasks import get_task
from workflows.tasks.seams import DatasetSeam
from workflows.tracking.run_logger import RunLogger
from workflows.tracking.session import Tracking
from workflows.train import checkpoint as ckpt
from workflows.train.engine import Trainer
from workflows.train.loop import epoch_line
from workflows.train.stream_input import StreamInput, stream_refused
from workflows.train.worker_setup import (
    join_torchrun_group,
    row_limits,
    set_torch_threads,
    torchrun_device,
    train_rows_kept,
    val_positions,
)

PROCESS_START = time.time()


def find_dataset(cfg: WorkflowConfig, storage: StorageContext, uri: str | None = None) -> ProcessedDataset:
    """The processed dataset of `cfg` (as `workflows preprocess` wrote it), or the one at `uri`."""
    if uri is None:
        from workflows.preprocess.sources import list_shards

        shards, _ = list_shards(cfg.data.source, storage, cfg.data.format)
        version = get_task(cfg).dataset.version(shards, storage)
        uri = cfg.uri("processed", version)
        if not exists(join(uri, "manifest.json"), storage):
            raise UserError(f"no processed dataset for this config at {uri}: run `workflows preprocess` first")
        return ProcessedDataset.load(uri, storage)
    if not exists(join(uri, "manifest.json"), storage):
        raise UserError(f"{uri}: not a processed dataset (no manifest.json)")
    return ProcessedDataset.load(uri, storage)  # a copy too: its files are found where it is


def read_rows(files: list[str], storage: StorageContext, columns: tuple[str, ...] | list[str],
              limit: int | None = None, shard_cache=None) -> dict[str, Any]:
    """The task's stored `columns` of the first `limit` rows of these parquet files, in file order
    (the rows Ray Data's `limit` keeps with preserve_order); through `shard_cache` if given. A
    variable-length tensor column (token ids) becomes a list of arrays, any other a numpy array."""
    import pyarrow as pa

    tables, n = [], 0
    for uri in files:
        if limit is not None and n >= limit:
            break
        t = read_parquet(uri, storage, list(columns), shard_cache)
        tables.append(t)
        n += t.num_rows
    if not tables:
        raise UserError("no parquet files to read")
    table = pa.concat_tables(tables)
    if limit is not None:
        table = table.slice(0, limit)
    return {c: column_values(table.column(c)) for c in columns}


def read_split(data: ProcessedDataset, split: str, storage: StorageContext, cfg: WorkflowConfig,
               limit: int | None) -> dict[str, list]:
    """The first `limit` rows of a split (the rows Ray Data's `limit` keeps with preserve_order),
    through this node's shard cache, counted in the cluster's cache totals like Ray Data reads."""
    shard_cache = cfg.cache.shard_cache(storage) if cfg.cache.enabled else None
    before = shard_cache.stats() if shard_cache is not None else None
    rows = read_rows(data.files[split], storage, get_task(cfg).columns, limit, shard_cache=shard_cache)
    if shard_cache is not None:
        cache_stats.report(before, shard_cache.stats())
    return rows


def row_count(rows: dict[str, Any]) -> int:
    return len(next(iter(rows.values())))


def rank_share(rows: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's contiguous share; equal shares (the remainder is dropped, as Ray's equal split does)."""
    per = row_count(rows) // world_size
    lo, hi = rank * per, (rank + 1) * per
    return {c: v[lo:hi] for c, v in rows.items()}


def batches(rows: dict[str, Any], batch_size: int, collate: Callable, seed: int | None = None) -> Iterator[dict]:
    """Batches of `rows` through the task's `collate`, in a seeded random order (seed=None: file order)."""
    n = row_count(rows)
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    for i in range(0, n, batch_size):
        idx = order[i: i + batch_size]
        yield collate({c: take(v, idx) for c, v in rows.items()})


def take(values, idx: np.ndarray):
    return values[idx] if isinstance(values, np.ndarray) else [values[j] for j in idx]


def epoch_batches(task, data, rows: dict[str, Any], batch_size: int, seed: int, epoch: int,
                  rank: int = 0) -> Iterator[dict]:
    """One epoch's training batches: rows in an order seeded by (seed, epoch, rank), the task's
    augmentation by (seed, epoch) and the sample, never the rank."""
    collate = task.collate(data, train=True, seed=augment_seed(seed, epoch))
    order = data_seed(seed, epoch, rank)
    return batches(rows, batch_size, collate, order)


@contextmanager
def storage_for(cfg: WorkflowConfig, rank: int, world_size: int) -> Iterator[StorageContext]:
    """The object store; with the embedded endpoint, rank 0 starts it (or attaches to a running
    one) before the other ranks attach, and stops it only after they are done."""
    if not cfg.storage.embedded.enabled:
        yield StorageContext.from_config(cfg.storage)
        return

    barrier = dist.barrier if world_size > 1 else (lambda: None)
    if rank != 0:
        barrier()
    with runtime(cfg, ray_needed=False) as rt:
        if rank == 0:
            barrier()
        try:
            yield rt.storage
        finally:
            barrier()


class RowsInput:
    """The batches of a launcher without Ray Train (torchrun, a one-worker Tune trial): its validation
    rows, read into memory, in file order; training from `stream` (train.loader=stream: this rank's
    share of the epoch's global order, as a Ray Train worker reads it) or else from this rank's
    share of the training rows in memory, in a new order each epoch (epoch_batches). No step
    checkpoints are taken from it, so an epoch always starts at its first sample."""

    def __init__(self, cfg: WorkflowConfig, task, data: ProcessedDataset, train_rows: dict[str, Any],
                 val_rows: dict[str, Any], rank: int = 0, stream: StreamInput | None = None):
        self.cfg, self.task, self.data, self.rank = cfg, task, data, rank
        self.train_rows, self.val_rows, self.stream = train_rows, val_rows, stream
        self.eval_batch = task.collate(data, train=False)

    def train(self, epoch: int, skip: int) -> Iterator[dict]:
        if self.stream is not None:
            return self.stream.train_batches(epoch, skip)
        tc = self.cfg.train
        return epoch_batches(self.task, self.data, self.train_rows, tc.batch_size, tc.seed, epoch, self.rank)

    def val(self) -> Iterator[dict]:
        return batches(self.val_rows, self.cfg.evaluate.batch_size, self.eval_batch)

    def probe(self) -> Iterator[dict]:
        if self.stream is not None:
            return self.stream.batches(0, 0, self.eval_batch, record=False)
        return batches(self.train_rows, self.cfg.evaluate.batch_size, self.eval_batch)


def local_input(cfg: WorkflowConfig, task, data: ProcessedDataset, storage: StorageContext,
                read: Callable[[str, int | None], dict[str, Any]], rank: int = 0,
                world_size: int = 1) -> tuple[RowsInput, int]:
    """This rank's input under torchrun or in a one-worker Tune trial, the one a Ray Train worker
    reads with the same settings: train.loader=stream (the image task's model.options.image_input
    included) through StreamInput, else the training rows read into memory (`read(split, limit)`),
    this rank's contiguous equal share. Returns it and the training examples per epoch over all ranks."""
    tc = cfg.train
    train_limit, val_limit = row_limits(tc, data.counts["train"])
    val_rows = task.dataset.prepare_rows(read("val", val_limit))
    share = val_positions(row_count(val_rows), rank, world_size)
    val_rows = {c: v[share] for c, v in val_rows.items()}
    if tc.loader == "stream":
        if type(task.dataset).prepare_rows is not DatasetSeam.prepare_rows:
            raise stream_refused(cfg)
        rows = train_rows_kept(tc, data.counts["train"])
        stream = StreamInput(cfg, data, storage, rank, world_size, rows, task=task)
        return RowsInput(cfg, task, data, {}, val_rows, rank, stream), rows
    train_rows = task.dataset.prepare_rows(read("train", train_limit))
    return RowsInput(cfg, task, data, rank_share(train_rows, rank, world_size), val_rows, rank), row_count(train_rows)


class TorchrunTrainer(Trainer):
    """The Trainer under torchrun: rank 0 prints each epoch; every rank writes its shard of the
    epoch's checkpoint into `checkpoint_dir/epoch_NNNN` (if given)."""

    def __init__(self, *args, checkpoint_dir: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint_dir = checkpoint_dir

    def end_of_epoch(self, epoch: int, metrics: dict) -> None:
        if self.rank == 0:
            print(f"standalone: {epoch_line(metrics)}", file=sys.stderr, flush=True)
        if self.checkpoint_dir:
            d = os.path.join(self.checkpoint_dir, f"epoch_{epoch:04d}")
            os.makedirs(d, exist_ok=True)
            self.save_checkpoint(d, epoch, metrics)


def train(
    cfg: WorkflowConfig,
    storage: StorageContext,
    data: ProcessedDataset,
    *,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    stop_after_epoch: int | None = None,
    logger: RunLogger | None = None,
) -> dict:
    """Train on this process's rank; returns the summary (identical on every rank). `logger`
    (rank 0's): the MLflow run that each epoch's metrics go to."""
    tc = cfg.train
    task = get_task(cfg)
    rank, world_size = world()
    device = torchrun_device(tc.use_gpu and torch.cuda.is_available())
    set_torch_threads(tc)

    t_read = time.perf_counter()
    source, total_rows = local_input(cfg, task, data, storage,
                                     lambda split, limit: read_rows(data.files[split], storage, task.columns, limit),
                                     rank, world_size)
    read_seconds = time.perf_counter() - t_read

    trainer = TorchrunTrainer(cfg, task, data, device, source, total_rows, logger, checkpoint_dir=checkpoint_dir)
    trainer.build(probe=not resume)
    if resume:
        found = ckpt.latest_local(checkpoint_dir) if checkpoint_dir else None
        if found is None:
            raise UserError(f"--resume: no complete checkpoint under {checkpoint_dir}")
        trainer.resume(found)

    started = time.time()
    history = trainer.fit(stop_after=stop_after_epoch)
    return {
        "world_size": world_size,
        "strategy": tc.strategy if world_size > 1 else "none (single process)",
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "batch_size": tc.batch_size,
        "train_rows": total_rows,
        "dataset": data.uri,
        "read_seconds": round(read_seconds, 3),
        "startup_seconds": round(started - PROCESS_START, 3),
        "train_seconds": round(time.time() - started, 3),
        "history": history,
    }


@contextmanager
def tracked_run(cfg: WorkflowConfig, storage: StorageContext, rank: int) -> Iterator[RunLogger | None]:
    """Rank 0's MLflow run, `train (torchrun)`, as the Ray path's train run: the config as params,
    each epoch's metrics; FAILED if training raises. Other ranks, or tracking off: None."""
    if rank != 0 or not cfg.tracking.enabled:
        yield None
        return

    tracking = Tracking(cfg, storage)
    try:
        with tracking.stage("train (torchrun)") as run:
            spec = run.spec()
            with RunLogger(spec) if spec is not None else nullcontext() as logger:
                yield logger
    finally:
        tracking.close(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.train.standalone", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", default="quickstart")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value (repeatable)"
    )
    p.add_argument("--data", help="URI of a processed dataset (default: the one preprocessing made for the config)")
    p.add_argument("--output", help="summary JSON (default: <output_dir>/<name>/standalone.json)")
    p.add_argument("--checkpoint-dir", help="local directory for a sharded checkpoint per epoch")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument(
        "--stop-after-epoch", type=int, help="stop after this epoch (the LR schedule still spans train.epochs)"
    )
    args = p.parse_args(argv)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(args.config, args.set)
        join_torchrun_group(cfg.train.use_gpu and torch.cuda.is_available())
        rank = world()[0]
        with storage_for(cfg, rank, world_size) as storage, tracked_run(cfg, storage, rank) as logger:
            data = find_dataset(cfg, storage, args.data)
            summary = train(
                cfg,
                storage,
                data,
                checkpoint_dir=args.checkpoint_dir,
                resume=args.resume,
                stop_after_epoch=args.stop_after_epoch,
                logger=logger,
            )
        summary["wall_seconds"] = round(time.time() - PROCESS_START, 3)
        if rank == 0:
            out = Path(args.output or Path(cfg.output_dir) / cfg.name / "standalone.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(out, json.dumps(summary, indent=2, sort_keys=True))
            print(f"standalone: summary written to {out}", file=sys.stderr, flush=True)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main())

"""The training loop without Ray: torchrun (or one plain process) over the processed parquet files.

    torchrun --nproc_per_node=N -m workflows.train.standalone --config FILE [--set k=v ...]
    python -m workflows.train.standalone --config FILE [--set k=v ...]          # world size 1

Same model building, FSDP2/DDP wrapping, epochs, seeds and checkpoint format as the Ray Train
path (loop.build_training / loop.run_epochs / checkpoint.py); only the plumbing differs: the
process group comes from torchrun's environment, each rank reads its contiguous equal share of
the split's rows straight from the parquet files (pyarrow, from the object store through the
storage context, or a local directory), and checkpoints go to a local `--checkpoint-dir`.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from workflows.config import WorkflowConfig, load_config
from workflows.errors import UserError
from workflows.preprocess.encoding import resolve_model_dir
from workflows.preprocess.materialize import ProcessedDataset
from workflows.storage.atomic import atomic_write
from workflows.storage.uri import StorageContext, exists, filesystem, join, read_json, with_protocol
from workflows.tracking.client import RunLogger
from workflows.train import checkpoint as ckpt
from workflows.train.loop import build_training, collate, data_seed, epoch_line, run_epochs
from workflows.train.parallel import exit_rank, world
from workflows.train.worker_setup import (
    join_torchrun_group,
    pad_and_vocab,
    row_limits,
    set_torch_threads,
    start_point,
    torchrun_device,
)

PROCESS_START = time.time()


def find_dataset(cfg: WorkflowConfig, storage: StorageContext, uri: str | None = None) -> ProcessedDataset:
    """The processed dataset of `cfg` (as `workflows preprocess` wrote it), or the one at `uri`."""
    if uri is None:
        from workflows.preprocess.materialize import dataset_version
        from workflows.preprocess.sources import list_shards

        shards, _ = list_shards(cfg.data.source, storage, cfg.data.format)
        version = dataset_version(shards, cfg, resolve_model_dir(cfg.preprocess.tokenizer))
        uri = cfg.uri("processed", version)
        if not exists(join(uri, "manifest.json"), storage):
            raise UserError(f"no processed dataset for this config at {uri}: run `workflows preprocess` first")
        return ProcessedDataset.load(uri, storage)
    if not exists(join(uri, "manifest.json"), storage):
        raise UserError(f"{uri}: not a processed dataset (no manifest.json)")
    m = read_json(join(uri, "manifest.json"), storage)
    data = ProcessedDataset(**{k: m[k] for k in ProcessedDataset.__dataclass_fields__ if k in m})
    data.uri = uri
    fs, path = filesystem(uri, storage)  # a copy: its files are where it is, not where it was written
    data.files = {s: [with_protocol(uri, p) for p in sorted(fs.glob(f"{path.rstrip('/')}/split={s}/*.parquet"))]
                  for s in data.files}
    return data


def read_rows(files: list[str], storage: StorageContext, limit: int | None = None, shard_cache=None) -> dict[str, list]:
    """`input_ids` and `label_id` of the first `limit` rows of these parquet files, in file order
    (the rows Ray Data's `limit` keeps with preserve_order); through `shard_cache` if given."""
    import pyarrow as pa

    from workflows.storage.shards import read_parquet

    tables, n = [], 0
    for uri in files:
        if limit is not None and n >= limit:
            break
        t = read_parquet(uri, storage, ["input_ids", "label_id"], shard_cache)
        tables.append(t)
        n += t.num_rows
    if not tables:
        raise UserError("no parquet files to read")
    table = pa.concat_tables(tables)
    if limit is not None:
        table = table.slice(0, limit)
    return {"input_ids": token_lists(table.column("input_ids")),
            "label_id": table.column("label_id").to_numpy().astype(np.int64)}


def token_lists(column) -> list[np.ndarray]:
    """Token id rows of an `input_ids` column as Ray Data writes it: a variable-shaped tensor
    (extension type over a {data, shape} struct), a fixed-shape one, or a plain list column."""
    import pyarrow as pa

    arr = column.combine_chunks()
    if isinstance(arr.type, pa.ExtensionType):
        arr = arr.storage
    if pa.types.is_struct(arr.type):
        arr = arr.flatten()[arr.type.get_field_index("data")]  # flatten() honours the slice offset
    return list(arr.to_numpy(zero_copy_only=False))


def rank_share(rows: dict[str, list], rank: int, world_size: int) -> dict[str, list]:
    """This rank's contiguous share; equal shares (the remainder is dropped, as Ray's equal split does)."""
    per = len(rows["label_id"]) // world_size
    lo, hi = rank * per, (rank + 1) * per
    return {"input_ids": rows["input_ids"][lo:hi], "label_id": rows["label_id"][lo:hi]}


def packed_rows(rows: dict[str, list], seq_len: int) -> dict[str, list]:
    """Causal LM: token rows -> blocks of seq_len tokens (lm.pack_batch per lm.PACK_ROWS rows, as Ray
    Data's map_batches packs them); label_id is unused there but keeps the row count."""
    from workflows.train.lm import PACK_ROWS, pack_batch

    ids = rows["input_ids"]
    parts = [
        pack_batch({"input_ids": ids[i : i + PACK_ROWS]}, seq_len)["input_ids"] for i in range(0, len(ids), PACK_ROWS)
    ]
    blocks = np.concatenate(parts) if parts else np.zeros((0, seq_len), np.int64)
    return {"input_ids": list(blocks), "label_id": np.zeros(len(blocks), np.int64)}


def batches(
    rows: dict[str, list], batch_size: int, pad_id: int, seed: int | None = None, lm: bool = False
) -> Iterator[dict]:
    """Padded batches (or packed causal-LM blocks) in a seeded random order (seed=None: file order)."""
    from workflows.train.lm import lm_collate

    n = len(rows["label_id"])
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    for i in range(0, n, batch_size):
        idx = order[i : i + batch_size]
        if lm:
            yield lm_collate([rows["input_ids"][j] for j in idx])
        else:
            yield collate({"input_ids": [rows["input_ids"][j] for j in idx], "label_id": rows["label_id"][idx]}, pad_id)


@contextmanager
def storage_for(cfg: WorkflowConfig, rank: int, world_size: int) -> Iterator[StorageContext]:
    """The object store; with the embedded endpoint, rank 0 starts it (or attaches to a running
    one) before the other ranks attach, and stops it only after they are done."""
    if not cfg.storage.embedded.enabled:
        yield StorageContext.from_config(cfg.storage)
        return
    from workflows.runtime import runtime

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
    lm = cfg.model.task == "causal_lm"
    rank, world_size = world()
    device = torchrun_device(tc.use_gpu and torch.cuda.is_available())
    set_torch_threads(tc)
    pad_id, vocab_size = pad_and_vocab(data.tokenizer)

    t_read = time.perf_counter()
    train_limit, val_limit = row_limits(tc, data.counts["train"])
    train_rows = read_rows(data.files["train"], storage, train_limit)
    val_rows = read_rows(data.files["val"], storage, val_limit)
    if lm:  # rows -> blocks of seq_len tokens, as the Ray path packs them
        train_rows, val_rows = (packed_rows(r, cfg.model.lm.seq_len) for r in (train_rows, val_rows))
    read_seconds = time.perf_counter() - t_read
    total_rows = len(train_rows["label_id"])
    train_rows, val_rows = rank_share(train_rows, rank, world_size), rank_share(val_rows, rank, world_size)

    probe = None if resume or lm else batches(train_rows, cfg.evaluate.batch_size, pad_id)
    model, optimizer, scheduler = build_training(
        cfg, resolve_model_dir(cfg.model.name_or_path), data.labels, device, total_rows, vocab_size, probe
    )
    found = None
    if resume:
        found = ckpt.latest_local(checkpoint_dir) if checkpoint_dir else None
        if found is None:
            raise UserError(f"--resume: no complete checkpoint under {checkpoint_dir}")
    start_epoch, history, resumed_from, _ = start_point(found, model, optimizer, scheduler)
    last_epoch = tc.epochs - 1 if stop_after_epoch is None else min(stop_after_epoch, tc.epochs - 1)

    class Stop(Exception):
        pass

    def end_of_epoch(epoch: int, metrics: dict, history: list[dict]) -> None:
        if rank == 0:
            print(f"standalone: {epoch_line(metrics)}", file=sys.stderr, flush=True)
            if logger is not None:
                logger.log_epoch(metrics, history[-1].get("step_losses"))
        if checkpoint_dir:
            d = os.path.join(checkpoint_dir, f"epoch_{epoch:04d}")
            os.makedirs(d, exist_ok=True)
            ckpt.save(
                d,
                model,
                optimizer,
                scheduler,
                {"epoch": epoch, "global_step": metrics["global_step"], "metrics": metrics, "history": history},
            )
        if epoch >= last_epoch:
            raise Stop

    started = time.time()
    try:
        run_epochs(
            cfg,
            model,
            optimizer,
            scheduler,
            device,
            len(data.labels),
            start_epoch=start_epoch,
            history=history,
            resumed_from_epoch=resumed_from,
            train_batches=lambda epoch: batches(train_rows, tc.batch_size, pad_id, data_seed(tc.seed, epoch, rank), lm),
            val_batches=lambda: batches(val_rows, cfg.evaluate.batch_size, pad_id, lm=lm),
            end_of_epoch=end_of_epoch,
        )
    except Stop:
        pass
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
    from workflows.tracking.session import Tracking

    tracking = Tracking(cfg, storage)
    try:
        with tracking.stage("train (torchrun)") as run:
            spec = run.spec()
            logger = RunLogger(spec) if spec is not None else None
            try:
                yield logger
            finally:
                if logger is not None:
                    logger.close(timeout=30)
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

"""What a training process sets up the same way under Ray Train (ray_worker.py) and torchrun
(standalone.py, bench/lm.py): threads, row caps, the epoch to start from
and, under torchrun, the process group and device (Ray Train brings its own)."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from workflows.train import checkpoint as ckpt


def set_torch_threads(tc) -> None:
    """Intra-op threads: train.torch_threads, else one per CPU the worker is given, up to its machine's cores
    (a cluster can be started with more logical CPUs than cores: threads beyond them only wait)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(tc.torch_threads or max(1, min(int(tc.cpus_per_worker), cores)))


def row_limits(tc, train_rows: int) -> tuple[int | None, int | None]:
    """(train, val) rows to keep, the first ones in file order; None: all of them."""
    train = tc.max_train_rows if tc.max_train_rows is not None and tc.max_train_rows < train_rows else None
    return train, tc.max_val_rows


def train_rows_kept(tc, train_rows: int) -> int:
    """How many of the split's `train_rows` training rows a run keeps (row_limits' train limit, else all)."""
    limit = row_limits(tc, train_rows)[0]
    return limit if limit is not None else train_rows


# Validation rows per rank below which every rank scores the whole split (val_positions)
VAL_SHARE_MIN_ROWS_PER_RANK = 1024


def val_positions(rows: int, rank: int, world_size: int) -> slice:
    """The positions of the validation split that this rank scores: all of them, or every
    world_size-th from `rank`.

    The ranks must run the same number of forward passes (FSDP2 gathers parameters in each), so
    equal shares leave out up to world_size - 1 rows; in the tiny quickstart that was 1 of 13 val
    rows, and the card's val F1 (0.447) was not what `evaluate --split val` of the registered model
    said (0.496). A task's val metrics are ratios of sums over rows, all-reduced over the ranks
    (loop.evaluate, a causal LM's token loss, a plug-in's R2), which every rank scoring the same
    rows leaves exactly as over the split once. So a small split (`rows`, an upper bound where a
    task reshapes its rows) is scored whole by every rank; a large one is shared, and the rows left
    out are fewer than world_size of at least VAL_SHARE_MIN_ROWS_PER_RANK * world_size."""
    if world_size == 1 or rows < VAL_SHARE_MIN_ROWS_PER_RANK * world_size:
        return slice(None)
    return slice(rank, None, world_size)


class StartPoint(NamedTuple):
    epoch: int  # the first epoch to train (the checkpoint's own, when it was taken mid-epoch)
    history: list[dict]  # the epochs before it
    resumed_from: int | None  # the checkpoint's epoch; None: from scratch
    saved: dict | None  # the checkpoint's train state


def start_point(directory: str | None, model, optimizer, scheduler) -> StartPoint:
    """From scratch (`directory` None), or the epoch after the checkpoint in `directory`, whose
    model, optimizer and scheduler state are loaded in place; a step checkpoint (`consumed`, see
    mid_epoch_position) continues its own epoch."""
    if directory is None:
        return StartPoint(0, [], None, None)
    saved = ckpt.load(directory, model, optimizer, scheduler)
    epoch = saved["epoch"] if mid_epoch_position(saved) else saved["epoch"] + 1
    return StartPoint(epoch, saved.get("history", []), saved["epoch"], saved)


def mid_epoch_position(saved: dict | None) -> int:
    """Global samples of the checkpoint's epoch already trained on (a step checkpoint), else 0."""
    return int((saved or {}).get("consumed") or 0)


def join_torchrun_group(gpu: bool) -> None:
    """torchrun's ranks join the process group its environment describes (NCCL on GPU, else gloo);
    a single process has none."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if gpu else "gloo")


def torchrun_device(gpu: bool) -> torch.device:
    """This rank's GPU (torchrun's LOCAL_RANK), made the current one, or the CPU."""
    if not gpu:
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device

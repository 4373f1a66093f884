"""Parallelism applied to a plain model, separately from the model code: FSDP2 or DDP, and the
process group's helpers (rank and world size, all-reduce, a rank's exit). Pure PyTorch, below the
tasks and the training engine alike: a task reads its rank here, the engine wraps its model."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformer (the largest ModuleList of same-typed modules).

    FSDP2 shards each block as its own unit, so only one block's full parameters are gathered at a
    time. Found structurally, so BERT-, GPT- and Llama-style models all work without a table.
    """
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                best = list(module)
    return best


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def parallelize(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """FSDP2 (`fully_shard` per transformer block, then the root) or DDP.

    bf16 mixed precision on GPU (params and activations in bf16, gradients reduced in fp32);
    fp32 on CPU, where bf16 matmuls are slow. Ray's prepare_model(parallel_strategy="fsdp")
    refuses CPU, so FSDP2 is applied here directly. Single process, or a group of one: the plain
    model (nothing to shard or reduce across; on GPU the loop's autocast gives bf16).
    """
    model.to(device)
    _, world_size = world()
    if world_size == 1:
        return model
    if not (dist.is_available() and dist.is_initialized()):
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if device.type == "cuda"
            else MixedPrecisionPolicy()
        )
        for block in transformer_blocks(model):
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Backward passes inside synchronize gradients across ranks only if `enabled`.

    DDP skips the all-reduce on all but the last micro-batch of an accumulated step (its gradients
    are full-size either way). FSDP2 keeps reduce-scattering every micro-batch: skipping it would
    keep unsharded gradients between micro-batches, the memory FSDP exists to save.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    else:
        yield


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank's process: with several ranks, without interpreter finalization, where
    gloo's threads can abort the rank (SIGABRT) after its work is done; docs/guides/train.md says
    why. Callers have written their results (temp name, then rename) and left their context managers."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def unwrap(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if world()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_have(flag: bool, device: torch.device) -> bool:
    """True while every rank still has a batch: FSDP/DDP collectives need the same step count on all."""
    if world()[1] == 1:
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


@torch.no_grad()
def sync_buffers(model: nn.Module) -> None:
    """Make every rank's floating-point buffers identical: BatchNorm's running statistics are per
    rank under FSDP2 and DDP (neither shards nor reduces buffers), so each rank would validate with
    statistics fitted to its own rows, and rank 0's would be exported.

    An all-reduce here rather than SyncBatchNorm: torch's SyncBatchNorm refuses CPU tensors (gloo),
    and syncing once before validation and export costs one collective per epoch, not one per
    forward. BatchNorm statistics are pooled (running_var is the pooled variance: the mean of the
    ranks' variances plus the variance of their means); any other float buffer is averaged.
    Called by engine.Trainer.run_epoch, so every driver (Ray Train, torchrun, Tune) validates and saves
    the same buffers."""
    if world()[1] == 1:
        return
    tensors: list[torch.Tensor] = []
    pooled: list[tuple[torch.Tensor, torch.Tensor]] = []  # (running_mean, running_var) of each BatchNorm
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_var is not None:
            mean, var = module.running_mean, module.running_var
            var.add_(mean * mean)  # E[x^2] per rank: its mean over ranks, less the pooled mean squared
            pooled.append((mean, var))
        transient: set[str] = getattr(module, "_non_persistent_buffers_set", set())  # not saved: derived, equal on all
        tensors += [b for name, b in module.named_buffers(recurse=False)
                    if b is not None and b.is_floating_point() and name not in transient]
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world()[1]
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
    for mean, var in pooled:
        var.sub_(mean * mean)

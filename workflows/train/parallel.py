"""Parallelism applied to a plain model, separately from the model code: FSDP2 or DDP."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn

from workflows.train.models import transformer_blocks


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def parallelize(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """FSDP2 (`fully_shard` per transformer block, then the root) or DDP.

    bf16 mixed precision on GPU (params and activations in bf16, gradients reduced in fp32);
    fp32 on CPU, where bf16 matmuls are slow. Ray's prepare_model(parallel_strategy="fsdp")
    refuses CPU, so FSDP2 is applied here directly. Single process: the plain model.
    """
    model.to(device)
    _, world_size = world()
    if world_size == 1 and strategy == "ddp":
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

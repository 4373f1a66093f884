"""The epoch's global sample order and how ranks share it. Pure functions of their arguments, no I/O.

One epoch is ONE sequence of global sample ids (a sample's id is its position in the index),
whatever the number of workers: the shards are permuted per (seed, epoch), then the samples of each
window of `window` consecutive shards of that permutation are shuffled together (a shuffle buffer
of `window` shards, so a rank reads only a few shards at a time).

Ranks consume that sequence in global steps: step k covers the positions
[bounds[k], bounds[k+1]) and rank r of W takes the r-th of W near-equal contiguous slices of it
(exactly `batch_size` each in every full step). So the union of a step's batches is exactly the
next positions of the sequence, and `consumed` = bounds[k] after k steps: resuming there, with any
W, continues the same sequence. The tail: a remainder of at least W positions is one more (short)
step; a smaller one is merged into the last step (its slices are then batch_size + 1), so that every
rank has a batch in every step (DDP/FSDP ranks must run the same number of steps, see
loop.in_step) and no sample is dropped.

Fewer than W positions left in the whole epoch (a resume near its end on more workers, or an epoch
smaller than W) is one step in which some slices are empty. Such a rank still takes part in the
step's collectives: its batch is a stand-in (`Batch.stand_in`), one sample of the step that another
rank trains on, which the training loop runs with zero weight (loop.train_epoch). So every rank
runs the same number of steps and each sample is trained exactly once, from any position on any W.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

STAND_IN = "stand_in"  # the key that marks a stand-in batch (StreamLoader, loop.train_epoch)


class Batch(NamedTuple):
    """One rank's batch of one global step: positions [lo, hi) of the epoch order. A stand-in
    (`stand_in`) is one position another rank trains on in the same step: read only so that this
    rank takes part in the step, trained with zero weight."""

    lo: int
    hi: int
    stand_in: bool = False


def shard_offsets(counts: Sequence[int]) -> np.ndarray:
    """[0, c0, c0+c1, ...]: the first global id of each shard, and the total at the end."""
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)


def epoch_order(index_counts: Sequence[int], seed: int, epoch: int, window: int = 4) -> np.ndarray:
    """The epoch's global order: an int64 array, a permutation of range(sum(index_counts))."""
    if window < 1:
        raise ValueError(f"shuffle window must be >= 1 shard, got {window}")
    offsets = shard_offsets(index_counts)
    rng = np.random.default_rng([int(seed), int(epoch)])
    perm = rng.permutation(len(index_counts))
    out = np.empty(int(offsets[-1]), dtype=np.int64)
    pos = 0
    for w in range(0, len(perm), window):
        ids = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in perm[w:w + window]])
        rng.shuffle(ids)
        out[pos:pos + len(ids)] = ids
        pos += len(ids)
    return out


def step_bounds(n: int, start: int, world_size: int, batch_size: int) -> np.ndarray:
    """Positions where each global step starts, then `n`: bounds[k] = samples consumed after k steps."""
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"world_size and batch_size must be >= 1, got {world_size}, {batch_size}")
    if not 0 <= start <= n:
        raise ValueError(f"start {start} is outside the epoch's {n} samples")
    per_step = world_size * batch_size
    full, rest = divmod(n - start, per_step)
    bounds = [start + k * per_step for k in range(full + 1)]
    if rest >= world_size or (rest and full == 0):
        bounds.append(n)  # a short last step (or the only one, however small)
    elif rest:
        bounds[-1] = n  # too few for one each: the last full step takes them
    return np.asarray(bounds, dtype=np.int64)


def rank_batches(n: int, start: int, world_size: int, rank: int, batch_size: int) -> list[Batch]:
    """Rank `rank`'s batches as position ranges of the epoch order, one per global step, none empty.

    A rank's slice of a step is empty only when fewer positions than ranks are left in the whole
    epoch; it is then a stand-in of the step's first position (see the module docstring)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    bounds = step_bounds(n, start, world_size, batch_size)
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        size = int(hi - lo)
        first, end = int(lo + rank * size // world_size), int(lo + (rank + 1) * size // world_size)
        out.append(Batch(first, end) if end > first else Batch(int(lo), int(lo) + 1, stand_in=True))
    return out

"""StreamLoader: one rank's batches of the epoch's global order (order.py), read by random access
from shards cached whole on local disk (storage.cache.ShardCache), decoded in worker processes.

Main process: plans the rank's batches (sample ids), fetches their shards through the cache in a
background thread pool, `prefetch_shards` ahead of the batch being planned (a cold epoch overlaps
download with decode), keeps each shard pinned until its last batch is delivered, and builds each
tar shard's member table once (tar headers). Worker processes (samples.py): os.pread of each
sample's bytes from the pinned local file and the per-sample transform; nothing holds a whole shard
in memory.

# why torch's DataLoader: it is the field's multi-process, in-order batch pipeline (worker
# processes with persistent_workers, prefetch_factor batches in flight per worker, pinned-memory
# hand-off, errors re-raised in the trainer with the worker's traceback). Our part is only the batch
# sampler (which global positions, from which local file) and the map-style dataset (pread +
# transform); the DataLoader yields batches in sampler order, so the order is ours, not
# completion order.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from workflows.errors import UserError
from workflows.loader.fork import iter_forked
from workflows.loader.index import DatasetIndex, ParquetRows, TarMembers, read_index, tar_members
from workflows.loader.order import STAND_IN, epoch_order, rank_batches, step_bounds
from workflows.loader.samples import Samples
from workflows.storage.cache import ShardCache
from workflows.storage.uri import StorageContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Local:
    """A shard fetched and pinned in the cache: its local path and (tar) member table."""

    path: str
    members: TarMembers | ParquetRows | None


def _identity(batch):
    return batch


class StreamLoader:
    """An iterable over one rank's batches of one epoch (see the module docstring and order.py).

    Images (a `wds-tar`, `raw` or `raw-parquet` index): {"image": uint8 [B, 3, S, S] (what
    `transform` returns, stacked), "label": int64 [B], "sample": int64 [B]} with
    `transform(bytes, sample_id, epoch)`, e.g. preprocess.images.ImageTransform (a `raw-parquet`
    sample's bytes: its row's value in the index's `column`). Parquet (parquet_index): the stored
    `columns` as numpy (what a task's collate takes) plus "sample". `start`: global samples of the
    epoch already consumed (from a checkpoint: `state()["consumed"]`); `set_epoch` moves on without
    new worker processes. A rank yields one batch per global step; a stand-in (order.Batch: when
    fewer samples than ranks are left) also holds `STAND_IN: True` and trains nothing.
    """

    def __init__(self, source: DatasetIndex | str, storage: StorageContext, cache, transform: Callable | None = None,
                 batch_size: int = 256, num_workers: int = 2, seed: int = 0, epoch: int = 0, rank: int = 0,
                 world_size: int = 1, start: int = 0, shuffle_window: int = 4, prefetch_shards: int = 2,
                 columns: list[str] | None = None, prefetch_factor: int = 2, pin_memory: bool = False):
        if not isinstance(cache, ShardCache):
            cache = cache.shard_cache(storage)  # a CacheConfig: the cache of this node
        self.cache = cache
        self.storage = storage
        self.index = source if isinstance(source, DatasetIndex) else read_index(source, storage, cache)
        if batch_size < 1 or num_workers < 0 or prefetch_shards < 0:
            raise UserError(f"StreamLoader: batch_size >= 1, num_workers >= 0 and prefetch_shards >= 0 needed, got "
                            f"{batch_size}, {num_workers}, {prefetch_shards}")
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.shuffle_window, self.prefetch_shards = shuffle_window, prefetch_shards
        self.transform = transform
        if self.index.format == "raw-parquet":
            columns = [self.index.column or ""]
        self._dataset = Samples(self.index.format, transform, columns)
        self._num_workers, self._prefetch_factor = num_workers, prefetch_factor
        self._pin_memory = pin_memory  # batches in pinned memory (the DataLoader's thread), for a GPU's copy
        self._loader = None
        # torch (about 1 s to import) is imported here, not by the first iteration's DataLoader: there
        # it ran before the batch sampler asked for the first shards, so a cold epoch's downloads
        # started a second late (a trainer has imported it long before; a script may not have)
        import torch.utils.data  # noqa: F401
        self._offsets = self.index.offsets
        self._pool = ThreadPoolExecutor(max(1, prefetch_shards), thread_name_prefix="shard-prefetch")
        self._open: dict[int, Future] = {}
        self._pins: dict[int, contextlib.ExitStack] = {}
        self._lock = threading.Lock()
        self._versions: dict[int, tuple[str, int]] = {}  # asked of the store: shards the index has no version of
        unversioned = sum(1 for s in self.index.shards if not (s.version and s.bytes))
        if unversioned:
            log.warning("the index of %s has no version for %d of its %d shards (written before indexes recorded "
                        "them): this loader asks the store for each of those once (a HEAD), so its first epoch "
                        "needs the store even when the cache holds every shard; rewrite the index to avoid it",
                        self.index.prefix or self.index.uri(0), unversioned, len(self.index.shards))
        self.fetch_wait_s = 0.0
        self.peak_pinned_bytes = self.peak_pinned_shards = 0
        self._cap_warned = False
        self.set_epoch(epoch, start)

    # -- the plan of one epoch ----------------------------------------------------------------
    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The next iteration yields this epoch's batches from global position `start` on."""
        n = len(self.index)
        self.epoch, self.start = epoch, start
        self._order = epoch_order(self.index.counts, self.seed, epoch, self.shuffle_window)
        self._bounds = step_bounds(n, start, self.world_size, self.batch_size)
        self._ranges = rank_batches(n, start, self.world_size, self.rank, self.batch_size)
        self._delivered = 0

    def __len__(self) -> int:
        """Batches this rank yields (one per global step; the same on every rank)."""
        return len(self._ranges)

    @property
    def consumed(self) -> int:
        """Global samples of the epoch consumed once every rank has taken as many batches as this one."""
        return int(self._bounds[self._delivered])

    @property
    def last_step_start(self) -> int:
        """The global position where the step of the batch last yielded starts."""
        return int(self._bounds[max(self._delivered - 1, 0)])

    def state(self) -> dict[str, int]:
        """What a checkpoint stores to resume here: {"epoch", "consumed"} (global samples)."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def stats(self) -> dict[str, Any]:
        """This loader's cache counters (all its fetches run in this process) and time spent
        waiting for a shard to arrive."""
        s = self.cache.stats()
        return {"hits": s.hits, "misses": s.misses, "bytes_from_store": s.bytes_from_store,
                "bytes_from_cache": s.bytes_from_cache, "evictions": s.evictions,
                "fetch_wait_s": round(self.fetch_wait_s, 3), "peak_pinned_bytes": self.peak_pinned_bytes}

    # -- shards ---------------------------------------------------------------------------------
    def _version(self, shard: int) -> tuple[str, int]:
        """The shard's (version, size), which the cache keys its entry on: from the index, so a
        cached shard is read with no request to the store (a warm epoch runs with the store down).
        For a shard the index has no version of, asked of the store once and kept for later epochs."""
        entry = self.index.shards[shard]
        if entry.version and entry.bytes:
            return entry.version, entry.bytes
        with self._lock:
            known = self._versions.get(shard)
        if known is None:
            known = self.cache.current_version(self.index.uri(shard))
            with self._lock:
                self._versions[shard] = known
        return known

    def _fetch(self, shard: int) -> _Local:
        uri = self.index.uri(shard)
        stack = contextlib.ExitStack()
        try:
            path = stack.enter_context(self.cache.open_local(uri, *self._version(shard)))
            members = self.index.members[shard] if self.index.members is not None else None  # "raw"
            if self.index.format == "wds-tar":
                members = tar_members(path, uri, self.index.labels)
                if len(members.offsets) != self.index.shards[shard].samples:
                    raise UserError(f"tar shard {uri} holds {len(members.offsets)} samples but the index says "
                                    f"{self.index.shards[shard].samples}: rebuild {self.index.prefix}/index.json")
        except BaseException:
            stack.close()
            raise
        with self._lock:
            self._pins[shard] = stack
        return _Local(path, members)

    def _want(self, shard: int) -> None:
        if shard not in self._open:
            self._open[shard] = self._pool.submit(self._fetch, shard)

    def _get(self, shard: int) -> _Local:
        self._want(shard)
        fut = self._open[shard]
        if not fut.done():
            t0 = time.perf_counter()
            fut.result()
            self.fetch_wait_s += time.perf_counter() - t0
        return fut.result()

    def _release(self, shard: int) -> None:
        fut = self._open.pop(shard, None)
        if fut is not None:
            fut.cancel()
            with contextlib.suppress(BaseException):
                fut.result()  # a running fetch: wait so that its pin is dropped below
        with self._lock:
            stack = self._pins.pop(shard, None)
        if stack is not None:
            stack.close()

    def _release_all(self) -> None:
        for shard in list(self._open):
            self._release(shard)

    # -- iteration ------------------------------------------------------------------------------
    def _plan(self) -> tuple[list[np.ndarray], list[np.ndarray], list[list[int]], list[list[int]]]:
        """(sample ids per batch, each sample's shard, the shards to start fetching before each batch,
        the shards whose last batch each batch is)."""
        batches = [self._order[b.lo:b.hi] for b in self._ranges]
        shard_of = [np.searchsorted(self._offsets, ids, side="right") - 1 for ids in batches]
        first: list[int] = []
        last: dict[int, int] = {}
        for k, shards in enumerate(shard_of):
            for s in np.unique(shards):
                s = int(s)
                if s not in last:
                    first.append(s)
                last[s] = k
        releases: list[list[int]] = [[] for _ in batches]
        for s, k in last.items():
            releases[k].append(s)
        return batches, shard_of, fetch_schedule(shard_of, first, self.prefetch_shards), releases

    def _items(self, batches: list[np.ndarray], shard_of: list[np.ndarray],
               fetches: list[list[int]]) -> Iterator[list[tuple]]:
        """The batch sampler: each batch's items, fetching its shards (and the next ones) first."""
        epoch = self.epoch
        for ids, shards, fetch in zip(batches, shard_of, fetches):
            for s in fetch:
                self._want(s)
            items: list[tuple] = []
            for sid, s in zip(ids.tolist(), shards.tolist()):
                local = self._get(s)
                j = sid - int(self._offsets[s])
                if local.members is None:
                    items.append((epoch, sid, local.path, j))
                elif isinstance(local.members, ParquetRows):
                    items.append((epoch, sid, local.path, int(local.members.rows[j]), int(local.members.labels[j])))
                else:
                    m = local.members
                    items.append((epoch, sid, local.path, int(m.offsets[j]), int(m.sizes[j]), int(m.labels[j])))
            yield items

    def _dataloader(self, sampler):
        from torch.utils.data import DataLoader

        if self._num_workers == 0:
            return DataLoader(self._dataset, batch_sampler=sampler, collate_fn=_identity, num_workers=0,
                              pin_memory=self._pin_memory)
        if self._loader is None:
            # fork (Linux's default): the workers inherit the dataset and transform; started once,
            # at the first iteration, and kept for every later epoch (persistent_workers)
            self._sampler = _Sampler()
            self._loader = DataLoader(self._dataset, batch_sampler=self._sampler, collate_fn=_identity,
                                      num_workers=self._num_workers, persistent_workers=True,
                                      prefetch_factor=self._prefetch_factor, pin_memory=self._pin_memory)
        self._sampler.source = sampler
        return self._loader

    def _check_cap(self, fetches: list[list[int]], releases: list[list[int]]) -> None:
        """The cache cannot evict a pinned shard, so a cap below what this epoch pins at once bounds
        nothing: the disk then holds the pinned shards. Say so once, with the figures to fix it."""
        inflight = self._num_workers * self._prefetch_factor
        sizes = [s.bytes or 0 for s in self.index.shards]  # 0: an index without sizes (then no warning)
        self.peak_pinned_bytes, self.peak_pinned_shards = peak_pinned(fetches, releases, inflight, sizes)
        cap = None if getattr(self.cache, "transient", False) else getattr(self.cache, "max_bytes", None)
        if cap and self.peak_pinned_bytes > cap and not self._cap_warned:
            self._cap_warned = True
            log.warning("cache.max_bytes (%.0f MB) is below what this loader pins at once (%.0f MB in %d shards: a "
                        "shuffle window of %d shards, %d batches in flight, %d shards prefetched); pinned shards "
                        "cannot be evicted, so the cache will hold up to %.0f MB plus the shards downloading: raise "
                        "cache.max_bytes, or lower train.loader_workers", cap / 1e6, self.peak_pinned_bytes / 1e6,
                        self.peak_pinned_shards, self.shuffle_window, inflight, self.prefetch_shards,
                        self.peak_pinned_bytes / 1e6)

    def __iter__(self) -> Iterator[dict]:
        batches, shard_of, fetches, releases = self._plan()
        self._check_cap(fetches, releases)
        loader = self._dataloader(_Once(self._items(batches, shard_of, fetches)))
        self._delivered = 0
        try:
            for k, batch in enumerate(iter_forked(loader)):
                for s in releases[k]:  # its last batch is decoded: unpin the shard
                    self._release(s)
                self._delivered = k + 1
                if self._ranges[k].stand_in:
                    batch[STAND_IN] = True
                yield batch
        finally:
            self._release_all()

    def close(self) -> None:
        self._release_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        it = getattr(self._loader, "_iterator", None)
        if it is not None:
            it._shutdown_workers()
        self._loader = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def fetch_schedule(shard_of: list[np.ndarray], first: list[int], prefetch_shards: int) -> list[list[int]]:
    """The shards to start fetching before each batch: those it reads, and `prefetch_shards` more in
    first-use order (`first`), each shard once."""
    rank_of = {s: i for i, s in enumerate(first)}
    out, wanted = [], 0  # first[:wanted] are fetched or fetching (or done with and released)
    for shards in shard_of:
        ahead = min(len(first), max(rank_of[int(s)] for s in shards) + prefetch_shards + 1)
        out.append(first[wanted:ahead])
        wanted = max(wanted, ahead)
    return out


def peak_pinned(fetches: list[list[int]], releases: list[list[int]], inflight: int,
                sizes: list[int]) -> tuple[int, int]:
    """(bytes, shards) pinned at most at once over one epoch, as StreamLoader pins and releases
    shards: when the DataLoader asks for batch j, batches up to j - inflight - 1 are back in the main
    process (their shards released), and batch j's fetches (`fetch_schedule`) are pinned."""
    pinned: set[int] = set()
    held = peak_bytes = peak_shards = 0
    for j, fetch in enumerate(fetches):
        for s in releases[j - inflight - 1] if j - inflight - 1 >= 0 else ():
            pinned.discard(s)
            held -= sizes[s]
        for s in fetch:
            pinned.add(s)
            held += sizes[s]
        peak_bytes, peak_shards = max(peak_bytes, held), max(peak_shards, len(pinned))
    return peak_bytes, peak_shards


class _Once:
    """An iterable over one plan's batches (a DataLoader batch_sampler)."""

    def __init__(self, items: Iterator[list[tuple]]):
        self.items = items

    def __iter__(self):
        return self.items


class _Sampler:
    """The persistent DataLoader's batch_sampler: iterates whichever plan is current."""

    source: Any = None

    def __iter__(self):
        return iter(self.source)

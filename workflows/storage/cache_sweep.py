"""Eviction and cleanup of a shard cache's directory (workflows.storage.cache): older versions of a
URI, least-recently-used entries over `max_bytes`, and the debris of killed downloads. Entries whose
lock anyone holds (pinned by a reader, or being downloaded) are skipped, never waited for.

`max_bytes` bounds the directory (plus downloads in flight): an entry counts as its data in whole
blocks plus a block each for its sidecar and pointer. With `counted`, the node's model cache
(storage.model_cache), the bytes it holds count against `max_bytes` too: shards are evicted to
make room for them (it is listed at each download's sweep: a few directories).

# why: listing the directory costs 10-20 ms at thousands of entries, far too much per miss of a
# loader fetching small shards. So a miss lists nothing in the common case: older versions are
# found through the URI's pointer file, the bytes on disk are a running total shared by all
# processes (`usage`, exact after every full listing, raised by each download), and the full
# listing runs only when that total may exceed max_bytes, plus a debris sweep at most every
# DEBRIS_EVERY_S seconds per process.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

from workflows.storage import model_cache
from workflows.storage.cache_dir import POINTER, CacheDir, size_of
from workflows.storage.transfer import Source

DEBRIS_EVERY_S = 60.0  # a process looks for debris of killed downloads at most this often
USAGE_FILE = "usage"  # the running total of the entries' disk footprint


class Sweeper:
    """The sweeps of one process over `files`."""

    def __init__(self, files: CacheDir, max_bytes: int | None, counted: Path | None):
        self.files, self.max_bytes, self.counted = files, max_bytes, counted
        self._debris_swept_at = -math.inf  # the first miss of a process sweeps debris

    def after_download(self, src: Source, keep: str) -> int:
        """After `keep` (the entry of `src`) was downloaded and pinned: clean debris if due, drop the
        URI's older version, then LRU entries until under max_bytes. Returns the entries evicted."""
        evicted = 0
        with self.files.global_lock():
            if self._debris_due():
                self._sweep_debris()
            freed = self._drop_old_version(src, keep)
            if self.max_bytes is not None:
                budget = self.max_bytes - (model_cache.disk_usage(self.counted) if self.counted else 0)
                usage = self._read_usage()
                if usage is not None:
                    usage = max(0, usage + self.files.footprint(src.size) - freed)
                if usage is None or usage > budget:
                    usage, evicted = self._evict(keep, budget)
                self._write_usage(usage)
        return evicted

    def debris_if_due(self) -> None:
        """A hit sweeps debris too (at most every DEBRIS_EVERY_S): a process killed after its data and
        sidecar were in place, while writing the URI's pointer, left a temp file."""
        if self._debris_due():
            with self.files.global_lock():
                self._sweep_debris()

    def _debris_due(self) -> bool:
        return time.monotonic() - self._debris_swept_at >= DEBRIS_EVERY_S

    def _sweep_debris(self) -> None:
        """Temp files and sidecar-less data of killed processes (the caller holds the global lock)."""
        self._debris_swept_at = time.monotonic()
        files = self.files
        debris = {p.name.split(".", 1)[0] for p in files.path.glob("*.tmp-*")}
        debris |= {n for n in files.names("*.data") if not files.meta_path(n).exists()}
        for name in debris:
            files.if_unlocked(name, self._clean)
        for pointer in files.path.glob(f"*-{POINTER}"):  # left by entries removed before pointers went with them
            with contextlib.suppress(OSError):
                files.drop_pointer(pointer.read_text().strip(), only_if_gone=True)

    def _clean(self, name: str) -> None:
        """Debris of a killed process: temp files, and a data file whose sidecar never came."""
        if self.files.read_meta(name) is None:
            self.files.remove(name)
        else:
            for tmp in self.files.path.glob(f"{name}.*.tmp-*"):
                tmp.unlink(missing_ok=True)

    def _drop_old_version(self, src: Source, keep: str) -> int:
        """Remove the entry the URI's pointer names if it is not `keep`; point it at `keep`.
        Returns the bytes freed."""
        pointer = self.files.pointer_path(src.uri)
        try:
            old = pointer.read_text().strip()
        except FileNotFoundError:
            old = ""
        freed = 0
        if old and old != keep:
            size = self.files.footprint(size_of(self.files.data_path(old)))
            if self.files.if_unlocked(old, self.files.remove):
                freed = size
        if old != keep:
            self.files.atomic_write(pointer, keep.encode())
        return freed

    def _read_usage(self) -> int | None:
        try:
            return int((self.files.path / USAGE_FILE).read_text())
        except (FileNotFoundError, ValueError):  # first sweep, or a torn write: list once
            return None

    def _write_usage(self, usage: int) -> None:
        self.files.atomic_write(self.files.path / USAGE_FILE, str(usage).encode())

    def _evict(self, keep: str, budget: int) -> tuple[int, int]:
        """Remove LRU entries until under `budget`: (the footprint left, a full listing; entries removed)."""
        files = self.files
        sizes = {n: files.footprint(size_of(files.data_path(n))) for n in files.names("*.data")}
        total, evicted = sum(sizes.values()), 0
        for name in sorted(sizes, key=files.last_access):  # least recently used first
            if total <= budget:
                break
            if name != keep and files.if_unlocked(name, files.remove):
                files.drop_pointer(name)
                total -= sizes[name]
                evicted += 1
        return total, evicted

"""A per-node shard cache: objects behind any fsspec URI, copied once to a local directory.

# why: fsspec's own filecache/simplecache is not safe across processes (fsspec issue #1126):
# concurrent readers of one node race on its JSON index and on half-written files, and a killed
# download can leave a partial file that is later served as good. Ray workers on one node are
# separate processes, so this cache is written by hand: fsspec does the transfer only, and the
# bookkeeping is plain files, renames and flocks.

Layout of `directory` (one entry per (URI, object version)):
    <name>.data   the object's bytes, renamed into place only when complete
    <name>.json   sidecar {uri, version, size, sha256, fetched_at}; written after the data, so an
                  entry counts as present only when both exist and their sizes agree. Its mtime is
                  the entry's last access (LRU).
    <name>.lock   flock: LOCK_EX while downloading or evicting, LOCK_SH while a reader holds the
                  entry (a pin). flocks die with their process, so a killed process blocks no one.
    <name>.*.tmp-*  temp files of a download in progress; stale ones are swept.
where <name> = sha256(uri)[:16] + "-" + sha256(uri, version)[:16]: new and old versions never
collide, and all versions of one URI share a prefix.

`max_bytes` bounds the directory (plus downloads in flight): an entry counts as its data in whole
blocks plus a block each for its sidecar and pointer. With `counted`, the node's model cache
(storage.model_cache), the bytes it holds count against `max_bytes` too: shards are evicted to
make room for them (it is listed at each download's sweep: a few directories).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from workflows.errors import UserError
from workflows.storage import flock, model_cache
from workflows.storage.atomic import atomic_write
from workflows.storage.transfer import (  # object_version is also imported from here
    CHUNK,
    ObjectChanged,
    Source,
    object_version,
    s3_download_to_file,
    sha256_file,
    stream_to_file,
)
from workflows.storage.uri import StorageContext, filesystem, reaching

log = logging.getLogger(__name__)

DEBRIS_EVERY_S = 60.0  # a process looks for debris of killed downloads at most this often
USAGE_FILE = "usage"  # the running total of the entries' disk footprint (see _sweep)
POINTER = "current"  # <sha256(uri)[:16]>-current: the URI's current entry, removed with it


@dataclass
class CacheStats:
    """Counters of this process (each process keeps its own)."""

    hits: int = 0
    misses: int = 0
    bytes_from_store: int = 0
    bytes_from_cache: int = 0
    evictions: int = 0


class ShardCache:
    transient = False  # a TransientCache (storage/transient.py): cache.enabled=false

    def __init__(self, directory: str, ctx: StorageContext, max_bytes: int | None = None,
                 verify_checksums: bool = False, chunk_size: int = CHUNK, counted: str | None = None):
        self.dir = Path(directory).expanduser().resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ctx = ctx
        self.max_bytes = max_bytes
        self.counted = Path(counted) if counted is not None else None  # a model cache sharing max_bytes
        self.verify_checksums = verify_checksums
        self.chunk_size = chunk_size
        self._stats = CacheStats()
        self._stats_lock = threading.Lock()
        self._s3_clients: dict = {}  # per StorageContext: the embedded store's buckets, an outside one's
        self._debris_swept_at = -math.inf  # the first miss of a process sweeps debris
        self._block = os.statvfs(self.dir).f_bsize or 4096  # the unit of an entry's footprint

    # -- public API ------------------------------------------------------------------------
    def fetch(self, uri: str, version: str | None = None, size: int | None = None) -> str:
        """A local path holding the whole current object behind `uri`.

        The entry is not pinned once this returns: a later eviction may remove it. Use
        `open_local` to read it safely while other processes fill the cache.
        """
        with self.open_local(uri, version, size) as path:
            return path

    @contextlib.contextmanager
    def open_local(self, uri: str, version: str | None = None, size: int | None = None) -> Iterator[str]:
        """Yield a local path to `uri`'s bytes, pinned (never evicted) until the `with` ends.

        `version` and `size`, when the caller has them from a listing (`object_version`), spare
        the request that would stat the object: a warm read then asks the store for nothing.
        """
        fd, path = self._pin(uri, version, size)
        try:
            yield path
        finally:
            os.close(fd)  # drops the shared flock: the pin

    def current_version(self, uri: str) -> tuple[str, int]:
        """(version, size) of the object behind `uri` now: one request to the store (a HEAD on s3),
        for a caller without them from a listing or an index to hand to `open_local` later."""
        src = self._stat(uri)
        return src.version, src.size

    def verify(self, uri: str) -> bool:
        """Re-hash the cached copy of `uri`'s current version against its sidecar.

        True if it is cached and intact. A corrupt copy is dropped (so the next fetch downloads
        it again) and False returned; False too if it is not cached.
        """
        src = self._stat(uri)
        name = self._name(src)
        fd = self._lock(name, fcntl.LOCK_EX)
        try:
            meta = self._read_meta(name)
            if meta is None:
                return False
            if self._present(name, src, check_hash=True):
                return True
            log.warning("cached copy of %s is corrupt; dropping it", src.uri)
            self._remove(name)
            return False
        finally:
            os.close(fd)

    def stats(self) -> CacheStats:
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    def cached_bytes(self) -> int:
        """Bytes of complete entries on disk now (all processes)."""
        return sum(_size(p) for p in self._entries())

    # -- fetch -----------------------------------------------------------------------------
    def _pin(self, uri: str, version: str | None = None, size: int | None = None) -> tuple[int, str]:
        """Return (fd holding LOCK_SH on the entry, data path), downloading it first if needed."""
        if version is not None and size is not None:
            fs, path = filesystem(uri, self.ctx)
            src = Source(fs.unstrip_protocol(path), fs, path, int(size), str(version))
        else:
            src = self._stat(uri)
        name = self._name(src)
        downloaded = 0
        for _attempt in range(5):
            # Fast path: a shared lock waits for any download in progress, then reads.
            fd = self._lock(name, fcntl.LOCK_SH)
            # just downloaded and hashed while streaming: no need to re-hash
            if self._present(name, src, check_hash=self.verify_checksums and not downloaded):
                os.utime(self._meta_path(name), ns=(time.time_ns(),) * 2)  # LRU: last access
                self._count(downloaded, src.size)
                if downloaded:
                    self._sweep(src, keep=name)  # after pinning, so our own entry is safe
                elif self._debris_due():
                    # a hit sweeps debris too (at most as often): a process killed after its data
                    # and sidecar were in place, while writing the URI's pointer, left a temp file
                    with self._global_lock():
                        self._sweep_debris()
                return fd, str(self._data_path(name))
            os.close(fd)
            # Slow path: one process downloads under LOCK_EX; the others block above, then hit.
            fd = self._lock(name, fcntl.LOCK_EX)
            try:
                if not self._present(name, src, check_hash=self.verify_checksums):
                    self._download(src, name)
                    downloaded += 1
            except ObjectChanged:
                src = self._stat(uri)
                name = self._name(src)
            finally:
                os.close(fd)
            # Loop: downgrade to LOCK_SH by re-locking (an eviction in between is simply retried).
        raise UserError(f"could not cache {uri}: it kept changing or being evicted while fetching")

    def _stat(self, uri: str) -> Source:
        fs, path = filesystem(uri, self.ctx)
        try:
            with reaching(uri, self.ctx):
                info = fs.info(path)
        except FileNotFoundError:
            raise UserError(f"object not found: {uri}") from None
        if info.get("type") != "file":
            raise UserError(f"{uri} is a {info.get('type', 'directory')}, not a file or object")
        return Source(fs.unstrip_protocol(path), fs, path, int(info["size"]), object_version(info))

    def _download(self, src: Source, name: str) -> None:
        """Stream to a temp file, fsync, rename into place; then write the sidecar the same way."""
        self._remove(name, keep_lock=True)  # a bad copy, or debris of a killed download
        tmp = self._tmp_path(name, "data")
        with reaching(src.uri, self.ctx):
            digest, n = self._download_to(src, name, tmp)
        meta = {"uri": src.uri, "version": src.version, "size": n, "sha256": digest.hexdigest(),
                "fetched_at": time.time()}
        self._atomic_write(self._meta_path(name), json.dumps(meta).encode())

    def _download_to(self, src: Source, name: str, tmp: Path):
        """The data file itself; no temp file is left behind whatever is raised."""
        try:
            if src.uri.startswith(("s3://", "s3a://")):
                digest, n = self._download_s3(src, tmp)
            else:
                digest, n = self._download_stream(src, tmp)
            if n != src.size:
                raise ObjectChanged  # truncated read or a rewrite in between: the size check fails
            os.rename(tmp, self._data_path(name))
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if type(e).__name__ == "FileExpired":  # s3fs: the ETag changed mid-read
                raise ObjectChanged from None
            if isinstance(e, FileNotFoundError):
                raise UserError(f"object not found: {src.uri}") from None
            raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return digest, n

    def _download_stream(self, src: Source, tmp: Path):
        return stream_to_file(src, tmp, self.chunk_size)

    def _download_s3(self, src: Source, tmp: Path):
        ctx = self.ctx.for_uri(src.uri)
        with self._stats_lock:  # creating a boto3 client is not thread-safe; using one is
            if ctx not in self._s3_clients:
                self._s3_clients[ctx] = ctx.boto3_client()
        return s3_download_to_file(self._s3_clients[ctx], src, tmp, self.chunk_size)

    def _present(self, name: str, src: Source, check_hash: bool) -> bool:
        """Both files exist, the sizes agree with the store (cheap), and optionally the hash."""
        meta = self._read_meta(name)
        if meta is None or (meta.get("uri"), meta.get("version"), meta.get("size")) != (src.uri, src.version, src.size):
            return False
        try:
            if os.stat(self._data_path(name)).st_size != src.size:
                return False
        except FileNotFoundError:
            return False
        return not check_hash or sha256_file(self._data_path(name), self.chunk_size) == meta.get("sha256")

    def _count(self, downloaded: int, size: int) -> None:
        with self._stats_lock:
            s = self._stats
            if downloaded:
                s.misses += 1
                s.bytes_from_store += size * downloaded
            else:
                s.hits += 1
                s.bytes_from_cache += size

    # -- eviction and cleanup --------------------------------------------------------------
    def _sweep(self, src: Source, keep: str) -> None:
        """After a download: clean debris of killed downloads, drop older versions of the same
        URI, then least-recently-used entries until under max_bytes. Entries whose lock anyone
        holds (pinned by a reader, or being downloaded) are skipped, never waited for.

        # why: listing the directory costs 10-20 ms at thousands of entries, far too much per miss
        # of a loader fetching small shards. So a miss lists nothing in the common case: older
        # versions are found through the URI's pointer file, the bytes on disk are a running total
        # shared by all processes (`usage`, exact after every full listing, raised by each
        # download), and the full listing runs only when that total may exceed max_bytes, plus a
        # debris sweep at most every DEBRIS_EVERY_S seconds per process."""
        with self._global_lock():
            if self._debris_due():
                self._sweep_debris()
            freed = self._drop_old_version(src, keep)
            if self.max_bytes is not None:
                budget = self.max_bytes - (model_cache.disk_usage(self.counted) if self.counted else 0)
                usage = self._read_usage()
                if usage is not None:
                    usage = max(0, usage + self._footprint(src.size) - freed)
                if usage is None or usage > budget:
                    usage = self._evict(keep, budget)
                self._write_usage(usage)

    def _debris_due(self) -> bool:
        return time.monotonic() - self._debris_swept_at >= DEBRIS_EVERY_S

    def _sweep_debris(self) -> None:
        """Temp files and sidecar-less data of killed processes (the caller holds the global lock)."""
        self._debris_swept_at = time.monotonic()
        debris = {p.name.split(".", 1)[0] for p in self.dir.glob("*.tmp-*")}
        debris |= {n for n in self._names("*.data") if not self._meta_path(n).exists()}
        for name in debris:
            self._if_unlocked(name, self._clean)
        for pointer in self.dir.glob(f"*-{POINTER}"):  # left by entries removed before pointers went with them
            with contextlib.suppress(OSError):
                self._drop_pointer(pointer.read_text().strip(), only_if_gone=True)

    def _drop_old_version(self, src: Source, keep: str) -> int:
        """Remove the entry the URI's pointer names if it is not `keep`; point it at `keep`.
        Returns the bytes freed."""
        pointer = self.dir / f"{_uri_prefix(src.uri)}{POINTER}"
        try:
            old = pointer.read_text().strip()
        except FileNotFoundError:
            old = ""
        freed = 0
        if old and old != keep:
            size = self._footprint(_size(self._data_path(old)))
            if self._if_unlocked(old, self._remove):
                freed = size
        if old != keep:
            self._atomic_write(pointer, keep.encode())
        return freed

    def _read_usage(self) -> int | None:
        try:
            return int((self.dir / USAGE_FILE).read_text())
        except (FileNotFoundError, ValueError):  # first sweep, or a torn write: list once
            return None

    def _write_usage(self, usage: int) -> None:
        self._atomic_write(self.dir / USAGE_FILE, str(usage).encode())

    def _evict(self, keep: str, budget: int) -> int:
        """Remove LRU entries until under `budget`; returns the footprint left (a full listing)."""
        sizes = {n: self._footprint(_size(self._data_path(n))) for n in self._names("*.data")}
        total = sum(sizes.values())
        for name in sorted(sizes, key=self._last_access):  # least recently used first
            if total <= budget:
                break
            if name != keep and self._if_unlocked(name, self._remove):
                self._drop_pointer(name)
                total -= sizes[name]
                with self._stats_lock:
                    self._stats.evictions += 1
        return total

    def _if_unlocked(self, name: str, action) -> bool:
        """Run action(name) under the entry's LOCK_EX if no one holds its lock; else skip it."""
        try:
            fd = self._lock(name, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            action(name)
            return True
        finally:
            os.close(fd)

    def _clean(self, name: str) -> None:
        """Debris of a killed process: temp files, and a data file whose sidecar never came."""
        if self._read_meta(name) is None:
            self._remove(name)
        else:
            for tmp in self.dir.glob(f"{name}.*.tmp-*"):
                tmp.unlink(missing_ok=True)

    def _remove(self, name: str, keep_lock: bool = False) -> None:
        """Remove an entry; the caller holds its LOCK_EX. The sidecar goes first: absent at once."""
        self._meta_path(name).unlink(missing_ok=True)
        self._data_path(name).unlink(missing_ok=True)
        for tmp in self.dir.glob(f"{name}.*.tmp-*"):
            tmp.unlink(missing_ok=True)
        if not keep_lock:
            (self.dir / f"{name}.lock").unlink(missing_ok=True)  # lockers re-check the inode

    def _drop_pointer(self, name: str, only_if_gone: bool = False) -> None:
        """Remove the URI's pointer if it names the removed entry `name` (under the global lock)."""
        pointer = self.dir / f"{name.split('-', 1)[0]}-{POINTER}"
        with contextlib.suppress(OSError):
            if pointer.read_text().strip() == name and not (only_if_gone and self._data_path(name).exists()):
                pointer.unlink()

    def _footprint(self, size: int) -> int:  # an entry's disk: data in whole blocks, sidecar, pointer
        return -(-size // self._block) * self._block + 2 * self._block

    def _last_access(self, name: str) -> int:
        try:
            return self._meta_path(name).stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    def _entries(self) -> list[Path]:
        return [self._data_path(n) for n in self._names("*.data") if self._meta_path(n).exists()]

    def _names(self, pattern: str) -> list[str]:
        return [p.name.split(".", 1)[0] for p in self.dir.glob(pattern)]

    # -- files and locks -------------------------------------------------------------------
    def _name(self, src: Source) -> str:
        return _uri_prefix(src.uri) + hashlib.sha256(f"{src.uri}\0{src.version}".encode()).hexdigest()[:16]

    def _data_path(self, name: str) -> Path:
        return self.dir / f"{name}.data"

    def _meta_path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def _tmp_path(self, name: str, kind: str) -> Path:
        return self.dir / f"{name}.{kind}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def _read_meta(self, name: str) -> dict | None:
        try:
            return json.loads(self._meta_path(name).read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    def _atomic_write(self, path: Path, data: bytes) -> None:
        atomic_write(path, data, tmp=self._tmp_path(path.stem, "meta"), fsync=True)

    def _lock(self, name: str, op: int) -> int:
        """An fd holding flock `op` on the entry's lock file (evictions unlink it: flock.lock retries)."""
        return flock.lock(self.dir / f"{name}.lock", op)

    def _global_lock(self):
        """Serialises sweeps so that two processes do not both evict for the same overflow."""
        return flock.exclusive(self.dir / "sweep.lock")


def _uri_prefix(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()[:16] + "-"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # removed meanwhile by a process re-fetching a bad copy
        return 0

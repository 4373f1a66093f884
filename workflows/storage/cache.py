"""A per-node shard cache: objects behind any fsspec URI, copied once to a local directory.

# why: fsspec's own filecache/simplecache is not safe across processes (fsspec issue #1126):
# concurrent readers of one node race on its JSON index and on half-written files, and a killed
# download can leave a partial file that is later served as good. Ray workers on one node are
# separate processes, so this cache is written by hand: fsspec does the transfer only, and the
# bookkeeping is plain files, renames and flocks.

The entries on disk and their locks are workflows.storage.cache_dir's; eviction within `max_bytes`
and the cleanup of killed downloads, workflows.storage.cache_sweep's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from workflows.errors import UserError
from workflows.storage.cache_dir import CacheDir, size_of
from workflows.storage.cache_sweep import Sweeper
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
        self.files = CacheDir(self.dir)
        self._sweeper = Sweeper(self.files, max_bytes, self.counted)

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
        name = self.files.name(src)
        fd = self.files.lock(name, fcntl.LOCK_EX)
        try:
            meta = self.files.read_meta(name)
            if meta is None:
                return False
            if self._present(name, src, check_hash=True):
                return True
            log.warning("cached copy of %s is corrupt; dropping it", src.uri)
            self.files.remove(name)
            return False
        finally:
            os.close(fd)

    def stats(self) -> CacheStats:
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    def cached_bytes(self) -> int:
        """Bytes of complete entries on disk now (all processes)."""
        return sum(size_of(p) for p in self.files.entries())

    # -- fetch -----------------------------------------------------------------------------
    def _pin(self, uri: str, version: str | None = None, size: int | None = None) -> tuple[int, str]:
        """Return (fd holding LOCK_SH on the entry, data path), downloading it first if needed."""
        if version is not None and size is not None:
            fs, path = filesystem(uri, self.ctx)
            src = Source(fs.unstrip_protocol(path), fs, path, int(size), str(version))
        else:
            src = self._stat(uri)
        name = self.files.name(src)
        downloaded = 0
        for _attempt in range(5):
            # Fast path: a shared lock waits for any download in progress, then reads.
            fd = self.files.lock(name, fcntl.LOCK_SH)
            # just downloaded and hashed while streaming: no need to re-hash
            if self._present(name, src, check_hash=self.verify_checksums and not downloaded):
                os.utime(self.files.meta_path(name), ns=(time.time_ns(),) * 2)  # LRU: last access
                self._count(downloaded, src.size)
                if downloaded:
                    evicted = self._sweeper.after_download(src, keep=name)  # after pinning: our entry is safe
                    with self._stats_lock:
                        self._stats.evictions += evicted
                else:
                    self._sweeper.debris_if_due()
                return fd, str(self.files.data_path(name))
            os.close(fd)
            # Slow path: one process downloads under LOCK_EX; the others block above, then hit.
            fd = self.files.lock(name, fcntl.LOCK_EX)
            try:
                if not self._present(name, src, check_hash=self.verify_checksums):
                    self._download(src, name)
                    downloaded += 1
            except ObjectChanged:
                src = self._stat(uri)
                name = self.files.name(src)
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
        self.files.remove(name, keep_lock=True)  # a bad copy, or debris of a killed download
        tmp = self.files.tmp_path(name, "data")
        with reaching(src.uri, self.ctx):
            digest, n = self._download_to(src, name, tmp)
        meta = {"uri": src.uri, "version": src.version, "size": n, "sha256": digest.hexdigest(),
                "fetched_at": time.time()}
        self.files.atomic_write(self.files.meta_path(name), json.dumps(meta).encode())

    def _download_to(self, src: Source, name: str, tmp: Path):
        """The data file itself; no temp file is left behind whatever is raised."""
        try:
            if src.uri.startswith(("s3://", "s3a://")):
                digest, n = self._download_s3(src, tmp)
            else:
                digest, n = self._download_stream(src, tmp)
            if n != src.size:
                raise ObjectChanged  # truncated read or a rewrite in between: the size check fails
            os.rename(tmp, self.files.data_path(name))
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
        meta = self.files.read_meta(name)
        if meta is None or (meta.get("uri"), meta.get("version"), meta.get("size")) != (src.uri, src.version, src.size):
            return False
        try:
            if os.stat(self.files.data_path(name)).st_size != src.size:
                return False
        except FileNotFoundError:
            return False
        return not check_hash or sha256_file(self.files.data_path(name), self.chunk_size) == meta.get("sha256")

    def _count(self, downloaded: int, size: int) -> None:
        with self._stats_lock:
            s = self._stats
            if downloaded:
                s.misses += 1
                s.bytes_from_store += size * downloaded
            else:
                s.hits += 1
                s.bytes_from_cache += size

"""The files of a shard cache's directory (workflows.storage.cache): what each entry is on disk,
and the flocks that keep the processes of one node apart.

Layout (one entry per (URI, object version)):
    <name>.data   the object's bytes, renamed into place only when complete
    <name>.json   sidecar {uri, version, size, sha256, fetched_at}; written after the data, so an
                  entry counts as present only when both exist and their sizes agree. Its mtime is
                  the entry's last access (LRU).
    <name>.lock   flock: LOCK_EX while downloading or evicting, LOCK_SH while a reader holds the
                  entry (a pin). flocks die with their process, so a killed process blocks no one.
    <name>.*.tmp-*  temp files of a download in progress; stale ones are swept.
    <uri prefix>current  the URI's current entry (its pointer), removed with it
where <name> = sha256(uri)[:16] + "-" + sha256(uri, version)[:16]: new and old versions never
collide, and all versions of one URI share a prefix.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from workflows.storage import flock
from workflows.storage.atomic import atomic_write
from workflows.storage.transfer import Source

POINTER = "current"  # <sha256(uri)[:16]>-current: the URI's current entry, removed with it


def uri_prefix(uri: str) -> str:
    """What every entry (and the pointer) of `uri` is named with first."""
    return hashlib.sha256(uri.encode()).hexdigest()[:16] + "-"


def size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # removed meanwhile by a process re-fetching a bad copy
        return 0


class CacheDir:
    """The entries of one cache directory, by name: their files, locks and disk footprint."""

    def __init__(self, directory: Path):
        self.path = directory
        self.block = os.statvfs(directory).f_bsize or 4096  # the unit of an entry's footprint

    def name(self, src: Source) -> str:
        return uri_prefix(src.uri) + hashlib.sha256(f"{src.uri}\0{src.version}".encode()).hexdigest()[:16]

    def data_path(self, name: str) -> Path:
        return self.path / f"{name}.data"

    def meta_path(self, name: str) -> Path:
        return self.path / f"{name}.json"

    def tmp_path(self, name: str, kind: str) -> Path:
        return self.path / f"{name}.{kind}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def pointer_path(self, uri: str) -> Path:
        return self.path / f"{uri_prefix(uri)}{POINTER}"

    def read_meta(self, name: str) -> dict | None:
        try:
            return json.loads(self.meta_path(name).read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    def atomic_write(self, path: Path, data: bytes) -> None:
        atomic_write(path, data, tmp=self.tmp_path(path.stem, "meta"), fsync=True)

    def lock(self, name: str, op: int) -> int:
        """An fd holding flock `op` on the entry's lock file (evictions unlink it: flock.lock retries)."""
        return flock.lock(self.path / f"{name}.lock", op)

    def global_lock(self):
        """Serialises sweeps so that two processes do not both evict for the same overflow."""
        return flock.exclusive(self.path / "sweep.lock")

    def if_unlocked(self, name: str, action: Callable[[str], object]) -> bool:
        """Run action(name) under the entry's LOCK_EX if no one holds its lock; else skip it."""
        try:
            fd = self.lock(name, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            action(name)
            return True
        finally:
            os.close(fd)

    def remove(self, name: str, keep_lock: bool = False) -> None:
        """Remove an entry; the caller holds its LOCK_EX. The sidecar goes first: absent at once."""
        self.meta_path(name).unlink(missing_ok=True)
        self.data_path(name).unlink(missing_ok=True)
        for tmp in self.path.glob(f"{name}.*.tmp-*"):
            tmp.unlink(missing_ok=True)
        if not keep_lock:
            (self.path / f"{name}.lock").unlink(missing_ok=True)  # lockers re-check the inode

    def drop_pointer(self, name: str, only_if_gone: bool = False) -> None:
        """Remove the URI's pointer if it names the removed entry `name` (under the global lock)."""
        pointer = self.path / f"{name.split('-', 1)[0]}-{POINTER}"
        with contextlib.suppress(OSError):
            if pointer.read_text().strip() == name and not (only_if_gone and self.data_path(name).exists()):
                pointer.unlink()

    def footprint(self, size: int) -> int:  # an entry's disk: data in whole blocks, sidecar, pointer
        return -(-size // self.block) * self.block + 2 * self.block

    def last_access(self, name: str) -> int:
        try:
            return self.meta_path(name).stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    def entries(self) -> list[Path]:
        """The data files of complete entries."""
        return [self.data_path(n) for n in self.names("*.data") if self.meta_path(n).exists()]

    def names(self, pattern: str) -> list[str]:
        return [p.name.split(".", 1)[0] for p in self.path.glob(pattern)]

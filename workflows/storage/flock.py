"""File locks (flock) shared by the node's caches: they die with their process, so a killed process
blocks no one."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def lock(path: Path, op: int) -> int:
    """An fd holding flock `op` on the lock file `path`.

    A lock file may be unlinked (an evicted entry's), so after locking check that the path still
    names the inode locked; if not, that was a dead file: try again on the new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, op)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """LOCK_EX on the lock file `path` (never unlinked) for the `with` block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

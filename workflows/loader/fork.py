"""Starting the DataLoader's decode processes (fork, Linux's default) without handing them the
parent's garbage."""

from __future__ import annotations

import gc
from collections.abc import Iterator


def iter_forked(loader) -> Iterator:
    """iter(loader), with the garbage collector's objects frozen while it forks its worker processes.

    # why: a forked process inherits the parent's unreachable reference cycles, and its first full
    # collection runs their finalizers there. s3fs's (S3FileSystem.close_session) then waits on the
    # parent's event loop, a thread the child does not have, 0.1 s per filesystem: every new decode
    # process stalled about 1.2 s before its first sample (#37), with the CPU idle. Frozen objects are
    # never collected by the child (gc.freeze is Python's advice before a fork without exec; it also
    # spares their pages copy-on-write); the parent unfreezes them at once and collects them as
    # before, where their finalizers work. A process that froze objects itself keeps them frozen.
    """
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        return iter(loader)
    finally:
        if not frozen_before:
            gc.unfreeze()

"""cache.enabled=false for readers that need local copies (the stream loader, an index build)."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

from workflows.storage.cache import ShardCache
from workflows.storage.uri import StorageContext


class TransientCache(ShardCache):
    """A shard cache in a new temp directory that keeps no shard once unpinned (max_bytes 1) and is
    removed with this object: nothing outlives the reader, and nothing is written to cache.dir."""

    transient = True

    def __init__(self, ctx: StorageContext):
        directory = tempfile.mkdtemp(prefix="workflows-uncached-")
        super().__init__(directory, ctx, max_bytes=1)
        weakref.finalize(self, _remove_dir, directory, os.getpid())


def _remove_dir(directory: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that inherited the object
        shutil.rmtree(directory, ignore_errors=True)

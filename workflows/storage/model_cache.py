"""The node's model cache, `<cache.dir>/models`: whole model directories (registered versions, initial
weights) downloaded once per node and key.

A directory is filled under a temp name and renamed into place whole, so one that exists is
complete; a failed download removes its temp directory. `cache.max_bytes` bounds this directory
and the shard cache (`<cache.dir>/shards`) together: the shard cache counts the bytes here
(`disk_usage`) and evicts shards to make room. Model directories themselves are not evicted (a
process may be loading one).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from workflows.errors import UserError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def cached_dir(root: str | Path, name: str, fill: Callable[[str], None]) -> str:
    """`root/name`, filled once on this node by `fill(directory)`. `name` may come from the store (a
    card's artifact id): a plain name only, never a path."""
    if not _NAME.fullmatch(name):
        raise UserError(f"{name!r} cannot name a cache directory (letters, digits, '_', '-', '.')")
    root = Path(root)
    dest = root / name
    if dest.is_dir():
        return str(dest)
    root.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=root)
    try:
        fill(tmp)
        try:
            os.rename(tmp, dest)  # whole or not at all
        except OSError:  # another process on this node finished first; theirs is the same
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(dest)


def disk_usage(root: Path) -> int:
    """Bytes on disk (whole blocks) of everything under `root`, downloads in progress included."""
    total = 0
    for folder, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(folder, f)).st_blocks * 512
            except FileNotFoundError:  # renamed or removed meanwhile
                pass
    return total

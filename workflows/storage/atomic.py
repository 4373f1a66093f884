"""Local-file writes that a reader (or a crash) never sees half done: write a temp file beside the
target, then rename it over the target (a rename within one directory is atomic on POSIX)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def atomic_write(
    path: str | os.PathLike,
    data: str | bytes | Callable[[Path], object],
    *,
    tmp: str | os.PathLike | None = None,
    fsync: bool = False,
) -> Path:
    """Write `data` to `tmp` (default `<path>.tmp`), then rename it onto `path`; returns `path`.

    `data` is text (the platform's default encoding, as `Path.write_text`), bytes, or a writer called
    with the temp path (a figure's savefig, a download). `fsync` flushes the temp file to disk before
    the rename, so that after a power loss the target holds the old or the new bytes, not a hole.
    Callers that can race on one target pass a unique `tmp`; the parent directory must exist.
    """
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(path.name + ".tmp")
    if callable(data):
        data(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
    else:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    os.replace(tmp, path)
    return path

"""A pretrained model in from_pretrained layout, as a directory on this node: a local path as it is,
an object-store URI downloaded once into the node's model cache (`<cache.dir>/models/init-<key>`,
keyed by the URI and its config.json's ETag or size), written to a temp name and renamed into place."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from workflows.errors import UserError


def fetch_model_dir(name_or_path: str, cfg, what: str = "model.name_or_path") -> str:
    """The directory of `name_or_path` (a local directory or an object-store URI) on this node."""
    from workflows.storage.uri import StorageContext, download_dir, filesystem, protocol_of

    if protocol_of(name_or_path) in ("", "file"):
        path = os.path.expanduser(name_or_path.removeprefix("file://"))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"{what} {name_or_path!r}: not a model directory (no config.json)")
        return path
    ctx = StorageContext.from_config(cfg.storage)
    fs, path = filesystem(name_or_path, ctx)
    try:
        info = fs.info(f"{path.rstrip('/')}/config.json")
    except FileNotFoundError:
        raise UserError(f"{what} {name_or_path!r}: no config.json there") from None
    key = hashlib.sha256(f"{name_or_path}|{info.get('ETag') or info.get('size')}".encode()).hexdigest()[:16]
    dest = os.path.join(cfg.cache.resolved_dir(), "models", f"init-{key}")
    if not os.path.isfile(os.path.join(dest, "config.json")):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".init-{key}-", dir=os.path.dirname(dest))
        try:
            download_dir(name_or_path, ctx, tmp)
            try:
                os.rename(tmp, dest)  # whole or not at all: a crash leaves a temp name, never a half model
            except OSError:  # another process on this node finished first
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest

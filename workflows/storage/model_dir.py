"""A pretrained model in from_pretrained layout, as a directory on this node: a local path as it is,
an object-store URI downloaded once into the node's model cache (`<cache.dir>/models/init-<key>`,
workflows.storage.model_cache), keyed by the URI and every file's name, version and size (one
listing): replaced weights beside an unchanged config.json are a new entry."""

from __future__ import annotations

import hashlib
import os

from workflows.errors import UserError
from workflows.storage.model_cache import cached_dir
from workflows.storage.transfer import object_version


def fetch_model_dir(name_or_path: str, cfg, what: str = "model.name_or_path") -> str:
    """The directory of `name_or_path` (a local directory or an object-store URI) on this node."""
    from workflows.storage.uri import StorageContext, download_dir, filesystem, protocol_of, reaching

    if protocol_of(name_or_path) in ("", "file"):
        path = os.path.expanduser(name_or_path.removeprefix("file://"))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"{what} {name_or_path!r}: not a model directory (no config.json)")
        return path
    ctx = StorageContext.from_config(cfg.storage)
    fs, path = filesystem(name_or_path, ctx)
    with reaching(name_or_path, ctx):
        try:
            listing = fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            listing = []
    files = sorted((e["name"].rstrip("/").rsplit("/", 1)[-1], object_version(e), int(e["size"]))
                   for e in listing if e.get("type") == "file")
    if "config.json" not in {name for name, _, _ in files}:
        raise UserError(f"{what} {name_or_path!r}: no config.json there")
    key = hashlib.sha256(f"{name_or_path}|{files}".encode()).hexdigest()[:16]
    return cached_dir(os.path.join(cfg.cache.resolved_dir(), "models"), f"init-{key}",
                      lambda tmp: download_dir(name_or_path, ctx, tmp))

"""A pretrained model in from_pretrained layout, as a directory on this node: a local path as it is,
an object-store URI downloaded once into the node's model cache (`<cache.dir>/models/init-<key>`,
workflows.storage.model_cache), keyed by the URI and every file's name, version and size (one
listing): replaced weights beside an unchanged config.json are a new entry."""

from __future__ import annotations

import hashlib
import os

from workflows.errors import UserError
from workflows.storage.confine import plain_segments, shown
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

    def fill(tmp: str) -> None:
        download_dir(name_or_path, ctx, tmp)
        check_tokenizer_files(tmp, name_or_path)  # nothing refused enters the cache

    return check_tokenizer_files(cached_dir(os.path.join(cfg.cache.resolved_dir(), "models"), f"init-{key}", fill),
                                 name_or_path)


TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20


def check_tokenizer_files(model_dir: str, what: str) -> str:
    """`model_dir` (a model folder from the store), once its tokenizer_config.json names files only
    inside it: each `*_file` key a plain file name that is there (or null), each `*_files` key a list
    of them. The file is the bucket's, and such keys, given as a path, were opened as given (by
    transformers before 5, and by tokenizer classes for keys they take themselves); anything else is
    refused in one line naming the file and key."""
    import json

    path = os.path.join(model_dir, TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return model_dir

    def refuse(key: str, why: str):
        raise UserError(f"{what}: {TOKENIZER_CONFIG}: {key}: {why}: refused (the model was edited in the store)")

    if os.path.getsize(path) > MAX_TOKENIZER_CONFIG_BYTES:
        refuse("(the file)", f"over {MAX_TOKENIZER_CONFIG_BYTES} bytes")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except ValueError:
        refuse("(the file)", "not JSON")
    if not isinstance(doc, dict):
        refuse("(the file)", "not a JSON object")
    for key, value in doc.items():
        if not key.endswith(("_file", "_files")) or value is None:
            continue
        names = value if key.endswith("_files") and isinstance(value, list) else [value]
        for name in names:
            if not (plain_segments(name) and "/" not in name and os.path.isfile(os.path.join(model_dir, name))):
                refuse(key, f"{shown(name, 80)} is not a file name inside the model's folder")
    return model_dir

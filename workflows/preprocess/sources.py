"""Raw shards: list them behind a URI (file, directory or glob); storage/shards.py reads them."""

from __future__ import annotations

from workflows.errors import UserError
from workflows.storage.cache import object_version
from workflows.storage.shards import Shard, read_shards
from workflows.storage.uri import StorageContext, check_bucket, filesystem, reaching, with_protocol

EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
              ".tar": "tar", ".jpg": "image", ".jpeg": "image", ".png": "image", ".webp": "image"}
PATTERN = "*.parquet|*.jsonl|*.json|*.ndjson|*.csv|*.tar|*.jpg|*.jpeg|*.png|*.webp"
# Loose image files are small: one Ray read task per file would cost more than the read itself.
SHARDS_PER_TASK = {"image": 128}


class NoShards(UserError):
    """Nothing at the URI is a shard (empty, missing, or only files of another format): unlike an
    unreachable store or denied access, a place where a built-in dataset may be built."""


def _format_of(uri: str) -> str | None:
    for ext, fmt in EXTENSIONS.items():
        if uri.lower().endswith(ext):
            return fmt
    return None


def list_shards(uri: str, ctx: StorageContext, fmt: str = "auto") -> tuple[list[Shard], str]:
    """The shards behind `uri` in a stable order, and their format."""
    fs, path = filesystem(uri, ctx)
    try:  # listings with details: one request for the sizes and versions, not one per shard
        with reaching(uri, ctx):
            infos = _listing(fs, path)
    except FileNotFoundError:
        infos = {}
    except PermissionError:
        check_bucket(uri, ctx)  # names a missing bucket or bad credentials precisely
        raise UserError(f"access denied listing {uri}: check the AWS credentials and the bucket policy") from None
    except OSError as e:  # endpoint unreachable after s3fs's retries
        raise UserError(f"cannot list {uri} (endpoint {ctx.for_uri(uri).endpoint_url or 'default'}): {e}") from None
    paths = sorted(
        p for p, i in infos.items() if i.get("type") != "directory" and not p.rsplit("/", 1)[-1].startswith((".", "_"))
    )
    if fmt != "auto":  # a named format skips files of another known one (a preview .png beside .jsonl shards)
        paths = [p for p in paths if _format_of(p) in (None, fmt)]
    if not paths:
        check_bucket(uri, ctx)  # "bucket not found" says more than "no shard matched"
        pattern = PATTERN if fmt == "auto" else "|".join(f"*{e}" for e, f in EXTENSIONS.items() if f == fmt)
        raise NoShards(f"no shard matched {uri} (pattern {pattern or '*.' + fmt})")
    formats = {_format_of(p) for p in paths} if fmt == "auto" else {fmt}
    known = {f for f in formats if f is not None}
    if None in formats or len(known) != 1:
        raise UserError(
            f"cannot tell one format for the shards at {uri} (found {sorted(map(str, formats))}); set data.format"
        )
    shards = [Shard(with_protocol(uri, p), int(infos[p].get("size") or 0), object_version(infos[p])) for p in paths]
    return shards, known.pop()


def read_dataset(shards: list[Shard], fmt: str, ctx: StorageContext, cache=None,
                 required_columns: list[str] | None = None, shards_per_task: int | None = None):
    """A Ray Dataset over raw shards (read tasks run on the cluster, not on the driver); shards
    without one of `required_columns` are an error naming the shard and its columns (checked once,
    on the first shard's columns: see read_shards).

    "tar" and "image" shards read as rows (key, image: the encoded bytes, label); see
    storage/shards.py. `shards_per_task` defaults to SHARDS_PER_TASK's value for the format, else 1.
    The rows come in the shards' order.
    """
    per_task = shards_per_task or SHARDS_PER_TASK.get(fmt, 1)
    ds = read_shards(list(shards), fmt, ctx, cache, required_columns=required_columns, shards_per_task=per_task)
    # Blocks go on in their shards' order, not in the order their tasks finish (the context is this
    # dataset's and what is derived from it, not the process's): what is built from the rows (a
    # processed dataset, whose version names only its inputs and seed; batch predictions; the first
    # rows shown) is the same on every run.
    ds.context.execution_options.preserve_order = True
    return ds


def _listing(fs, path: str) -> dict:
    """path -> info for a glob, a directory (shard-like names only) or one object."""
    if any(ch in path for ch in "*?["):
        return fs.glob(path, detail=True)
    if fs.isdir(path):
        return {p: i for p, i in fs.find(path, detail=True).items() if _format_of(p)}
    if fs.exists(path):
        return {path: fs.info(path)}
    return {}

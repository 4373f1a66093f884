"""Raw shards: list them behind a URI (file, directory or glob); storage/shards.py reads them."""

from __future__ import annotations

from workflows.errors import UserError
from workflows.storage.cache import object_version
from workflows.storage.shards import Shard, read_shards
from workflows.storage.uri import StorageContext, check_bucket, filesystem, reaching, with_protocol

EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
PATTERN = "*.parquet|*.jsonl|*.json|*.ndjson|*.csv"


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
        raise UserError(f"cannot list {uri} (endpoint {ctx.endpoint_url or 'default'}): {e}") from None
    paths = sorted(
        p for p, i in infos.items() if i.get("type") != "directory" and not p.rsplit("/", 1)[-1].startswith((".", "_"))
    )
    if not paths:
        check_bucket(uri, ctx)  # "bucket not found" says more than "no shard matched"
        raise UserError(f"no shard matched {uri} (pattern {PATTERN if fmt == 'auto' else '*.' + fmt})")
    formats = {_format_of(p) for p in paths} if fmt == "auto" else {fmt}
    if None in formats or len(formats) != 1:
        raise UserError(
            f"cannot tell one format for the shards at {uri} (found {sorted(map(str, formats))}); set data.format"
        )
    shards = [Shard(with_protocol(uri, p), int(infos[p].get("size") or 0), object_version(infos[p])) for p in paths]
    return shards, formats.pop()


def read_dataset(shards: list[Shard], fmt: str, ctx: StorageContext, cache=None,
                 required_columns: list[str] | None = None):
    """A Ray Dataset over raw shards (read tasks run on the cluster, not on the driver); a shard
    without one of `required_columns` fails its read with an error naming it."""
    return read_shards(list(shards), fmt, ctx, cache, required_columns=required_columns)


def _listing(fs, path: str) -> dict:
    """path -> info for a glob, a directory (shard-like names only) or one object."""
    if any(ch in path for ch in "*?["):
        return fs.glob(path, detail=True)
    if fs.isdir(path):
        return {p: i for p, i in fs.find(path, detail=True).items() if _format_of(p)}
    if fs.exists(path):
        return {path: fs.info(path)}
    return {}

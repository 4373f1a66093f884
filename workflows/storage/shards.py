"""Shards in the object store, read into a Ray Dataset: raw sources (preprocessing) and the
processed dataset's parquet files (training) alike, placed on the node whose shard cache holds them."""

from __future__ import annotations

import hashlib
import math
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass

from workflows.cluster_state import alive_nodes
from workflows.errors import UserError
from workflows.storage import cache_stats
from workflows.storage.transfer import object_version
from workflows.storage.uri import StorageContext, filesystem, reaching


@dataclass(frozen=True)
class Shard:
    uri: str
    size: int
    version: str  # ETag where the store gives one, else size+mtime: a changed object changes it


IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # the image member of a tar sample
LABEL_EXTENSIONS = ("cls", "json")  # its label, in this order of preference
READ_THREADS = 16  # per read task, when it reads several shards


def _image_schema():
    import pyarrow as pa

    # the encoded bytes, undecoded: decoding (and counting bad images) is preprocessing's job
    return pa.schema([("key", pa.string()), ("image", pa.binary()), ("label", pa.string())])


def _read_image_file(f, uri: str):
    """One loose image file of a class-per-folder layout (`…/<label>/<name>.jpg`): one row, labelled
    with its parent directory's name, keyed by its URI."""
    import pyarrow as pa

    if hasattr(f, "read"):
        data = f.read()
    else:
        with open(f, "rb") as local:
            data = local.read()
    parts = uri.rstrip("/").split("/")
    label = parts[-2] if len(parts) >= 2 and parts[-2] else None
    return pa.Table.from_pylist([{"key": uri, "image": data, "label": label}], schema=_image_schema())


def _label_of(ext: str, data: bytes) -> str | None:
    """`key.cls`: the class name or number as text. `key.json`: an object's "label" field. Anything
    unreadable is no label (the sample then counts as unlabeled), not a failed shard."""
    import json

    try:
        if ext == "cls":
            value: str | None = data.decode("utf-8").strip()
        else:
            obj = json.loads(data)
            value = obj.get("label") if isinstance(obj, dict) else None
            value = None if value is None or isinstance(value, dict | list) else str(value).strip()
    except (UnicodeDecodeError, ValueError):
        return None
    return value or None


def _read_tar(f, uri: str):
    """A WebDataset-style tar shard: members grouped by key, the member path up to the first dot of
    its basename (`a/b/x.seg.png` is key `a/b/x`, extension `seg.png`), as webdataset does.

    One row per key, in first-seen order: `key` is "<shard basename>/<member key>", `image` the one
    member named key.jpg|jpeg|png|webp, `label` from key.cls (else key.json's "label"). A key with
    no image member, or more than one, is kept with a null image, so that preprocessing counts it as
    a bad record and names it. Members without a key (no dot in the basename, or a basename starting
    with a dot such as macOS's `._x.jpg`) and non-files are skipped, as webdataset skips them.
    """
    import pyarrow as pa

    shard = uri.rstrip("/").rsplit("/", 1)[-1]
    samples: dict[str, dict[str, list[bytes]]] = {}
    with (tarfile.open(fileobj=f, mode="r:*") if hasattr(f, "read") else tarfile.open(f, mode="r:*")) as tar:
        for member in tar:
            if not member.isfile():
                continue
            directory, _, base = member.name.rpartition("/")
            stem, dot, ext = base.partition(".")
            if not stem or not dot:
                continue
            key = f"{directory}/{stem}" if directory else stem
            member_file = tar.extractfile(member)
            assert member_file is not None  # a regular file (isfile above) always has one
            data = member_file.read()
            samples.setdefault(key, {}).setdefault(ext.lower(), []).append(data)
        # tarfile stops quietly at a truncated or garbled header after the first member, as if the
        # archive ended there: a shard cut short would lose its tail unnoticed. A real end is a zero block.
        tar.fileobj.seek(tar.offset)
        if tar.fileobj.read(tarfile.BLOCKSIZE) != tarfile.NUL * tarfile.BLOCKSIZE:
            raise tarfile.ReadError(f"truncated or corrupt header at byte {tar.offset}, no end-of-archive block")
    rows = []
    for key, members in samples.items():
        images = [d for ext in IMAGE_EXTENSIONS for d in members.get(ext, [])]
        label = next((_label_of(ext, members[ext][0]) for ext in LABEL_EXTENSIONS if ext in members), None)
        rows.append({"key": f"{shard}/{key}", "image": images[0] if len(images) == 1 else None, "label": label})
    return pa.Table.from_pylist(rows, schema=_image_schema())


def _read_local(path, fmt: str, uri: str = ""):
    """One shard (a local path, or an open binary file) as a pyarrow Table; `uri` names it in image
    keys and labels."""
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    if fmt == "parquet":
        return pq.read_table(path)
    if fmt == "tar":
        return _read_tar(path, uri)
    if fmt == "image":
        return _read_image_file(path, uri)
    if fmt == "jsonl":
        return pajson.read_json(path)
    # Quoted fields in real CSVs carry newlines (Made-With-ML's descriptions do).
    return pacsv.read_csv(path, parse_options=pacsv.ParseOptions(newlines_in_values=True))


def read_parquet(uri: str, ctx: StorageContext, columns: list[str] | None = None, shard_cache=None):
    """One parquet file as a pyarrow Table (only `columns`, if given), through `shard_cache` if given:
    for the few rows a process reads itself, where a Ray Data job would cost more than the read."""
    import pyarrow.parquet as pq

    return _parquet(uri, ctx, shard_cache, lambda source: pq.read_table(source, columns=columns))


def read_parquet_schema(uri: str, ctx: StorageContext, shard_cache=None):
    """One parquet file's schema (its footer), through `shard_cache` if given, as read_parquet reads."""
    import pyarrow.parquet as pq

    return _parquet(uri, ctx, shard_cache, pq.read_schema)


def _parquet(uri: str, ctx: StorageContext, shard_cache, read):
    if shard_cache is not None:
        with shard_cache.open_local(uri) as local:
            return read(local)
    fs, path = filesystem(uri, ctx)
    with fs.open(path, "rb") as f:
        return read(f)


def _read_one(
    uri: str, fmt: str, ctx: StorageContext, shard_cache, version: str | None = None, size: int | None = None
):
    import pyarrow as pa

    try:
        if shard_cache is not None:
            with shard_cache.open_local(uri, version, size) as local:
                return _read_local(local, fmt, uri)
        fs, path = filesystem(uri, ctx)
        with fs.open(path, "rb") as f:
            return _read_local(f, fmt, uri)
    except tarfile.TarError as e:
        raise UserError(f"malformed tar shard {uri}: {' '.join(str(e).split()) or type(e).__name__}") from None
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        msg = str(e).strip()
        row = re.search(r"in row (\d+)", msg) if fmt == "jsonl" else None  # pyarrow counts rows from 0
        where = f" (line {int(row.group(1)) + 1} of the file)" if row else ""
        raise UserError(f"malformed {fmt} shard {uri}: {msg}{where}") from None


def _column_types(table, fmt: str) -> dict[str, str]:
    """Column -> type, as strictly as the format allows: parquet types are declared, while
    JSON/CSV types are inferred per shard (an all-integer shard is int64, another double), so
    those only distinguish text from everything else."""
    import pyarrow as pa

    def kind(t) -> str:
        if fmt == "parquet":
            return str(t)
        if pa.types.is_null(t):
            return "null"
        return "string" if pa.types.is_string(t) or pa.types.is_large_string(t) else "non-string"

    return {f.name: kind(f.type) for f in table.schema}


def check_schema(uri: str, table, fmt: str, reference: tuple[str, dict[str, str]] | None) -> None:
    """Fail, naming both shards, when `uri`'s columns differ from the reference shard's."""
    if reference is None or reference[0] == uri:
        return
    ref_uri, ref = reference
    got = _column_types(table, fmt)
    if set(got) != set(ref):
        raise UserError(
            f"schema differs between shards: {uri} has columns {sorted(got)} but {ref_uri} has {sorted(ref)}"
        )
    for col, t in got.items():
        if t != ref[col] and "null" not in (t, ref[col]):
            raise UserError(
                f"schema differs between shards: column {col!r} is {t} in {uri} but {ref[col]} in {ref_uri}"
            )


def check_columns(uri: str, columns, required: list[str]) -> None:
    """Fail, naming the shard and its columns, when a column the config names is missing."""
    missing = [c for c in required if c not in columns]
    if missing:
        raise UserError(f"column(s) {missing} not found in {uri} (columns: {sorted(columns)}); "
                        "set data.text_columns / data.label_column")


def _read_shard_batch(batch: dict, fmt: str, ctx: StorageContext, cache, reference=None, required=()):
    """Read the shards named in a batch of URIs, in a Ray task on whatever node it runs on,
    through that node's shard cache (`cache` is a CacheConfig, resolved on the node)."""
    import pyarrow as pa

    shard_cache = cache.shard_cache(ctx) if cache is not None and cache.enabled else None
    before = shard_cache.stats() if shard_cache is not None else None

    def read(uri, version, size):
        uri, version, size = (
            str(uri),
            (None if version is None else str(version)),
            (None if size is None else int(size)),
        )
        table = _read_one(uri, fmt, ctx, shard_cache, version if version else None, size if version else None)
        check_schema(uri, table, fmt, reference)
        check_columns(uri, table.column_names, list(required))
        return table

    shards = list(zip(batch["uri"], batch["version"], batch["size"]))
    if len(shards) > 1:
        # Several shards per task (small files, e.g. loose images): a read is mostly waiting on the
        # store, so a few threads overlap them. The cache is safe across threads (per-entry flocks on
        # separate fds, a locked client creation); the order of the shards is kept.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(READ_THREADS, len(shards))) as pool:
            tables = list(pool.map(lambda s: read(*s), shards))
    else:
        tables = [read(*s) for s in shards]
    if shard_cache is not None:
        cache_stats.report(before, shard_cache.stats())
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def reference_schema(shard: Shard, fmt: str, ctx: StorageContext, cache=None) -> tuple[str, dict[str, str]]:
    """The first shard's columns (read through the cache), for every read task to compare with."""
    shard_cache = cache.shard_cache(ctx) if cache is not None and cache.enabled else None
    before = shard_cache.stats() if shard_cache is not None else None
    table = _read_one(shard.uri, fmt, ctx, shard_cache, shard.version or None, shard.size if shard.version else None)
    if shard_cache is not None:
        cache_stats.report(before, shard_cache.stats())
    return shard.uri, _column_types(table, fmt)


def read_shards(
    shards: Sequence[str | Shard],
    fmt: str,
    ctx: StorageContext,
    cache=None,
    num_cpus: float | None = None,
    check_schemas: bool = True,
    required_columns: list[str] | None = None,
    shards_per_task: int = 1,
):
    """A Ray Dataset over exactly these shards, through the shard cache: one read task per
    `shards_per_task` shards (1 for real shards; many for small files such as loose images, where a
    task per file would cost more than its read), the shards of one task read by a few threads.

    Shards from `list_shards` carry their version and size from the listing, so a warm read
    sends no request per shard to the object store; plain URIs get theirs here, from one listing
    per directory (`with_versions`), as every pass over the dataset re-runs the reads.

    Unlike `ray.data.read_parquet`, no file-listing task is scheduled (it asks for a whole CPU even
    when the reads ask for none), and the reads can be given `num_cpus=0` (see
    ProcessedDataset.read for why). With `check_schemas`, a shard whose columns differ from the
    first shard's fails its read with an error naming both. `required_columns` are checked once, on
    the first shard's columns, here (every other shard has the same columns or fails its read);
    a single shard has no reference read, and its one read checks them instead. No pass over the
    data is spent on either (Ray's `ds.schema()` would run reads, then cancel them).
    """
    import ray
    import ray.data
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if shards_per_task < 1:
        raise ValueError(f"shards_per_task must be >= 1, got {shards_per_task}")
    as_shards: list[Shard] = [s if isinstance(s, Shard) else Shard(s, 0, "") for s in shards]
    if cache is not None and cache.enabled:
        as_shards = with_versions(as_shards, ctx)

    def read(group: list[Shard], node_id: str | None):
        items = [{"uri": s.uri, "version": s.version, "size": s.size} for s in group]
        # one block per read task; batch_size=None makes the whole block one batch (one call)
        ds = ray.data.from_items(items, override_num_blocks=math.ceil(len(group) / shards_per_task))
        placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True)} if node_id else {}
        return ds.map_batches(
            _read_shard_batch,
            batch_size=1 if shards_per_task == 1 else None,
            batch_format="pyarrow",
            num_cpus=num_cpus,
            **placement,
            fn_kwargs={"fmt": fmt, "ctx": ctx, "cache": cache, "reference": reference,
                       "required": [] if reference is not None else list(required_columns or [])},
        )

    groups = shard_placement(as_shards) if cache is not None and cache.enabled else {}
    reference = None
    if check_schemas and len(as_shards) > 1:
        # read on the node that will read shard 0 anyway, so its cache fetches it once
        node = next((n for n, g in groups.items() if as_shards[0] in g), None)
        placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)} if node else {}
        task = ray.remote(num_cpus=0, max_retries=0)(reference_schema).options(**placement)
        reference = ray.get(task.remote(as_shards[0], fmt, ctx, cache))
        check_columns(reference[0], list(reference[1]), list(required_columns or []))
    if not groups:  # one node, or no cache: nothing to place
        return read(as_shards, None)
    # One group is placed too: when every shard hashes to one node (1 in 2**(n-1) for n shards on
    # two nodes; always for one shard), unplaced reads would land anywhere and fill other caches.
    parts = [read(group, node_id) for node_id, group in groups.items()]
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def with_versions(shards: list[Shard], ctx: StorageContext) -> list[Shard]:
    """`shards`, those without a version (plain URIs, e.g. a processed split's files from its
    manifest) given their size and version from one listing of each directory that holds them.

    # why: a Ray Dataset re-runs its read tasks on every pass (each training epoch), and a read
    # task's cache stats a shard it has no version of: a HEAD per shard per epoch, and a warm epoch
    # that fails with the store down. One listing here, on the driver, once per dataset, spares
    # them. A shard the listing lacks stays plain (its read names it if it is missing)."""
    plain = {s.uri.rsplit("/", 1)[0] for s in shards if not s.version and "/" in s.uri}
    listed: dict[str, dict] = {}
    for directory in sorted(plain):
        fs, path = filesystem(directory, ctx)
        try:
            with reaching(directory, ctx):
                entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            continue
        listed.update({e["name"]: e for e in entries if e.get("type") == "file"})
    out = []
    for s in shards:
        entry = None if s.version else listed.get(filesystem(s.uri, ctx)[1])
        out.append(Shard(s.uri, int(entry["size"]), object_version(entry)) if entry else s)
    return out


def shard_placement(shards: list[Shard]) -> dict[str, list[Shard]]:
    """Which node reads which shard: rendezvous hashing over the live nodes with CPUs.

    The same shard goes to the same node on every run while the nodes live, so a node's shard
    cache keeps serving it (a later epoch, job or tuning trial fetches nothing). The affinity is
    soft: if that node is busy or gone, another reads the shard (and caches it).
    """
    nodes = [n.node_id for n in alive_nodes() if n.resources.get("CPU", 0) > 0]
    if len(nodes) <= 1:
        return {}
    groups: dict[str, list[Shard]] = {}
    for shard in shards:
        node = max(nodes, key=lambda n: hashlib.sha256(f"{n}|{shard.uri}".encode()).digest())
        groups.setdefault(node, []).append(shard)
    return groups

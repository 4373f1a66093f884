"""The dataset index: the ordered list of shards with their sample counts, and each tar shard's
member table (where each sample's bytes lie), built from the tar headers of the cached copy.

`<prefix>/index.json` (`workflows data synth-images` writes it):
    {"format": "wds-tar", "version": 1, "classes": 100,
     "shards": [{"name": "shard-000000.tar", "samples": 1187, "bytes": 134217216,
                 "version": "9b2cf535f27731c974343645a3985328"}, ...]}
Names are relative to the prefix; other keys are allowed (and ignored). Optional "labels": the
class names, when the `.cls` members hold names rather than class numbers. Optional per shard
"version": the object's version when indexed (`object_version`: its ETag, else size:mtime), which
with "bytes" is what the shard cache keys an entry on, so a cached shard is read with no request
to the store; an index without versions (older ones) costs one request per shard and loader.
Without an index.json, read_index builds it from the tar headers once and saves it there
(atomically); a later run reuses it while the prefix's *.tar names and sizes still match it.

A "raw" index (sample_index) lists each shard's samples by byte range with its class id (the
`members` of each shard entry): an image task's training split read straight from its WebDataset
tars or class-per-folder files, a subset of each shard, in shard and member order. A "raw-parquet"
index lists, per parquet shard, the row numbers of its samples with their class ids (`rows`,
`labels`) and names the column that holds the encoded image (`column`): the training split of a
parquet source with image bytes in a column (preprocess.image_dataset.parquet_sample_index).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workflows.errors import StoreUnreachable, UserError
from workflows.loader.order import shard_offsets
from workflows.storage.atomic import atomic_write
from workflows.storage.shards import IMAGE_EXTENSIONS, LABEL_EXTENSIONS, _label_of
from workflows.storage.transfer import object_version
from workflows.storage.uri import (
    StorageContext,
    exists,
    filesystem,
    join,
    reaching,
    read_json,
    with_protocol,
    write_json,
)

log = logging.getLogger(__name__)

INDEX_FILE = "index.json"
FORMATS = ("wds-tar", "parquet", "raw", "raw-parquet")
INDEX_FETCHES = 4  # shards fetched at once while building an index
KEPT = "indexes"  # under a shard cache's directory: the indexes kept on the node (keep_index)


@dataclass(frozen=True)
class ShardEntry:
    name: str  # relative to the index's prefix (or a whole URI when the prefix is "")
    samples: int
    bytes: int = 0
    version: str | None = None  # object_version when indexed (with bytes: the shard cache's key)


@dataclass(frozen=True)
class DatasetIndex:
    prefix: str
    shards: list[ShardEntry]
    format: str = "wds-tar"
    classes: int | None = None
    labels: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    members: list[TarMembers | ParquetRows] | None = None  # "raw"/"raw-parquet": known before any fetch
    column: str | None = None  # "raw-parquet": the column holding the encoded image

    def __post_init__(self):
        if self.format not in FORMATS:
            raise UserError(f"index of {self.prefix}: format {self.format!r} is not one of {FORMATS}")
        if not self.shards:
            raise UserError(f"index of {self.prefix or 'the dataset'} lists no shards")

    @property
    def counts(self) -> list[int]:
        return [s.samples for s in self.shards]

    @property
    def offsets(self) -> np.ndarray:
        return shard_offsets(self.counts)

    def __len__(self) -> int:
        return int(sum(self.counts))

    def uri(self, shard: int) -> str:
        name = self.shards[shard].name
        return join(self.prefix, name) if self.prefix else name

    def to_json(self) -> dict:
        shards = [{"name": s.name, "samples": s.samples, "bytes": s.bytes,
                   **({"version": s.version} if s.version is not None else {})} for s in self.shards]
        for entry, m in zip(shards, self.members or ()):
            if isinstance(m, ParquetRows):
                entry.update(rows=m.rows.tolist(), labels=m.labels.tolist())
            else:
                entry.update(offsets=m.offsets.tolist(), sizes=m.sizes.tolist(), labels=m.labels.tolist())
        out = {"format": self.format, "version": 1, "shards": shards}
        if self.column is not None:
            out["column"] = self.column
        if self.classes is not None:
            out["classes"] = self.classes
        if self.labels is not None:
            out["labels"] = self.labels
        return {**self.extra, **out}

    @classmethod
    def from_json(cls, prefix: str, obj: dict) -> DatasetIndex:
        where = join(prefix, INDEX_FILE)
        try:
            shards = [ShardEntry(str(s["name"]), int(s["samples"]), int(s.get("bytes", 0)),
                                 None if s.get("version") is None else str(s["version"])) for s in obj["shards"]]
            members: list[TarMembers | ParquetRows] | None = None
            if obj.get("format") == "raw":
                members = [TarMembers(np.asarray(s["offsets"], np.int64), np.asarray(s["sizes"], np.int64),
                                      np.asarray(s["labels"], np.int64)) for s in obj["shards"]]
            elif obj.get("format") == "raw-parquet":
                members = [ParquetRows(np.asarray(s["rows"], np.int64), np.asarray(s["labels"], np.int64))
                           for s in obj["shards"]]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{where}: 'shards' must be a list of {{name, samples, bytes, version}} ({e})") from None
        known = {"format", "version", "shards", "classes", "labels", "column"}
        return cls(prefix=prefix, shards=shards, format=obj.get("format", "wds-tar"), classes=obj.get("classes"),
                   labels=obj.get("labels"), extra={k: v for k, v in obj.items() if k not in known}, members=members,
                   column=obj.get("column"))


@dataclass(frozen=True)
class TarMembers:
    """One tar shard's samples in member order: where each image's bytes lie, and its label."""

    offsets: np.ndarray  # int64: byte offset of the image member's data
    sizes: np.ndarray  # int64
    labels: np.ndarray  # int64 class ids (-1: none)
    keys: tuple[str, ...] = ()  # the member keys (tar_members), as storage.shards names the samples


@dataclass(frozen=True)
class ParquetRows:
    """One parquet shard's samples: their row numbers in the file (in file order) and class ids."""

    rows: np.ndarray  # int64
    labels: np.ndarray  # int64


def _label_id(text: str | None, labels: list[str] | None, where: str) -> int:
    if text is None:
        return -1
    if labels is not None and text in labels:
        return labels.index(text)
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{where}: label {text!r} is not a class number and not in the index's 'labels'") from None


def tar_members(path: str, uri: str, labels: list[str] | None = None, strict: bool = True) -> TarMembers:
    """The member table of an uncompressed WebDataset tar, from its headers only (tarfile seeks past
    the data). Samples are keys in first-seen order, as storage.shards reads them. Raises a
    UserError naming `uri` for a truncated or corrupt shard, or (`strict`) a sample without exactly one
    image or label (else such a sample is listed with offset -1, label -1: preprocessing's bad record)."""
    samples: dict[str, dict[str, tuple[int, int]]] = {}
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                directory, _, base = m.name.rpartition("/")
                stem, dot, ext = base.partition(".")
                if stem and dot:
                    key = f"{directory}/{stem}" if directory else stem
                    samples.setdefault(key, {})[ext.lower()] = (m.offset_data, m.size)
            # tarfile stops quietly at a garbled header, as if the archive ended: a real end is a zero block
            f.seek(tar.offset)
            if f.read(tarfile.BLOCKSIZE) != tarfile.NUL * tarfile.BLOCKSIZE:
                raise tarfile.ReadError(f"truncated or corrupt header at byte {tar.offset}, no end-of-archive block")
    except tarfile.TarError as e:
        raise UserError(f"malformed tar shard {uri}: {' '.join(str(e).split()) or type(e).__name__}") from None
    offs, sizes, labs = [], [], []
    with open(path, "rb") as f:
        for key, members in samples.items():
            images = [members[e] for e in IMAGE_EXTENSIONS if e in members]
            if len(images) != 1 and not strict:
                offs.append(-1)
                sizes.append(0)
                labs.append(-1)
                continue
            if len(images) != 1:
                raise UserError(f"tar shard {uri}: sample {key!r} has {len(images)} image members, not 1")
            off, n = images[0]
            if off + n > size:
                raise UserError(f"malformed tar shard {uri}: sample {key!r} runs past the end of the file")
            label = None
            for ext in LABEL_EXTENSIONS:
                if ext in members:
                    loff, ln = members[ext]
                    label = _label_of(ext, os.pread(f.fileno(), ln, loff))
                    break
            offs.append(off)
            sizes.append(n)
            labs.append(_label_id(label, labels, f"tar shard {uri}, sample {key!r}") if strict else -1)
    return TarMembers(np.asarray(offs, np.int64), np.asarray(sizes, np.int64), np.asarray(labs, np.int64),
                      tuple(samples))


def kept_index(cache, key: str, prefix: str = "") -> DatasetIndex | None:
    """The copy of an index this node keeps beside its shard cache (`keep_index`), if any."""
    if cache is None:
        return None
    try:
        return DatasetIndex.from_json(prefix, json.loads(_kept_path(cache, key).read_bytes()))
    except (FileNotFoundError, ValueError, UserError):
        return None


def keep_index(cache, key: str, index: DatasetIndex) -> DatasetIndex:
    """Keep `index` on this node under `key` (a URI, or the files it lists), beside `cache`'s shards,
    so that a new process finds it without asking the store; returns it."""
    if cache is not None:
        path = _kept_path(cache, key)
        path.parent.mkdir(exist_ok=True)
        atomic_write(path, json.dumps(index.to_json()).encode(), tmp=f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex}")
    return index


def _kept_path(cache, key: str) -> Path:
    return Path(cache.dir) / KEPT / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def read_index(prefix: str, storage: StorageContext, cache=None) -> DatasetIndex:
    """`<prefix>/index.json`; without one (or with one whose shards no longer match the prefix's
    *.tar names and sizes), an index built by reading every `*.tar` shard's headers once through
    `cache` (a ShardCache; INDEX_FETCHES shards at a time; logged, as it fetches every shard), then
    saved as `<prefix>/index.json`. With `cache`, the index is kept on the node too: when the store
    cannot be reached, that copy is read (a warm epoch of a new process runs with the store down)."""
    index_uri = join(prefix, INDEX_FILE)
    try:
        return keep_index(cache, index_uri, _read_index(prefix, storage, cache))
    except StoreUnreachable as e:
        kept = kept_index(cache, index_uri, prefix)
        if kept is None:
            raise
        log.warning("%s; reading this node's copy of %s", e, index_uri)
        return kept


def _read_index(prefix: str, storage: StorageContext, cache) -> DatasetIndex:
    index_uri = join(prefix, INDEX_FILE)
    saved = DatasetIndex.from_json(prefix, read_json(index_uri, storage)) if exists(index_uri, storage) else None
    if saved is not None and cache is None:
        return saved  # nothing to rebuild with: trust it (a stale one fails at fetch, naming the shard)
    if cache is None:
        raise UserError(f"{index_uri} not found, and no shard cache to build an index with")
    fs, path = filesystem(prefix, storage)
    with reaching(prefix, storage):
        try:
            listing = fs.ls(path, detail=True)
        except FileNotFoundError:
            raise UserError(f"dataset prefix not found: {prefix}") from None
    tars = sorted((e for e in listing if e["type"] == "file" and e["name"].endswith(".tar")), key=lambda e: e["name"])
    found = [(e["name"].rstrip("/").rsplit("/", 1)[-1], int(e["size"])) for e in tars]
    if saved is not None and (saved.format != "wds-tar" or (
            [(s.name, s.bytes) for s in saved.shards] == found
            and all(s.version in (None, object_version(e)) for s, e in zip(saved.shards, tars)))):
        return saved
    if not tars:
        raise UserError(f"no index.json and no *.tar shards under {prefix}")
    log.warning("%s has %s: building one from the tar headers of its %d shards (reads each once)", prefix,
                "a stale " + INDEX_FILE if saved is not None else "no " + INDEX_FILE, len(tars))

    def entry(found_and_listed) -> ShardEntry:
        (name, size), e = found_and_listed
        uri, version = with_protocol(prefix, e["name"]), object_version(e)
        with cache.open_local(uri, version, size) as local:  # the listing's version: no HEAD
            return ShardEntry(name, len(tar_members(local, uri).offsets), size, version)

    # several shards at once: one download at a time leaves the store's bandwidth unused (the
    # embedded endpoint: 69 MB/s one shard at a time, 110 MB/s four at a time)
    with ThreadPoolExecutor(min(INDEX_FETCHES, len(tars)), thread_name_prefix="index-build") as pool:
        shards = list(pool.map(entry, zip(found, tars)))
    keep = {k: v for k, v in (saved.to_json() if saved is not None else {}).items() if k in ("classes", "labels")}
    index = DatasetIndex.from_json(prefix, {**DatasetIndex(prefix=prefix, shards=shards).to_json(), **keep})
    write_json(index_uri, index.to_json(), storage)  # atomic: a reader sees the old index or this one
    return index


def sample_index(shards: list, fmt: str, wanted: dict[str, int], storage: StorageContext, cache) -> DatasetIndex:
    """A "raw" index of the samples named in `wanted` (storage.shards' sample key -> class id): from
    each tar shard (`fmt` "tar"; its headers read once through `cache`), or each loose image file
    (`fmt` "image", keyed by its URI), the samples it holds that `wanted` names, in file order."""
    if fmt not in ("tar", "image"):
        raise UserError(f"raw training samples are read from tar shards or image files, not {fmt} shards")
    entries: list[ShardEntry] = []
    members: list[TarMembers | ParquetRows] = []
    for shard in shards:
        if fmt == "image":
            if shard.uri not in wanted:
                continue
            m = TarMembers(np.zeros(1, np.int64), np.asarray([shard.size], np.int64),
                           np.asarray([wanted[shard.uri]], np.int64))
        else:
            with cache.open_local(shard.uri, shard.version, shard.size) as local:
                table = tar_members(local, shard.uri, strict=False)  # labels: `wanted`'s
            base = shard.uri.rstrip("/").rsplit("/", 1)[-1]
            keep = [i for i, k in enumerate(table.keys) if f"{base}/{k}" in wanted]
            if not keep:
                continue
            labels = [wanted[f"{base}/{table.keys[i]}"] for i in keep]
            m = TarMembers(table.offsets[keep], table.sizes[keep], np.asarray(labels, np.int64))
        entries.append(ShardEntry(shard.uri, len(m.offsets), shard.size, shard.version))
        members.append(m)
    if len(entries) == 0:
        raise UserError("none of the wanted samples were found in the raw shards (the source changed?)")
    return DatasetIndex(prefix="", shards=entries, format="raw", members=members)


def parquet_index(files: list[str], storage: StorageContext, cache=None) -> DatasetIndex:
    """Processed parquet shards (a ProcessedDataset split's files, whole URIs) with their row counts
    from the parquet footers (one small read per file) and their versions (the stat that sized them).
    A processed dataset's files never change (their URIs name its version), so with `cache` the
    index is kept on the node and a new process reads it with no request to the store."""
    import pyarrow.parquet as pq

    key = "\n".join(files)
    if (kept := kept_index(cache, key)) is not None:
        return kept
    shards = []
    for uri in files:
        fs, path = filesystem(uri, storage)
        with reaching(uri, storage), fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            info = fs.info(path)
            shards.append(ShardEntry(uri, meta.num_rows, int(info["size"]), object_version(info)))
    return keep_index(cache, key, DatasetIndex(prefix="", shards=shards, format="parquet"))

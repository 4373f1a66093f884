"""The processed dataset, the platform's core data type: a task's stored rows per split under one
URI, described by a `manifest.json` written last, and the helpers every task's preprocessing uses to
find one already made, split rows, write them and the manifest.

Layout: `<storage.root>/processed/<dataset-version>/split=<train|val|test>/*.parquet` and the
manifest, which lists the exact files, the label vocabulary and the counts. Readers go through the
manifest only, so files of an interrupted earlier run are never read, and an unchanged input and
config finds the manifest and reuses the output without recomputing.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from workflows.errors import UserError
from workflows.storage.confine import MAX_NAME_CHARS, first_error, plain_segments, relative_under, shown
from workflows.storage.shards import read_parquet, read_parquet_schema, read_shards
from workflows.storage.uri import (
    StorageContext,
    exists,
    filesystem,
    join,
    pyarrow_filesystem,
    read_json,
    with_protocol,
    write_json,
)

SPLITS = ("train", "val", "test")


@dataclass
class ProcessedDataset:
    """A processed dataset: parquet files per split (`files`) under `uri`, described by its
    manifest.json (written last by `write_manifest`: it marks the dataset complete). `labels` is a
    classifier's vocabulary, `label_column` what evaluation scores predictions against, `info` what
    else the task stored (statistics, sizes); the default export copies labels and info into the card."""

    uri: str
    version: str
    labels: list[str]  # a classifier's label vocabulary (index = label id); empty for other tasks
    label_column: str  # the column of the stored rows that evaluation scores predictions against
    files: dict[str, list[str]]
    counts: dict[str, int]  # rows per split
    label_counts: dict[str, dict[str, int]]  # a classifier's rows per split and label; empty for other tasks
    source: str
    task: str = "classification"  # model.task that wrote it
    text_columns: list[str] = field(default_factory=list)  # text tasks
    tokenizer: str | None = None
    max_length: int | None = None
    info: dict[str, Any] = field(default_factory=dict)  # what else the task stored (an image size, ...)
    reused: bool = False

    @classmethod
    def from_manifest(cls, m: dict) -> ProcessedDataset:
        """The dataset a manifest describes, as written (no check: a manifest of this process's own)."""
        return cls(**{k: m[k] for k in cls.__dataclass_fields__ if k in m})

    @classmethod
    def load(cls, uri: str, ctx: StorageContext) -> ProcessedDataset:
        """The dataset whose manifest is at `uri`, read back from the store and checked: each field of
        its type and within its bounds, and its files under `uri` (by plain-name segments, relative or
        below the folder it was written to), found where it is read from now; its own `uri` is not
        followed. Anything else is refused in one line naming the manifest and the key."""
        where = join(uri, MANIFEST)
        try:
            checked = _Manifest.model_validate(read_json(where, ctx, max_bytes=MAX_MANIFEST_BYTES))
        except ValidationError as e:  # before json's ValueError: a subclass
            raise UserError(f"{where}: {first_error(e)}; the manifest was edited in the store: preprocess "
                            "again") from None
        except ValueError as e:  # not JSON
            raise UserError(f"{where} is not JSON: {str(e).splitlines()[0]}") from None
        data = cls.from_manifest(checked.model_dump(exclude_unset=True))
        data.files = {split: [_under_dataset(uri, checked.uri, f, f"{where}: files.{split}[{i}]")
                              for i, f in enumerate(names)] for split, names in checked.files.items()}
        data.uri = uri
        return data

    def tokenizer_of(self, expected: str | None) -> str:
        """The tokenizer this text dataset was written with, which must be `expected`, the one the
        config's task writes (its dataset seam's `tokenizer`: preprocess.tokenizer, a chat model's base): a
        manifest is the bucket's, and a bucket writer does not choose what is read (and copied into a
        registered model) as a tokenizer."""
        where = join(self.uri, MANIFEST)
        if not self.tokenizer:
            raise UserError(f"{where}: tokenizer: the processed dataset {self.version} ({self.task}) names none")
        if self.tokenizer != expected:
            raise UserError(f"{where}: tokenizer {shown(self.tokenizer)} is not the one this config's task reads "
                            f"({expected!r}, from preprocess.tokenizer or model.name_or_path): set it to the one the "
                            "dataset was made with, or preprocess again")
        return self.tokenizer

    def read(self, split: str, ctx: StorageContext, num_cpus: float | None = None, cache=None):
        """A Ray Dataset of one split, read from exactly the files the manifest lists.

        `num_cpus=0` for training ingest: the reads are light and I/O-bound, and on a small machine
        the train workers hold every CPU, so reads that wait for a CPU would never run.
        """
        return read_shards(self.split_files(split), "parquet", ctx, cache, num_cpus=num_cpus,
                           check_schemas=False)  # written by us

    def split_files(self, split: str) -> list[str]:
        """The files the manifest lists for one split; UserError naming the split when it lists none."""
        files = self.files.get(split) or []
        if not files:
            raise UserError(f"processed dataset {self.version} has no rows in split {split!r}")
        return files


@dataclass(frozen=True)
class SplitRows:
    """One split of a processed dataset, for evaluation to read as suits it: `frame` reads the named
    columns in this process (a small split: a Ray Data job would only add its executor's start),
    `dataset` is the Ray Dataset (`ProcessedDataset.read`)."""

    data: ProcessedDataset
    split: str
    ctx: StorageContext
    cache: Any = None  # the config's CacheConfig: reads through the node's shard cache when it is on

    @property
    def rows(self) -> int:
        return self.data.counts.get(self.split, 0)

    def dataset(self):
        return self.data.read(self.split, self.ctx, cache=self.cache)

    @cached_property
    def _shard_cache(self):
        return self.cache.shard_cache(self.ctx) if self.cache is not None and self.cache.enabled else None

    @cached_property
    def _schema(self):
        """The split's schema (the first file's: a processed split's files share one), read once."""
        return read_parquet_schema(self.data.split_files(self.split)[0], self.ctx, self._shard_cache)

    def names(self) -> set[str]:
        return set(self._schema.names)

    def frame(self, columns: list[str]):
        """These columns of every row as a pandas DataFrame, in file order; None when one of them is a
        tensor column (an extension type, or its metadata where ray.data has not registered the type:
        its pandas form is Ray Data's to give)."""
        import pandas as pd
        import pyarrow as pa

        schema = self._schema
        if any(isinstance(schema.field(c).type, pa.ExtensionType)
               or b"ARROW:extension:name" in (schema.field(c).metadata or {}) for c in columns):
            return None
        return pd.concat([read_parquet(f, self.ctx, columns, self._shard_cache).to_pandas()
                          for f in self.data.split_files(self.split)], ignore_index=True)


MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # about half a million file entries
_Text = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]
_Count = Annotated[int, Field(ge=0, le=2**53)]


class _Manifest(BaseModel):
    """The fields of a manifest.json the platform reads, with their types and bounds; other keys (the
    shards, the format, the seconds it took) are kept as they are."""

    model_config = ConfigDict(extra="allow")

    uri: _Text
    version: _Text
    labels: list[_Text] = []
    label_column: _Text
    files: dict[Literal["train", "val", "test"], list[Any]]
    counts: dict[_Text, _Count]
    label_counts: dict[_Text, dict[_Text, _Count]] = {}
    source: _Text
    task: _Text = "classification"
    text_columns: list[_Text] = []
    tokenizer: _Text | None = None
    max_length: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    info: dict[_Text, Any] = {}


def _under_dataset(read_from: str, written_to: str, name: object, what: str) -> str:
    """A manifest's file entry as a URI under `read_from`: a relative name, or one below the folder the
    manifest was written to or is read from (preprocessing writes full URIs), by plain-name segments."""
    rel = name if isinstance(name, str) and "://" not in name and not name.startswith("/") and plain_segments(name) \
        else relative_under(read_from, name) or relative_under(written_to, name)
    if rel is None:
        raise UserError(f"{what}: {shown(name)} is not a file below the dataset's folder {read_from}: refused (the "
                        "manifest was edited in the store: preprocess again)")
    return join(read_from, rel)


def _unit_hash(key: str) -> float:
    """A deterministic number in [0, 1) from a string."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def split_of(text: str, seed: int, val_fraction: float, test_fraction: float) -> str:
    """Deterministic split by a hash of the text: identical texts always land in the same split."""
    h = _unit_hash(f"{seed}:{text}")
    if h < test_fraction:
        return "test"
    if h < test_fraction + val_fraction:
        return "val"
    return "train"


def _keep_fraction(text: str, seed: int) -> float:
    return _unit_hash(f"keep:{seed}:{text}")


def materialized(out_uri: str, ctx: StorageContext, say=print) -> ProcessedDataset | None:
    """The processed dataset already written at `out_uri` (its manifest is there), marked reused; or None."""
    if not exists(join(out_uri, MANIFEST), ctx):
        return None
    ds = ProcessedDataset.load(out_uri, ctx)
    ds.reused = True
    say(f"preprocess: dataset version {ds.version} already materialized at {out_uri}: reusing it")
    return ds


def shuffled(ds, seed: int):
    """The rows of a Ray Dataset in a seeded random order: what every task writes.

    Sources often come sorted (a folder per class, a CSV per label), and readers that keep the
    stored order (Ray Train's ingest with preserve_order, torchrun's contiguous rank shares) hand
    each worker a contiguous slice of it: stored in source order, a worker could see one class
    only. Ray Data's seeded all-to-all shuffle mixes rows across blocks, which a per-block
    permutation could not."""
    return ds.random_shuffle(seed=seed)


def write_splits(ds, out_uri: str, ctx: StorageContext, rows_per_file: int, seed: int = 0) -> dict[str, list[str]]:
    """Write a Ray Dataset with a `split` column as `<out_uri>/split=<name>/*.parquet`, its rows in a
    seeded random order (`shuffled`); the files of each split."""
    pa_fs, out_path = pyarrow_filesystem(out_uri, ctx)
    shuffled(ds, seed).write_parquet(out_path, filesystem=pa_fs, partition_cols=["split"],
                                     min_rows_per_file=rows_per_file)
    fs, _ = filesystem(out_uri, ctx)  # listing through fsspec: pyarrow's wrapper has no glob
    return {split: [with_protocol(out_uri, f) for f in sorted(fs.glob(f"{out_path}/split={split}/*.parquet"))]
            for split in SPLITS}


def write_manifest(data: ProcessedDataset, ctx: StorageContext, **extra: Any) -> None:
    """`manifest.json`, written last: it marks the dataset complete (`extra`: more keys, e.g. the shards)."""
    manifest = asdict(data)
    manifest.pop("reused")
    manifest.update(extra)
    write_json(join(data.uri, MANIFEST), manifest, ctx)

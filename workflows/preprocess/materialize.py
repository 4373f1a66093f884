"""Preprocessing on Ray Data: raw shards -> the task's stored examples (text: token ids + label ids),
split, written once per dataset version. `preprocess` runs the config's task (workflows.tasks);
`preprocess_text` is the text tasks' implementation.

Output: `<storage.root>/processed/<dataset-version>/split=<train|val|test>/*.parquet` and a
`manifest.json` written last, which lists the exact files, the label vocabulary and the counts.
Readers go through the manifest only, so files of an interrupted earlier run are never read, and
an unchanged input and config finds the manifest and reuses the output without recomputing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from workflows.config import WorkflowConfig
from workflows.errors import UserError, surface_user_errors
from workflows.preprocess.encoding import TextEncoder, compose_texts, resolve_model_dir
from workflows.preprocess.sources import list_shards, read_dataset
from workflows.storage.shards import Shard, read_shards
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
FORMAT_VERSION = 2  # bump when the processed layout, encoding or row order changes (2: rows shuffled)


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
        return cls(**{k: m[k] for k in cls.__dataclass_fields__ if k in m})

    @classmethod
    def load(cls, uri: str, ctx: StorageContext) -> ProcessedDataset:
        return cls.from_manifest(read_json(join(uri, "manifest.json"), ctx))

    def read(self, split: str, ctx: StorageContext, num_cpus: float | None = None, cache=None):
        """A Ray Dataset of one split, read from exactly the files the manifest lists.

        `num_cpus=0` for training ingest: the reads are light and I/O-bound, and on a small machine
        the train workers hold every CPU, so reads that wait for a CPU would never run.
        """
        files = self.files.get(split) or []
        if not files:
            raise UserError(f"processed dataset {self.version} has no rows in split {split!r}")
        return read_shards(files, "parquet", ctx, cache, num_cpus=num_cpus, check_schemas=False)  # written by us


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


def dataset_version(shards: list[Shard], cfg: WorkflowConfig, tokenizer_dir: str) -> str:
    d, p = cfg.data, cfg.preprocess
    key = {
        "format_version": FORMAT_VERSION,
        "shards": [(s.uri, s.version, s.size) for s in shards],
        "text_columns": d.text_columns, "label_column": d.label_column,
        "val": d.val_fraction, "test": d.test_fraction, "split_seed": d.split_seed, "max_rows": d.max_rows,
        "tokenizer": _tokenizer_identity(tokenizer_dir), "max_length": p.max_length,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _tokenizer_identity(tokenizer_dir: str) -> str:
    """Hash of the tokenizer files: a different vocabulary is a different dataset version."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        path = os.path.join(tokenizer_dir, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


class Tokenize:
    """Ray Data actor: the tokenizer is loaded once per actor, then reused for every batch."""

    def __init__(self, tokenizer_dir: str, max_length: int, text_columns: list[str], label_column: str,
                 labels: list[str], seed: int, val_fraction: float, test_fraction: float):
        self.encoder = TextEncoder(tokenizer_dir, max_length, text_columns)
        self.label_column = label_column
        self.label_ids = {lab: i for i, lab in enumerate(labels)}
        self.split_args = (seed, val_fraction, test_fraction)

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        texts = compose_texts(batch, self.encoder.text_columns)
        out = batch[self.encoder.text_columns].astype(str).copy()
        out[self.label_column] = batch[self.label_column].astype(str)
        out["input_ids"] = [np.asarray(ids, dtype=np.int32) for ids in self.encoder.encode_texts(texts)]
        out["label_id"] = batch[self.label_column].astype(str).map(self.label_ids).astype(np.int64)
        out["split"] = [split_of(t, *self.split_args) for t in texts]
        return out


@functools.lru_cache(maxsize=4)
def _cached_tokenize(args: str) -> Tokenize:
    return Tokenize(*json.loads(args))


def tokenize_batch(batch: pd.DataFrame, *args) -> pd.DataFrame:
    """Ray Data task: Tokenize(*args) on one batch, its tokenizer loaded once per worker process.

    Tasks, not an actor pool: Ray reuses its pooled worker processes for tasks (the tokenizer
    stays cached in each), while every actor is a new process that must start Python, Ray and
    the imports before its first batch; on a loaded 2-CPU machine that start cost more than
    the second core saved (workflows bench data).
    """
    return _cached_tokenize(json.dumps(args))(batch)


def tokenize_args(cfg: WorkflowConfig, tokenizer_dir: str, labels: list[str]) -> tuple:
    """Tokenize's constructor arguments from the config."""
    d, p = cfg.data, cfg.preprocess
    return tokenizer_dir, p.max_length, d.text_columns, d.label_column, labels, d.split_seed, d.val_fraction, \
        d.test_fraction


def _clean(batch: pd.DataFrame, text_columns: list[str], label_column: str, max_rows_fraction: float | None,
           seed: int) -> pd.DataFrame:
    """Drop rows without a label or without any text; optionally keep a deterministic subset."""
    texts = compose_texts(batch, text_columns)
    label = batch[label_column]
    labelled = label.notna().to_numpy() & (label.astype(str).str.strip() != "").to_numpy()
    keep = labelled & np.array([bool(t) for t in texts])
    if max_rows_fraction is not None:
        keep &= np.array([_keep_fraction(t, seed) < max_rows_fraction for t in texts])
    return batch[keep]


def _split_label_counts(batch: pd.DataFrame, text_columns, label, seed, val_fraction, test_fraction) -> pd.DataFrame:
    """Rows of this batch per (split, label)."""
    texts = compose_texts(batch, text_columns)
    pairs = pd.DataFrame(
        {
            "split": [split_of(t, seed, val_fraction, test_fraction) for t in texts],
            "label": batch[label].astype(str).to_numpy(),
        }
    )
    return pairs.groupby(["split", "label"], as_index=False).size().rename(columns={"size": "rows"})


def materialized(out_uri: str, ctx: StorageContext, say=print) -> ProcessedDataset | None:
    """The processed dataset already written at `out_uri` (its manifest is there), marked reused; or None."""
    if not exists(join(out_uri, "manifest.json"), ctx):
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
    write_json(join(data.uri, "manifest.json"), manifest, ctx)


@surface_user_errors()
def preprocess(cfg: WorkflowConfig, ctx: StorageContext, say=print) -> ProcessedDataset:
    """The config's task turns the raw shards into its processed dataset (or finds it made)."""
    from workflows.tasks import get_task

    return get_task(cfg).preprocess(ctx, say)


def preprocess_text(cfg: WorkflowConfig, ctx: StorageContext, say=print) -> ProcessedDataset:
    import ray.data

    d, p = cfg.data, cfg.preprocess
    shards, fmt = list_shards(d.source, ctx, d.format)
    tokenizer_dir = resolve_model_dir(p.tokenizer)
    version = dataset_version(shards, cfg, tokenizer_dir)
    out_uri = cfg.uri("processed", version)
    if (done := materialized(out_uri, ctx, say)) is not None:
        return done

    t0 = time.time()
    say(f"preprocess: {len(shards)} {fmt} shard(s) from {d.source} -> {out_uri}")
    columns = [*d.text_columns, d.label_column]
    raw = read_dataset(shards, fmt, ctx, cfg.cache, required_columns=columns).select_columns(columns)
    fraction = None
    if d.max_rows is not None:
        total = raw.count()
        fraction = min(1.0, d.max_rows / max(total, 1))
    cleaned = raw.map_batches(
        _clean, batch_format="pandas", fn_args=(d.text_columns, d.label_column, fraction, d.split_seed)
    ).materialize()

    # Rows per (split, label), counted per block and summed on the driver: one small row per pair
    # and block comes back, never the rows. (Ray Data's groupby/unique would start a hash shuffle
    # with its aggregator actors: seconds of fixed cost on a small machine for a few counts.)
    split_args = (d.text_columns, d.label_column, d.split_seed, d.val_fraction, d.test_fraction)
    table = cleaned.map_batches(_split_label_counts, batch_format="pandas", fn_args=split_args).to_pandas()
    table = table.groupby(["split", "label"], as_index=False)["rows"].sum()
    # The label vocabulary is fitted once, on all rows, and stored in the manifest.
    labels = sorted(str(x) for x in table["label"].unique())
    if len(labels) < 2:
        raise UserError(
            f"{d.source}: label column {d.label_column!r} has {len(labels)} distinct value(s); need at least 2"
        )

    encoded = cleaned.map_batches(
        tokenize_batch,
        batch_format="pandas",
        batch_size=p.batch_size,
        compute=ray.data.TaskPoolStrategy(size=p.concurrency),
        fn_args=tokenize_args(cfg, tokenizer_dir, labels),
    )
    files = write_splits(encoded, out_uri, ctx, p.rows_per_shard, d.split_seed)
    label_counts: dict[str, dict[str, int]] = {s: {} for s in SPLITS}
    for row in table.itertuples(index=False):
        label_counts[row[0]][str(row[1])] = int(row[2])
    label_counts = {s: dict(sorted(c.items())) for s, c in label_counts.items()}
    counts = {s: sum(c.values()) for s, c in label_counts.items()}
    if counts["train"] == 0:
        raise UserError(f"{d.source}: no training rows after cleaning and splitting")

    result = ProcessedDataset(
        task=cfg.model.task,
        uri=out_uri,
        version=version,
        labels=labels,
        text_columns=d.text_columns,
        label_column=d.label_column,
        tokenizer=p.tokenizer,
        max_length=p.max_length,
        files=files,
        counts=counts,
        label_counts=label_counts,
        source=d.source,
    )
    write_manifest(result, ctx, shards=[asdict(s) for s in shards], format=fmt, seconds=round(time.time() - t0, 2))
    say(f"preprocess: {sum(counts.values())} rows ({counts}) in {time.time() - t0:.1f}s, labels {labels}")
    return result

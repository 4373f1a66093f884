"""Text preprocessing on Ray Data (the text tasks' `preprocess`): raw shards -> token ids + label
ids, split by a hash of the text, written once per dataset version as a ProcessedDataset
(workflows.dataset: the type, its layout and the helpers to write one).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import numpy as np
import pandas as pd

from workflows.config import WorkflowConfig
from workflows.dataset import (
    SPLITS,
    ProcessedDataset,
    _keep_fraction,
    split_of,
    write_splits,
)
from workflows.errors import UserError
from workflows.preprocess.encoding import TextEncoder, compose_texts, resolve_model_dir
from workflows.preprocess.run import start_preprocess
from workflows.preprocess.sources import read_dataset
from workflows.storage.shards import Shard
from workflows.storage.uri import StorageContext

FORMAT_VERSION = 2  # bump when the processed layout, encoding or row order changes (2: rows shuffled)


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


def preprocess_text(cfg: WorkflowConfig, ctx: StorageContext, say=print) -> ProcessedDataset:
    import ray.data

    d, p = cfg.data, cfg.preprocess
    tokenizer_dir = resolve_model_dir(p.tokenizer)
    run = start_preprocess(cfg, ctx, say, lambda shards: dataset_version(shards, cfg, tokenizer_dir))
    if run.done is not None:
        return run.done
    out_uri = run.uri
    columns = [*d.text_columns, d.label_column]
    raw = read_dataset(run.shards, run.format, ctx, cfg.cache, required_columns=columns).select_columns(columns)
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
        version=run.version,
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
    run.finish(result)
    say(f"preprocess: {sum(counts.values())} rows ({counts}) in {run.seconds():.1f}s, labels {labels}")
    return result

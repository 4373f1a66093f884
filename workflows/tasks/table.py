"""Rows of numeric feature columns and a label or target column (CSV, JSONL or parquet shards) -> a
processed dataset: the whole `preprocess` of a tabular task (workflows.api.preprocess_table).

Ray Data reads the shards, keeps the rows whose features (and a regression's target) are finite
numbers and whose label is present, and splits them by a hash of the row's values (identical rows
share a split, as the text path splits by text). The mean and standard deviation of every feature
(and target) are fitted on the train split from per-block sums, so only a few numbers per block come
back to the driver, never the rows; they go to the manifest's `info`, which the default export
copies into the model card: training and serving standardize with the same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from workflows.dataset import (
    SPLITS,
    ProcessedDataset,
    split_of,
    write_splits,
)
from workflows.errors import UserError
from workflows.preprocess.run import start_preprocess
from workflows.preprocess.sources import read_dataset

if TYPE_CHECKING:
    from workflows.storage.uri import StorageContext
    from workflows.tasks.base import Task

LABEL_ID = "label_id"  # a classifier's stored label index (in `labels`)


def clean_rows(batch: pd.DataFrame, numeric: list[str], label: str | None, seed: int, val: float,
               test: float) -> pd.DataFrame:
    """Ray Data: the rows with every `numeric` column a finite number (as float64) and `label` (a
    class, as text) present, with their `split`."""
    out = batch[numeric].apply(pd.to_numeric, errors="coerce").astype(np.float64)
    keep = np.isfinite(out.to_numpy()).all(axis=1)
    if label is not None:
        out[label] = batch[label]
        keep &= out[label].notna().to_numpy()
    out = out[keep].reset_index(drop=True)
    if label is not None:
        out[label] = out[label].astype(str)
    keys = ["\x1f".join(map(str, row)) for row in out.itertuples(index=False)]
    out["split"] = [split_of(k, seed, val, test) for k in keys]
    return out


def group_sums(batch: pd.DataFrame, numeric: list[str], label: str | None) -> pd.DataFrame:
    """Ray Data: per (split, label) of the batch, its rows (n), each numeric column's sum (s<i>) and
    sum of squares (q<i>)."""
    values = batch[numeric].to_numpy(np.float64)
    frame = pd.DataFrame({**{f"s{i}": values[:, i] for i in range(len(numeric))},
                          **{f"q{i}": values[:, i] ** 2 for i in range(len(numeric))}, "n": 1},
                         index=range(len(batch)))
    frame["split"] = batch["split"].to_numpy()
    frame["label"] = batch[label].to_numpy() if label is not None else ""
    return frame.groupby(["split", "label"], as_index=False).sum()


def with_label_ids(batch: pd.DataFrame, label: str, labels: list[str]) -> pd.DataFrame:
    """Ray Data: the `label_id` column, each row's label's index in `labels`."""
    index = {lab: i for i, lab in enumerate(labels)}
    batch[LABEL_ID] = np.array([index[v] for v in batch[label]], dtype=np.int64)
    return batch


def preprocess_table(task: Task, ctx: StorageContext, say, features: list[str], label: str, *,
                     classes: bool) -> ProcessedDataset:
    """The raw shards of `data.source` -> a processed dataset of the `features` (numbers) and `label`:
    a class (`classes=True`; stored as text, with its index in the sorted `labels` as `label_id`) or
    a numeric regression target. `info`: features, label, the train split's per-feature `mean` and
    `std` (lists in the order of `features`; a constant column's std is 1) and a target's
    `target_mean` and `target_std`. Reused when the same version (`task.dataset.version`) exists."""
    d, cfg = task.cfg.data, task.cfg
    if d.max_rows is not None:
        raise UserError(f"data.max_rows: not supported by {task.name or type(task).__name__}")
    run = start_preprocess(cfg, ctx, say, lambda shards: task.dataset.version(shards, ctx))
    if run.done is not None:
        return run.done
    numeric = list(features) if classes else [*features, label]
    rows = read_dataset(run.shards, run.format, ctx, cfg.cache, required_columns=[*features, label])
    rows = rows.map_batches(clean_rows, batch_format="pandas", fn_args=(
        numeric, label if classes else None, d.split_seed, d.val_fraction, d.test_fraction)).materialize()
    sums = rows.map_batches(group_sums, batch_format="pandas", fn_args=(numeric, label if classes else None))
    sums = sums.to_pandas()
    sums = sums.groupby(["split", "label"], as_index=False).sum()
    counts = {s: int(sums.loc[sums["split"] == s, "n"].sum()) for s in SPLITS}
    if counts["train"] < 2:
        raise UserError(f"{d.source}: {counts['train']} training row(s) with numbers in {numeric}")
    train = sums[sums["split"] == "train"].sum(numeric_only=True)
    mean = np.array([train[f"s{i}"] for i in range(len(numeric))]) / counts["train"]
    var = np.array([train[f"q{i}"] for i in range(len(numeric))]) / counts["train"] - mean**2
    std = np.where(var > 1e-12, np.sqrt(np.maximum(var, 0)), 1.0)  # a constant column stays as it is
    info: dict[str, Any] = {"features": list(features), "label": label,
                            "mean": mean[:len(features)].tolist(), "std": std[:len(features)].tolist()}
    labels: list[str] = []
    label_counts: dict[str, dict[str, int]] = {}
    if classes:
        labels = sorted(str(x) for x in sums["label"].unique())
        if len(labels) < 2:
            raise UserError(f"{d.source}: label column {label!r} has {len(labels)} distinct value(s); need at least 2")
        label_counts = {s: {str(r.label): int(r.n) for r in sums[sums["split"] == s].itertuples()} for s in SPLITS}
        rows = rows.map_batches(with_label_ids, batch_format="pandas", fn_args=(label, labels))
    else:
        info.update(target_mean=float(mean[-1]), target_std=float(std[-1]))
    files = write_splits(rows, run.uri, ctx, cfg.preprocess.rows_per_shard, d.split_seed)
    data = run.finish(ProcessedDataset(uri=run.uri, version=run.version, labels=labels, label_column=label,
                                       files=files, counts=counts, label_counts=label_counts, source=d.source,
                                       task=cfg.model.task, info=info))
    say(f"preprocess: {sum(counts.values())} rows ({counts}) in {run.seconds():.1f}s")
    return data

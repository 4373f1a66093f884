"""Preprocessing of labelled images on Ray Data: raw shards (WebDataset tars, parquet with an
image-bytes column, or class-per-folder files) -> decoded, resized, center-cropped uint8 tensors of
the image task's model.options.image_size, split, written once per dataset version.

Decoding runs as Ray Data tasks (preprocess.concurrency at a time) with the same function serving
uses (workflows.preprocess.images.decode_image), so a served image reaches the model as the stored
training tensor does. Each processed row is `key`, `label` and `pixels` (the size x size x 3 uint8
tensor's bytes, row-major HWC); the label ids follow the manifest's label list, so an added class
changes the version, not the stored rows' meaning.

A record that cannot be used (not an image, truncated, empty, a decompression bomb, no label) is
written to the `split=bad` partition with its key and reason, never to a training split: up to
data.max_bad_records of them are named in the summary and skipped; one more fails preprocessing,
naming the first, and no manifest is written (so nothing reads the output as a dataset).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import asdict

import numpy as np
import pandas as pd

from workflows.dataset import (
    SPLITS,
    ProcessedDataset,
    _keep_fraction,
    shuffled,
    split_of,
)
from workflows.errors import UserError
from workflows.loader.index import (
    DatasetIndex,
    ParquetRows,
    ShardEntry,
    TarMembers,
    keep_index,
    kept_index,
    sample_index,
)
from workflows.preprocess.images import BadImage, decode_image
from workflows.preprocess.sources import list_shards, read_dataset
from workflows.storage.uri import exists, filesystem, join, pyarrow_filesystem, read_json, with_protocol, write_json

FORMAT_VERSION = 2  # bump when the stored layout, decoding or row order changes (2: rows shuffled)
BAD = "bad"
TRAIN_SAMPLES = "train-samples.json"  # the train split's raw samples (train_sample_index)


def dataset_version(shards, fmt: str, cfg, image_size: int, image_column: str) -> str:
    d, p = cfg.data, cfg.preprocess
    key = {
        "task": "image", "format_version": FORMAT_VERSION, "format": fmt,
        "shards": [(s.uri, s.version, s.size) for s in shards],
        "image_column": image_column if fmt == "parquet" else None, "label_column": d.label_column,
        "val": d.val_fraction, "test": d.test_fraction, "split_seed": d.split_seed, "max_rows": d.max_rows,
        "image_size": image_size, "max_image_pixels": p.max_image_pixels,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class DecodeImages:
    """Ray Data actor: decode + resize + center-crop each image, assign its split (by a hash of the
    image bytes: identical images always land in the same split) or mark it bad with the reason."""

    def __init__(self, size: int, max_pixels: int, seed: int, val_fraction: float, test_fraction: float,
                 keep_fraction: float | None):
        self.size, self.max_pixels = size, max_pixels
        self.split_args = (seed, val_fraction, test_fraction)
        self.keep_fraction, self.seed = keep_fraction, seed

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        keys, labels, pixels, splits, errors = [], [], [], [], []
        for key, image, label in zip(batch["key"], batch["image"], batch["label"]):
            digest = hashlib.sha256(image).hexdigest() if isinstance(image, bytes | bytearray) else None
            if digest is not None and self.keep_fraction is not None \
                    and _keep_fraction(digest, self.seed) >= self.keep_fraction:
                continue  # data.max_rows: a deterministic subset
            error, data, split = None, None, BAD
            if image is None:
                error = "no image in the record"
            elif not has_label(label):
                error = "no label"
            elif digest is None:  # no hash to split by (bytes() below would take a list of ints)
                error = f"the image is a {type(image).__name__}, not bytes"
            else:
                try:
                    data = decode_image(bytes(image), self.size, self.max_pixels).tobytes()
                    split = split_of(digest, *self.split_args)
                except BadImage as e:
                    error = str(e)
            keys.append(str(key))
            labels.append(None if label is None else str(label).strip())
            pixels.append(data if data is not None else b"")  # one column type in every block
            errors.append(error)
            splits.append(split)
        return pd.DataFrame({"key": keys, "label": labels, "pixels": pixels, "error": errors, "split": splits})


def decode_batch(batch: pd.DataFrame, *args) -> pd.DataFrame:
    """Ray Data task: DecodeImages(*args) on one batch. Tasks, not an actor pool: the decoder has no
    state worth keeping, and Ray's pooled worker processes take tasks at once, where each actor
    is a new process to start (Python, Ray, imports) before its first image."""
    return DecodeImages(*args)(batch)


def decoder_args(cfg, image_size: int, keep_fraction: float | None = None) -> tuple:
    """DecodeImages' constructor arguments from the config (`keep_fraction`: data.max_rows' share)."""
    d, p = cfg.data, cfg.preprocess
    return image_size, p.max_image_pixels, d.split_seed, d.val_fraction, d.test_fraction, keep_fraction


def has_label(label) -> bool:
    """A record's label is usable (else the record is bad: "no label")."""
    return not (label is None or (isinstance(label, float) and np.isnan(label)) or not str(label).strip())


def record_keys(batch: pd.DataFrame, image_column: str) -> list[str]:
    """Parquet rows' sample keys: the row's `key` column if it has one, else a hash of the image
    bytes (what names a bad record, and what train_sample_index finds a training row by)."""
    if "key" in batch.columns:
        return list(batch["key"].astype(str))
    return [hashlib.sha256(b).hexdigest()[:16] if isinstance(b, bytes | bytearray) else "(no image)"
            for b in batch[image_column]]


def _as_records(batch: pd.DataFrame, image_column: str, label_column: str) -> pd.DataFrame:
    """Parquet rows -> (key, image, label), keyed by record_keys."""
    return pd.DataFrame({"key": record_keys(batch, image_column), "image": list(batch[image_column]),
                         "label": list(batch[label_column])})


def _raw_records(cfg, shards, fmt: str, image_column: str, ctx):
    """The source's records as a Ray dataset of (key, image, label): tar members and image files as
    read, parquet rows keyed by record_keys."""
    d = cfg.data
    if fmt == "parquet":
        raw = read_dataset(shards, fmt, ctx, cfg.cache, required_columns=[image_column, d.label_column])
        return raw.map_batches(_as_records, batch_format="pandas", fn_args=(image_column, d.label_column))
    if fmt in ("tar", "image"):
        return read_dataset(shards, fmt, ctx, cfg.cache)
    raise UserError(f"{d.source}: {fmt} shards hold no images; image tasks read tar, parquet or image files "
                    "(set data.format)")


def _written(
    out_uri: str, out_path: str, ctx
) -> tuple[dict[str, list[str]], dict[str, dict[str, int]], list[tuple[str, str]]]:
    """What one attempt wrote under `out_path`: each split's files and label counts, and the bad
    records (key, reason). Labels and errors only: the pixel column is not read back."""
    import pyarrow.parquet as pq

    fs, _ = filesystem(out_uri, ctx)
    files: dict[str, list[str]] = {}
    label_counts: dict[str, dict[str, int]] = {}
    bad: list[tuple[str, str]] = []
    for split in (*SPLITS, BAD):
        found = sorted(fs.glob(f"{out_path}/split={split}/*.parquet"))
        columns = ["key", "error"] if split == BAD else ["label"]
        tables = []
        for f in found:
            with fs.open(f, "rb") as fh:
                tables.append(pq.read_table(fh, columns=columns))
        if split == BAD:
            bad = [(r["key"], r["error"]) for t in tables for r in t.to_pylist()]
            continue
        files[split] = [with_protocol(out_uri, f) for f in found]
        labels = pd.Series([v for t in tables for v in t.column("label").to_pylist()], dtype=object)
        label_counts[split] = {str(k): int(v) for k, v in sorted(labels.value_counts().items())}
    return files, label_counts, bad


def preprocess_images(cfg, image_size: int, image_column: str, ctx, say=print) -> ProcessedDataset:
    import ray.data

    d, p = cfg.data, cfg.preprocess
    shards, fmt = list_shards(d.source, ctx, d.format)
    version = dataset_version(shards, fmt, cfg, image_size, image_column)
    out_uri = cfg.uri("processed", version)
    if exists(join(out_uri, "manifest.json"), ctx):
        ds = ProcessedDataset.load(out_uri, ctx)
        ds.reused = True
        say(f"preprocess: dataset version {version} already materialized at {out_uri}: reusing it")
        return ds

    t0 = time.time()
    say(f"preprocess: {len(shards)} {fmt} shard(s) from {d.source} -> {out_uri} "
        f"({image_size}x{image_size} uint8, {p.concurrency} decoding task(s) at a time)")
    raw = _raw_records(cfg, shards, fmt, image_column, ctx)
    fraction = None
    if d.max_rows is not None:
        fraction = min(1.0, d.max_rows / max(raw.count(), 1))
    decoded = raw.map_batches(
        decode_batch, batch_format="pandas", batch_size=p.batch_size,
        compute=ray.data.TaskPoolStrategy(size=p.concurrency), fn_args=decoder_args(cfg, image_size, fraction),
    )
    # Each attempt writes under a folder of its own: a failed or interrupted earlier attempt's files
    # are never counted or listed (the manifest names this attempt's files only).
    attempt = f"attempt-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    pa_fs, version_path = pyarrow_filesystem(out_uri, ctx)
    out_path = f"{version_path.rstrip('/')}/{attempt}"
    # in a seeded random order, not the source's (often a folder per class): see materialize.shuffled
    shuffled(decoded, d.split_seed).write_parquet(out_path, filesystem=pa_fs, partition_cols=["split"],
                                                  min_rows_per_file=p.rows_per_shard)

    files, label_counts, bad = _written(out_uri, out_path, ctx)
    if len(bad) > d.max_bad_records:
        key, reason = bad[0]
        raise UserError(f"{d.source}: {len(bad)} bad record(s) (data.max_bad_records={d.max_bad_records}); "
                        f"the first: {key}: {reason}")
    counts = {s: sum(c.values()) for s, c in label_counts.items()}
    labels = sorted({lab for c in label_counts.values() for lab in c})
    if len(labels) < 2:
        raise UserError(f"{d.source}: {len(labels)} distinct label(s); need at least 2")
    if counts["train"] == 0:
        raise UserError(f"{d.source}: no training images after decoding and splitting")

    result = ProcessedDataset(
        task=cfg.model.task, uri=out_uri, version=version, labels=labels, label_column="label", files=files,
        counts=counts, label_counts=label_counts, source=d.source,
        info={"image_size": image_size, "pixels": "uint8 HWC bytes", "bad_records": len(bad),
              "bad_examples": [{"key": k, "reason": r} for k, r in bad[:20]]},
    )
    manifest = asdict(result)
    manifest.pop("reused")
    manifest.update(shards=[asdict(s) for s in shards], format=fmt, seconds=round(time.time() - t0, 2))
    write_json(join(out_uri, "manifest.json"), manifest, ctx)  # last: marks the output complete
    skipped = f", {len(bad)} bad record(s) skipped (first: {bad[0][0]}: {bad[0][1]})" if bad else ""
    say(f"preprocess: {sum(counts.values())} images ({counts}) in {time.time() - t0:.1f}s, "
        f"{len(labels)} labels{skipped}")
    return result


def parquet_sample_index(shards, image_column: str, label_column: str, wanted: dict[str, int], cache):
    """A loader.index "raw-parquet" index of the parquet rows whose sample key (record_keys, as
    preprocessing named them) `wanted` maps to a class id, with a usable label (a row of the same
    key without one was a bad record), in file order. Each shard is read once through the node's
    shard `cache`, a row group at a time: the key and label columns only (the image column too when
    the rows have no `key` column, as their keys are the images' hashes)."""
    import pyarrow.parquet as pq

    entries: list[ShardEntry] = []
    members: list[TarMembers | ParquetRows] = []
    for shard in shards:
        with cache.open_local(shard.uri, shard.version, shard.size) as local:
            pf = pq.ParquetFile(local)
            names = pf.schema_arrow.names
            for column, field in ((image_column, "model.options.image_column"), (label_column, "data.label_column")):
                if column not in names:
                    raise UserError(f"{shard.uri}: no column {column!r} ({field}); its columns: {sorted(names)}")
            read = list(dict.fromkeys(["key" if "key" in names else image_column, label_column]))
            rows, labels, start = [], [], 0
            for g in range(pf.num_row_groups):
                batch = pf.read_row_group(g, columns=read).to_pandas()
                for i, (key, label) in enumerate(zip(record_keys(batch, image_column), batch[label_column])):
                    if key in wanted and has_label(label):
                        rows.append(start + i)
                        labels.append(wanted[key])
                start += len(batch)
        if rows:
            entries.append(ShardEntry(shard.uri, len(rows), shard.size, shard.version))
            members.append(ParquetRows(np.asarray(rows, np.int64), np.asarray(labels, np.int64)))
    if not entries:
        raise UserError("none of the train split's samples were found in the parquet shards (the source changed?)")
    return DatasetIndex(prefix="", shards=entries, format="raw-parquet", members=members, column=image_column)


def train_sample_index(cfg, data: ProcessedDataset, ctx, image_column: str):
    """The processed train split's samples where the source holds them (the image task's
    `model.options.image_input=raw`; `image_column`: its parquet column of image bytes): a
    loader.index "raw" index (shard, byte range, class id per sample) of tars or image files, or a
    "raw-parquet" one (file, row, class id) of parquet shards, so training crops the original image
    while val/test (and serving) read the stored center crops.

    The split stays preprocessing's (the train split's `key`s, labels as stored); the index is built
    once, from the tar headers or the parquet key and label columns (one read of each shard through
    the node's cache) or the file listing, and saved as `<processed version>/train-samples.json`.
    The version's URI hashes the source shards' names, versions and sizes, so a changed source has
    a new version and a new index.
    """
    import pyarrow.parquet as pq

    uri = join(data.uri, TRAIN_SAMPLES)
    cache = cfg.cache.shard_cache(ctx)
    if (kept := kept_index(cache, uri)) is not None:  # a processed version's index never changes: no request
        return kept
    if exists(uri, ctx):
        return keep_index(cache, uri, DatasetIndex.from_json("", read_json(uri, ctx)))
    label_id = {lab: i for i, lab in enumerate(data.labels)}
    wanted: dict[str, int] = {}
    rows = 0  # the train split's rows (parquet rows of identical images share a key)
    for f in data.files["train"]:
        fs, path = filesystem(f, ctx)
        with fs.open(path, "rb") as fh:
            t = pq.read_table(fh, columns=["key", "label"])
        wanted.update(zip(t.column("key").to_pylist(), (label_id[v] for v in t.column("label").to_pylist())))
        rows += t.num_rows
    shards, fmt = list_shards(cfg.data.source, ctx, cfg.data.format)
    if fmt not in ("tar", "image", "parquet"):
        raise UserError(f"model.options.image_input=raw reads tar shards, parquet shards or image files; "
                        f"{cfg.data.source} holds {fmt} shards: set model.options.image_input=pixels")
    if dataset_version(shards, fmt, cfg, int(data.info["image_size"]), image_column) != data.version:
        raise UserError(f"{cfg.data.source} changed since dataset version {data.version} was preprocessed: "
                        "run preprocess again")
    if fmt == "parquet":
        index = parquet_sample_index(shards, image_column, cfg.data.label_column, wanted, cache)
    else:
        index = sample_index(shards, fmt, wanted, ctx, cache)
    if len(index) != rows:
        raise UserError(f"{cfg.data.source}: the train split has {rows} samples but its shards hold {len(index)} "
                        "of their keys (the source changed, or parquet rows share a `key`?): run preprocess again")
    write_json(uri, index.to_json(), ctx)  # atomic; each worker of a first run builds the same one
    return keep_index(cache, uri, index)

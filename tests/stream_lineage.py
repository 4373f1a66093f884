"""Shared by test_train_stream.py and elastic_run.py (a process of its own): the digits settings of a
tiny stream-loader run, and the lineage of samples a run trained on, from its SampleRecorder files."""

from __future__ import annotations

import json
from pathlib import Path

DIGITS = Path(__file__).resolve().parent.parent / "configs" / "digits.yaml"
ROWS, BATCH = 160, 16  # 2 workers: 5 steps of 32; 1 worker: 10 steps of 16


def overrides(tmp: Path, *extra: str) -> list[str]:
    return [f"storage.embedded.data_dir={tmp}/s3", f"output_dir={tmp}/runs", f"cache.dir={tmp}/cache",
            "preprocess.concurrency=1", "tracking.enabled=false", "tune.enabled=false", "serve.enabled=false",
            "train.epochs=1", f"train.max_train_rows={ROWS}", "train.max_val_rows=32", f"train.batch_size={BATCH}",
            "train.loader=stream", "train.checkpoint_every_steps=2", "train.num_to_keep=1", *extra]


def lineage(*directories: Path) -> list[int]:
    """The epoch's samples by global position as the final lineage trained on them: each worker
    process's batches, where a later attempt (a restart, or a resumed run) that starts at position
    p replaces everything an earlier one trained from p on."""
    files = [[json.loads(line) for line in f.read_text().splitlines()]
             for directory in directories for f in directory.glob("samples-*.jsonl")]
    attempts: list[list[dict]] = []  # the ranks of one attempt run together; the next starts after
    for rows in sorted(files, key=lambda rows: rows[0]["t"]):
        if attempts and rows[0]["t"] < max(r["t"] for r in attempts[-1]):
            attempts[-1] += rows
        else:
            attempts.append(list(rows))
    kept: list[dict] = []
    for i, rows in enumerate(attempts):
        end = min(r["position"] for r in attempts[i + 1]) if i + 1 < len(attempts) else float("inf")
        kept += [r for r in rows if r["position"] < end]
    return [i for r in sorted(kept, key=lambda r: (r["position"], r["rank"])) for i in r["ids"]]

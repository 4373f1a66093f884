"""train.loader=stream under Ray Train: each sample exactly once per epoch with 2 workers, and a
run stopped at ~40% of its epoch continues from its last step checkpoint with the rest of the
epoch's samples in the same order as an uninterrupted run, on the same or another number of
workers (2 -> 1, 1 -> 2), restarted by Ray Train or resumed with `--resume`.

Real parts: the session's 2-CPU Ray cluster, the digits dataset preprocessed on it into the
embedded S3 endpoint, the small CNN under FSDP2, faults raised inside the workers.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import DIGITS

from reliability.faults import TrainFault
from workflows.config import load_config
from workflows.loader import epoch_order, parquet_index
from workflows.pipeline import stage_preprocess
from workflows.runtime import runtime
from workflows.train.stream_input import SampleRecorder, head
from workflows.train.trainer import fit

ROWS, BATCH = 160, 16  # 2 workers: 5 steps of 32; 1 worker: 10 steps of 16


def overrides(tmp: Path, *extra: str) -> list[str]:
    return [f"storage.embedded.data_dir={tmp}/s3", f"output_dir={tmp}/runs", f"cache.dir={tmp}/cache",
            "preprocess.concurrency=1", "tracking.enabled=false", "tune.enabled=false", "serve.enabled=false",
            "train.epochs=1", f"train.max_train_rows={ROWS}", "train.max_val_rows=32", f"train.batch_size={BATCH}",
            "train.loader=stream", "train.checkpoint_every_steps=2", "train.num_to_keep=1", *extra]


@pytest.fixture(scope="module")
def digits(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream")
    cfg = load_config(DIGITS, overrides(tmp))
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        index = head(parquet_index(data.files["train"], rt.storage), ROWS)
        expected = epoch_order(index.counts, cfg.train.seed, 0, cfg.train.shuffle_window).tolist()
        yield SimpleNamespace(tmp=tmp, rt=rt, data=data, expected=expected)


def run(digits, name: str, workers: int, *extra: str, resume: bool = False, on_step=None):
    cfg = load_config(DIGITS, overrides(digits.tmp, f"train.num_workers={workers}", *extra))
    record = digits.tmp / name
    record.mkdir(exist_ok=True)
    return fit(cfg, digits.rt.storage, digits.data, run_prefix=name, resume=resume, on_step=on_step,
               on_samples=SampleRecorder(str(record)))


def lineage(digits, *names: str) -> list[int]:
    """The epoch's samples by global position as the final lineage trained on them: each worker
    process's batches, where a later attempt (a restart, or a resumed run) that starts at position
    p replaces everything an earlier one trained from p on."""
    files = [[json.loads(line) for line in f.read_text().splitlines()]
             for name in names for f in (digits.tmp / name).glob("samples-*.jsonl")]
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


def test_two_workers_see_each_sample_once_in_the_global_order(digits):
    out = run(digits, "once", 2)
    ids = lineage(digits, "once")
    assert sorted(ids) == sorted(digits.expected) and len(set(ids)) == ROWS
    assert ids == digits.expected  # the epoch's one order, as the loader defines it for any worker count
    h = out.history[0]
    assert h["steps"] == 5 and h["step_checkpoints"] == 2 and h["step_checkpoint_seconds"] > 0


def test_a_restarted_worker_group_continues_mid_epoch(digits):
    marker = digits.tmp / "raised-once"
    # raise in rank 1 before step 2 of 5 (40%): Ray Train restarts the group from the checkpoint after step 2
    out = run(digits, "restart", 2, on_step=TrainFault(epoch=0, step=2, rank=1, action="raise", once=str(marker)))
    assert marker.exists()
    assert out.history[0]["resumed_at_sample"] == 64 and out.history[0]["resumed_from_epoch"] == 0
    assert lineage(digits, "restart") == digits.expected


# 1 -> 2 runs the same code as 2 -> 1 (and test_loader checks both directions without Ray): slow only
@pytest.mark.parametrize("before,after", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_resume_mid_epoch_on_another_worker_count(digits, before, after):
    name = f"w{before}to{after}"
    marker = digits.tmp / f"{name}-raised"
    stop_step = 2 if before == 2 else 4  # 40% of the epoch: 64 samples
    with pytest.raises(Exception, match="injected fault"):
        run(digits, name, before, "train.max_failures=0",
            on_step=TrainFault(epoch=0, step=stop_step, rank=0, action="raise", once=str(marker)))
    out = run(digits, name, after, resume=True)
    assert out.history[0]["resumed_at_sample"] == 64
    assert lineage(digits, name) == digits.expected

"""Helpers shared by the test suite and the fault-injection harness (reliability/): plain
functions, importable outside pytest, so `python -m reliability` uses the same tiny settings."""

from __future__ import annotations

from pathlib import Path

from workflows.net import free_port  # noqa: F401  (re-exported: the tests and reliability/ import it from here)


def tiny_overrides(tmp: Path) -> list[str]:
    """The quickstart shrunk to seconds: a small dataset, short sequences, one short epoch."""
    return [
        f"storage.embedded.data_dir={tmp}/s3",
        f"output_dir={tmp}/runs",
        f"cache.dir={tmp}/cache",
        "data.builtin_rows_per_class=40",
        "preprocess.max_length=32",
        "preprocess.concurrency=1",
        "train.epochs=1",
        # the multi-worker path (FSDP2 across ranks, sharded checkpoints), which the quickstart's
        # num_workers auto does not take on one node; auto itself: tests/test_train_layout.py
        "train.num_workers=2",
        "train.batch_size=8",
        "train.max_train_rows=48",
        "train.lr=3e-4",
        "tune.num_samples=2",
        "tune.max_epochs=2",
        "tune.max_train_rows=24",
        "tune.max_val_rows=16",
        f"serve.port={free_port()}",
        "serve.demo_requests=2",
        # off unless a test tracks on purpose (test_tracking, the shared pipeline run): every
        # command would otherwise create and migrate a SQLite store of its own
        "tracking.enabled=false",
    ]


def wait_until(condition, timeout: float, what: str, every: float = 0.1):
    """Poll `condition()` until it returns something truthy (returned), or fail naming `what` after
    `timeout` s: the tests wait on the condition itself, never on a guessed sleep."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)

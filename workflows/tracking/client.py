"""A fail-soft MLflow client: every call runs on one background thread, in order, so training never
waits on the tracking server; the first failure gives one warning and turns tracking off in this
process, and the run goes on without it.

The same class serves the driver (which creates the runs) and the processes where the numbers are
(rank 0 of a Ray Train run, a Tune trial), which log into a run the driver created (TrackingSpec).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Warn = Callable[[str], None]


@dataclass(frozen=True)
class TrackingSpec:
    """What a process elsewhere on the cluster needs to log into an existing run (pickled to it)."""

    uri: str
    run_id: str
    experiment_id: str
    step_loss_every: int = 10
    tags: tuple[tuple[str, str], ...] = ()  # the driver's run tags that child runs share (git commit, ...)


def resolve_uri(cfg) -> str:
    """tracking.uri, or a SQLite store under the output directory (absolute: workers on this machine
    run in other directories)."""
    if cfg.tracking.uri:
        return cfg.tracking.uri
    return f"sqlite:///{Path(cfg.output_dir).resolve() / 'mlflow.db'}"


def redact_uri(uri: str) -> str:
    """A URI for messages and tags: no user:password@."""
    return re.sub(r"://[^/@]*@", "://***@", uri)


def _stderr_warn(msg: str) -> None:
    print(f"workflows warning: {msg}", file=sys.stderr, flush=True)


def _http_defaults() -> None:
    # MLflow's client retries a failed HTTP call 7 times with exponential backoff by default:
    # minutes per call against a dead server. A user's own setting wins.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")


def check_reachable(uri: str, create: bool) -> None:
    """Raise with the reason when the store cannot be used from this process: a server that does not
    answer /health within seconds, or (a worker on another node) a SQLite file this node lacks."""
    scheme = uri.split(":", 1)[0]
    if scheme in ("http", "https"):
        import requests

        resp = requests.get(uri.rstrip("/") + "/health", timeout=5)
        resp.raise_for_status()
    elif scheme == "sqlite":
        path = Path(uri.removeprefix("sqlite:///").removeprefix("sqlite://"))
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        elif not path.exists():
            # another node: a new empty database here would hide the run from the driver's store
            raise FileNotFoundError(f"{path} is not on this node; use an http:// tracking server for multi-node runs")


def one_line(e: BaseException) -> str:
    first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


class Tracker:
    """Ordered calls on an MlflowClient in a background thread. `call(fn)` returns a Future of
    fn(client), or of None once tracking is off."""

    def __init__(self, uri: str, warn: Warn | None = None, create: bool = False):
        self.uri = uri
        self.off = False
        self._warn = warn or _stderr_warn
        self._create = create
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[Any], Any]) -> Future:
        fut: Future = Future()
        if self.off:
            fut.set_result(None)
            return fut
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mlflow-tracking", daemon=True)
                self._thread.start()
        self._queue.put((fn, fut))
        return fut

    def _loop(self) -> None:
        client = None
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            if self.off:
                fut.set_result(None)
                continue
            try:
                if client is None:
                    client = self._connect()
                fut.set_result(fn(client))
            except Exception as e:  # any failure of the tracking side: one warning, then off
                self.fail(e)
                fut.set_result(None)

    def _connect(self):
        _http_defaults()
        check_reachable(self.uri, self._create)
        from mlflow import MlflowClient

        # MLflow's SQLite store logs its table creation and migrations at INFO on the terminal;
        # the platform's terminal shows its own lines only (a failure still warns, once)
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        return _RetryLocked(MlflowClient(tracking_uri=self.uri, registry_uri=self.uri))

    def fail(self, e: BaseException) -> None:
        if not self.off:
            self.off = True
            self._warn(f"experiment tracking is off for this process ({redact_uri(self.uri)}: {one_line(e)}); "
                       "the run goes on, its metrics stay in the run summaries")

    def flush(self, timeout: float = 60) -> None:
        """Wait until what was queued so far has been sent (or `timeout`)."""
        if self._thread is not None and self._thread.is_alive():
            try:
                self.call(lambda _c: None).result(timeout)
            except TimeoutError:
                pass

    def close(self, timeout: float = 60) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)


class _RetryLocked:
    """The client, each of whose calls is retried while SQLite reports the database locked (the
    driver, tune trials and rank 0 may write at the same moment). Per call, not per queued function:
    a function that creates a run and then logs to it must not create a second run on a retry."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            for attempt in range(3):
                try:
                    return attr(*args, **kwargs)
                except Exception as e:
                    if "database is locked" not in str(e) or attempt == 2:
                        raise
                    time.sleep(0.5 * (attempt + 1))

        return call


def now_ms() -> int:
    return int(time.time() * 1000)


# Per-epoch metrics a run logs (step = epoch), when the epoch's metrics have them.
EPOCH_METRICS = ("train_loss", "val_f1", "val_accuracy", "val_loss", "val_perplexity", "samples_per_s",
                 "tokens_per_s", "epoch_seconds", "val_seconds", "data_wait_seconds", "checkpoint_seconds", "lr",
                 "mfu")


def epoch_metrics(metrics: dict, step_losses: list[float] | None, step_loss_every: int) -> list[tuple[str, float, int]]:
    """(key, value, step) of one epoch: the EPOCH_METRICS at step=epoch, and every `step_loss_every`-th
    optimizer step's loss (all ranks averaged) as train_step_loss at its global step."""
    epoch = int(metrics["epoch"])
    out = [(k, float(metrics[k]), epoch) for k in EPOCH_METRICS
           if isinstance(metrics.get(k), int | float) and metrics.get(k) is not None]
    losses = step_losses or []
    first = int(metrics.get("global_step", len(losses))) - len(losses)  # global step before this epoch
    out += [("train_step_loss", float(loss), first + i + 1) for i, loss in enumerate(losses)
            if (first + i + 1) % step_loss_every == 0]
    return out


class RunLogger:
    """Logging from a process where the numbers are (rank 0 of a Train run, a Tune trial): into the
    run of `spec`, or, with `child`, into a new child run of it that this process creates (a trial)."""

    def __init__(self, spec: TrackingSpec, warn: Warn | None = None, child: dict[str, Any] | None = None):
        self.spec = spec
        self.run_id: str | None = spec.run_id
        self.tracker = Tracker(spec.uri, warn)
        if child is not None:
            self.run_id = None
            self.tracker.call(lambda c: self._create(c, **child))

    def _create(self, client, name: str, tags: dict[str, Any], params: dict[str, str]) -> None:
        run_tags = {**dict(self.spec.tags), **{k: str(v) for k, v in tags.items() if v is not None},
                    "mlflow.parentRunId": self.spec.run_id}
        run = client.create_run(self.spec.experiment_id, start_time=now_ms(), tags=run_tags, run_name=name)
        self.run_id = run.info.run_id
        log_params(client, self.run_id, params)

    def child_spec(self, timeout: float = 120) -> TrackingSpec | None:
        """For rank 0 of a Train run to log into the child run (waits for its creation)."""
        self.tracker.flush(timeout)
        if self.tracker.off or self.run_id is None:
            return None
        return TrackingSpec(self.spec.uri, self.run_id, self.spec.experiment_id, self.spec.step_loss_every,
                            self.spec.tags)

    def _id(self) -> str:
        """The run's id, on the tracking thread: a child run was created by the calls before (its
        creation failing turned tracking off, and no later call runs)."""
        if self.run_id is None:
            raise RuntimeError("no MLflow run to log into")
        return self.run_id

    def log_epoch(self, metrics: dict, step_losses: list[float] | None = None) -> None:
        rows = epoch_metrics(metrics, step_losses, self.spec.step_loss_every)
        ts = now_ms()  # when the epoch ended, not when the thread gets to it
        self.tracker.call(lambda c: log_metrics(c, self._id(), rows, ts))

    def end(self, status: str = "FINISHED") -> None:
        self.tracker.call(lambda c: c.set_terminated(self._id(), status, now_ms()))

    def close(self, timeout: float = 60) -> None:
        self.tracker.flush(timeout)
        self.tracker.close(1)


def log_metrics(client, run_id: str, rows: list[tuple[str, float, int]], ts: int) -> None:
    from mlflow.entities import Metric

    metrics = [Metric(k, v, ts, step) for k, v, step in rows]
    for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
        client.log_batch(run_id, metrics=metrics[i:i + 1000])


def log_params(client, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(k, str(v)) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow's limit per batch
        client.log_batch(run_id, params=items[i:i + 100])


def set_tags(client, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items() if v is not None])

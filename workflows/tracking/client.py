"""A fail-soft MLflow client: every call runs on one background thread, in order, so training never
waits on the tracking server.

A call that fails for a reason that may pass (a 5xx or 429, a timeout, a refused connection, a locked
SQLite store, a run its creator has not created yet) is retried with exponential backoff; the calls
queued behind it wait in the queue (nothing is lost) until it goes through. Only a failure that
outlasts `tracking.retry_seconds` turns tracking off in this process, the first contact's included
(a rank 0 or a trial is a new process whose first call may meet an outage): one warning, the calls
not sent are counted, and when the process ends its runs are tagged with the gap
(`workflows.tracking_gap`), whether or not it ever reached the store; the driver then marks every
run of the command that has a gap FAILED and says so in its summary (session.Tracking.close).

MLflow's own asynchronous logging (`log_batch(..., synchronous=False)`) is not used: its queue logs
a batch that fails and drops it, which is the loss this module exists to prevent.

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
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from workflows.tracking.calls import epoch_metrics, find_run, log_metrics, log_params, now_ms, set_tags

Warn = Callable[[str], None]

RUN_KEY_TAG = "workflows.run_key"  # the key a process elsewhere finds a run by before its id is known
GAP_TAG = "workflows.tracking_gap"  # set on a run whose process could not log everything
PERMANENT = ("INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST",
             "INVALID_STATE", "PERMISSION_DENIED", "UNAUTHENTICATED", "ENDPOINT_NOT_FOUND")


@dataclass(frozen=True)
class TrackingSpec:
    """What a process elsewhere on the cluster needs to log into a run (pickled to it). `run_id` may
    be None: the run is then found by `run_key` in `experiment` once its creator has created it, so
    that handing out a spec never waits on the tracking server."""

    uri: str
    run_id: str | None
    experiment_id: str | None
    step_loss_every: int = 10
    tags: tuple[tuple[str, str], ...] = ()  # the driver's run tags that child runs share (git commit, ...)
    run_key: str | None = None
    experiment: str | None = None  # the experiment's name, to find `run_key` in
    retry_seconds: float = 300.0


class RunPending(Exception):
    """The run to log into is not created yet (its creator's calls are still queued): retried."""


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
    # minutes per call against a dead server, and Tracker retries on top. A user's own setting wins.
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


def transient(e: BaseException) -> bool:
    """Whether a failed call may succeed later: the server down, overloaded or restarting, the
    network, a locked SQLite store. MLflow's answers that name a bad request are not; nor is a
    FileNotFoundError (a SQLite store this node lacks)."""
    import requests

    if isinstance(e, RunPending | requests.RequestException | ConnectionError | TimeoutError):
        return True
    if isinstance(e, FileNotFoundError):
        return False
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException):
        return e.error_code not in PERMANENT
    return "database is locked" in str(e)


@dataclass
class Gap:
    """What this process could not log: calls dropped, since when, why."""

    lost: int = 0
    since: float | None = None  # wall time of the first lost call
    error: str = ""
    runs: set[str] = field(default_factory=set)  # runs the lost calls were for, where known

    def describe(self) -> str:
        when = datetime.fromtimestamp(self.since or 0, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"{self.lost} tracking call(s) not logged from {when} ({self.error})"


def _noop(_client) -> None:
    """flush's marker: waits its turn, sends nothing."""


class Tracker:
    """Ordered calls on an MlflowClient in a background thread. `call(fn)` returns a Future of
    fn(client), or of None once tracking is off (or the call was dropped)."""

    def __init__(self, uri: str, warn: Warn | None = None, create: bool = False, retry_seconds: float = 300.0):
        self.uri = uri
        self.off = False
        self.retry_seconds = retry_seconds
        self.gap = Gap()
        self._warn = warn or _stderr_warn
        self._create = create
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._client = None
        self._connected = False
        self._deadline: float | None = None  # set by close: stop retrying then

    def call(self, fn: Callable[[Any], Any], run_id: str | None = None) -> Future:
        fut: Future = Future()
        if self.off:
            if fn is not _noop:
                self._lose(run_id)
            fut.set_result(None)
            return fut
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mlflow-tracking", daemon=True)
                self._thread.start()
        self._queue.put((fn, fut, run_id))
        return fut

    def _lose(self, run_id: str | None, e: BaseException | None = None) -> None:
        if self.gap.since is None:
            self.gap.since = time.time()
        self.gap.lost += 1
        if e is not None and not self.gap.error:
            self.gap.error = one_line(e)
        if run_id:
            self.gap.runs.add(run_id)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut, run_id = item
            if self.off:
                if fn is not _noop:
                    self._lose(run_id)
                fut.set_result(None)
                continue
            fut.set_result(self._attempt(fn, run_id))

    def _attempt(self, fn: Callable[[Any], Any], run_id: str | None) -> Any:
        """fn(client), retried with backoff while its failure may pass and the window lasts."""
        delay, failing_since, warned = 0.5, None, False
        while True:
            started = time.monotonic()  # a failure counts from the start of the call that failed
            try:
                if self._client is None:
                    self._client = self._connect()
                    self._connected = True
                    started = time.monotonic()  # importing MLflow is no part of the window
                result = fn(self._client)
                if warned and failing_since is not None:
                    self._warn(f"experiment tracking is back ({redact_uri(self.uri)}) after "
                               f"{time.monotonic() - failing_since:.0f}s; the buffered calls are being sent")
                return result
            except Exception as e:
                if not transient(e):
                    if not self._connected:  # a store that cannot be used at all: off at once
                        self.fail(e, run_id)
                    else:  # one bad call: dropped, the rest go on
                        self._lose(run_id, e)
                        self._warn(f"experiment tracking: a call failed and was dropped ({one_line(e)})")
                    return None
                now = time.monotonic()
                failing_since = failing_since if failing_since is not None else started
                window = self.retry_seconds  # the first contact's too: an outage then is a blip as well
                if now - failing_since >= window or (self._deadline is not None and now >= self._deadline):
                    self.fail(e, run_id)
                    return None
                # waiting for a run's creator is no failure
                if not warned and self._connected and not isinstance(e, RunPending):
                    warned = True
                    self._warn(f"experiment tracking is failing ({redact_uri(self.uri)}: {one_line(e)}); "
                               f"retrying for up to {self.retry_seconds:.0f}s, metrics are buffered meanwhile")
                time.sleep(min(delay, max(0.05, window - (now - failing_since))))
                delay = min(delay * 2, 10.0)

    def _connect(self):
        _http_defaults()
        check_reachable(self.uri, self._create)
        from mlflow import MlflowClient

        # MLflow's SQLite store logs its table creation and migrations at INFO on the terminal;
        # the platform's terminal shows its own lines only
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        return _RetryLocked(MlflowClient(tracking_uri=self.uri, registry_uri=self.uri))

    def fail(self, e: BaseException, run_id: str | None = None) -> None:
        """Tracking off for this process: one warning; the call and every later one are counted lost."""
        self._lose(run_id, e)
        if not self.off:
            self.off = True
            self._warn(f"experiment tracking is off for this process ({redact_uri(self.uri)}: {one_line(e)}); "
                       "the run goes on, its metrics stay in the run summaries")

    def flush(self, timeout: float = 60) -> None:
        """Wait until what was queued so far has been sent (or `timeout`)."""
        if self._thread is not None and self._thread.is_alive():
            try:
                self.call(_noop).result(timeout)
            except TimeoutError:
                pass

    def close(self, timeout: float = 60) -> None:
        """Send what is queued, retrying for at most `timeout` more seconds; what is left then is lost."""
        self._deadline = time.monotonic() + timeout
        self.flush(timeout + 5)
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(5)
        while True:  # whatever the thread did not get to
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                if item[0] is not _noop:
                    self._lose(item[2])
                item[1].set_result(None)
        if self.gap.lost:
            self.off = True

    def record_gap(self, runs: list[str] | Callable[[Any], list[str]], status: str | None = None) -> bool:
        """After close: tag `runs` (or the runs `runs(client)` names) with the gap, and set `status`
        (e.g. FAILED), on a fresh client, one try: the store may be back by now, also where this
        process never reached it. Returns whether it worked."""
        if not self.gap.lost or (isinstance(runs, list) and not runs):
            return True
        try:
            client = self._connect()
            for run_id in runs if isinstance(runs, list) else runs(client):
                client.set_tag(run_id, GAP_TAG, self.gap.describe())
                if status is not None:
                    client.set_terminated(run_id, status, now_ms())
            return True
        except Exception as e:
            if self._connected or not transient(e):  # a store never reached yet: its one warning said so
                self._warn(f"experiment tracking: could not record the gap on the run(s) ({one_line(e)})")
            return False


class _RetryLocked:
    """The client, each of whose calls is retried at once (briefly) while SQLite reports the
    database locked (the driver, tune trials and rank 0 may write at the same moment); a lock that
    outlasts these goes to Tracker's backoff."""

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


class RunLogger:
    """Logging from a process where the numbers are (rank 0 of a Train run, a Tune trial): into the
    run of `spec`, or, with `child`, into a child run of it that this process creates, or continues
    where a run with the same `child["key"]` tags exists (a retried or resumed trial). A context
    manager: on leaving, a child run ends FINISHED (FAILED on an exception) and what is queued is sent."""

    def __init__(self, spec: TrackingSpec, warn: Warn | None = None, child: dict[str, Any] | None = None):
        self.spec = spec
        self.run_id: str | None = spec.run_id
        self._experiment_id = spec.experiment_id
        self._owns = child is not None
        self._child_key = uuid.uuid4().hex  # a Train run's rank 0 finds the child run by it (child_spec)
        self.tracker = Tracker(spec.uri, warn, retry_seconds=spec.retry_seconds)
        if child is not None:
            self.run_id = None
            self._parent_id: str | None = spec.run_id
            self.tracker.call(lambda c: self._open_child(c, **child))
            self.tracker.call(lambda c: log_params(c, self._id(c), child["params"]))

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._owns:
            self.end("FINISHED" if exc_type is None else "FAILED")
        self.close(timeout=30)

    def _experiment(self, client) -> str:
        if self._experiment_id is None:
            exp = client.get_experiment_by_name(self.spec.experiment)
            if exp is None:
                raise RunPending(f"experiment {self.spec.experiment!r} not created yet")
            self._experiment_id = exp.experiment_id
        return self._experiment_id

    def _spec_run(self, client) -> str:
        """The id of the spec's run, found by its key where the spec was handed out before it existed."""
        if self.spec.run_id is not None:
            return self.spec.run_id
        run = find_run(client, self._experiment(client), {RUN_KEY_TAG: str(self.spec.run_key)})
        if run is None:
            raise RunPending(f"run {self.spec.run_key} not created yet")
        return run.info.run_id

    def _open_child(self, client, name: str, tags: dict[str, Any], params: dict[str, str],
                    key: dict[str, str] | None = None) -> None:
        parent = self._parent_id = self._parent_id or self._spec_run(client)
        exp = self._experiment(client)
        run_tags = {**dict(self.spec.tags), **{k: str(v) for k, v in tags.items() if v is not None},
                    **(key or {}), "mlflow.parentRunId": parent, RUN_KEY_TAG: self._child_key}
        found = find_run(client, exp, key) if key else None
        if found is not None:  # a retried or resumed trial: its run goes on, under this search's run
            self.run_id = found.info.run_id
            client.update_run(self.run_id, status="RUNNING")
            set_tags(client, self.run_id, run_tags)
            return
        self.run_id = client.create_run(exp, start_time=now_ms(), tags=run_tags, run_name=name).info.run_id

    def child_spec(self) -> TrackingSpec | None:
        """For rank 0 of a Train run to log into the child run (found by its key there: no wait)."""
        if self.tracker.off or not self._owns:
            return None
        return TrackingSpec(self.spec.uri, self.run_id, self._experiment_id, self.spec.step_loss_every,
                            self.spec.tags, run_key=self._child_key, experiment=self.spec.experiment,
                            retry_seconds=self.spec.retry_seconds)

    def _id(self, client) -> str:
        """The run's id, on the tracking thread (resolved by key the first time, where needed)."""
        if self.run_id is None:
            if self._owns:  # the child's creation went before; its failure dropped it
                raise RuntimeError("no MLflow run to log into")
            self.run_id = self._spec_run(client)
        return self.run_id

    def log_epoch(self, metrics: dict, step_losses: list[float] | None = None) -> None:
        rows = epoch_metrics(metrics, step_losses, self.spec.step_loss_every)
        ts = now_ms()  # when the epoch ended, not when the thread gets to it
        self.tracker.call(lambda c: log_metrics(c, self._id(c), rows, ts), self.run_id)

    def end(self, status: str = "FINISHED") -> None:
        self.tracker.call(lambda c: c.set_terminated(self._id(c), status, now_ms()), self.run_id)

    def close(self, timeout: float = 60) -> None:
        """Send what is queued (for at most `timeout` s); a gap is tagged on the run."""
        self.tracker.close(timeout)
        if self.tracker.gap.lost:
            self.tracker.record_gap(self._gap_runs)

    def _gap_runs(self, client) -> list[str]:
        """The run to tag with this process's gap: its own, found by key where it never got the id;
        a child run never created leaves the gap on its parent (the driver's run of the stage)."""
        if self.run_id is not None:
            return [self.run_id]
        if self._owns:
            return [self._parent_id or self._spec_run(client)]
        return [self._spec_run(client)]

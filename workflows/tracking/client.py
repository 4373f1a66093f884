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
(rank 0 of a Ray Train run, a Tune trial: tracking.run_logger), which log into a run the driver
created. Reaching the store, and telling a failure that may pass from one that will not, is
tracking.store's.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from workflows.tracking.calls import now_ms
from workflows.tracking.store import RunPending, connect, one_line, redact_uri, transient

Warn = Callable[[str], None]

GAP_TAG = "workflows.tracking_gap"  # set on a run whose process could not log everything


def _stderr_warn(msg: str) -> None:
    print(f"workflows warning: {msg}", file=sys.stderr, flush=True)


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
        return connect(self.uri, self._create)

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

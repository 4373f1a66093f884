"""Logging from the processes where the numbers are (rank 0 of a Ray Train run, a Tune trial) into a
run the driver created, or a child run of it: `TrackingSpec` is what such a process is handed, and
`RunLogger` logs through the fail-soft client (tracking.client.Tracker)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from workflows.tracking.calls import epoch_metrics, find_run, log_metrics, log_params, now_ms, set_tags
from workflows.tracking.client import Tracker, Warn
from workflows.tracking.store import RunPending

RUN_KEY_TAG = "workflows.run_key"  # the key a process elsewhere finds a run by before its id is known


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

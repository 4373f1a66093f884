"""The driver's side of tracking: one experiment, the run tree (a `pipeline` parent run, a child run
per stage and per Tune trial), params, tags and artifacts. Runs are created in the background
(client.Tracker); `Run.spec()` waits for nothing: a worker finds the run by its key.

Artifacts go to the run's artifact location, which this experiment puts on the configured object
store under <storage.root>/mlflow/<experiment>/ (the embedded endpoint included); they are written
through the workflows storage layer, so no second set of S3 settings is needed.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from workflows.storage.atomic import atomic_write
from workflows.tracking.calls import log_metrics, log_params, now_ms, set_tags
from workflows.tracking.client import GAP_TAG, Tracker, Warn
from workflows.tracking.run_logger import RUN_KEY_TAG, TrackingSpec
from workflows.tracking.store import one_line, redact_uri, resolve_uri

SECRET = ("secret", "password", "passwd", "token", "credential", "api_key", "access_key", "private_key")


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def secret_key(key: str) -> bool:
    """A config key whose value may be a secret: one of SECRET among its _-separated words (so
    `auth_token` is one and `tokenizer` is not); a key ending in _env names an environment variable."""
    leaf = key.rsplit(".", 1)[-1].lower()
    return not leaf.endswith("_env") and any(f"_{s}_" in f"_{leaf}_" for s in SECRET)


def config_params(cfg) -> dict[str, str]:
    """The resolved config as MLflow params (train.lr, ...): no values of secret-looking keys, no
    user:password@ in URIs."""
    params = {}
    for key, value in flatten(cfg.model_dump(mode="json")).items():
        if secret_key(key):
            continue
        text = redact_uri(str(value)) if isinstance(value, str) else str(value)
        params[key] = text[:6000]  # MLflow's limit on a param's value
    return params


@functools.cache
def git_commit() -> str | None:
    """The commit of the code that runs, when known: WORKFLOWS_GIT_COMMIT, else git in the working dir."""
    if os.environ.get("WORKFLOWS_GIT_COMMIT"):
        return os.environ["WORKFLOWS_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def ray_job_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_job_id() if ray.is_initialized() else None
    except Exception:
        return None


class Run:
    """One MLflow run created by the driver; every method queues its call and returns at once."""

    def __init__(self, session: Tracking | None, run: Future | None, key: str | None = None):
        self._s = session
        self._run = run  # Future of the mlflow RunInfo (None when tracking is off)
        self.key = key  # its RUN_KEY_TAG: how a worker finds it before its id is known here

    def call(self, fn) -> Future | None:
        """fn(client, run info) queued on the tracker once the run is created; None when tracking is off."""
        if self._s is None or self._run is None:
            return None

        def go(client):
            info = self._run.result()  # created earlier on this same thread
            return None if info is None else fn(client, info)
        return self._s.tracker.call(go)

    @property
    def id(self) -> str | None:
        """The run id (waits for the run's creation)."""
        info = self.info()
        return info.run_id if info is not None else None

    def info(self, timeout: float | None = None):
        """The mlflow RunInfo once created (waits up to `timeout`); None when tracking is off or it
        is not created by then."""
        if self._run is None:
            return None
        try:
            return self._run.result(timeout)
        except TimeoutError:
            return None

    @property
    def active(self) -> bool:
        """Whether calls reach MLflow: a run was created and its session's tracker has not turned off."""
        return self._run is not None and self._s is not None and not self._s.tracker.off

    def spec(self) -> TrackingSpec | None:
        """For a worker to log into this run, at once (no wait on the store): with the run's id
        if it is created already, else its key, by which the worker finds it. None when tracking is off."""
        if not self.active:
            return None
        assert self._run is not None and self._s is not None
        info = self._run.result() if self._run.done() else None
        s = self._s
        return TrackingSpec(s.uri, info.run_id if info else None, info.experiment_id if info else None,
                            s.cfg.tracking.step_loss_every, tuple(s.shared_tags().items()), run_key=self.key,
                            experiment=s.experiment_name, retry_seconds=s.cfg.tracking.retry_seconds)

    def log_params(self, params: dict[str, Any]) -> None:
        params = dict(params)  # as it is now: the call runs later, on the tracking thread
        self.call(lambda c, info: log_params(c, info.run_id, params))

    def log_metrics(self, metrics: dict[str, Any], step: int = 0) -> None:
        rows = [(k, float(v), step) for k, v in metrics.items() if isinstance(v, int | float) and v is not None]
        ts = now_ms()
        self.call(lambda c, info: log_metrics(c, info.run_id, rows, ts))

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.call(lambda c, info: set_tags(c, info.run_id, tags))

    def log_files(self, files: Sequence[Path | str | None], subdir: str = "") -> None:
        """Upload the files that exist (None and missing paths skipped) as artifacts of the run."""
        session = self._s
        if session is None:
            return
        paths = [Path(f) for f in files if f is not None and Path(f).is_file()]
        self.call(lambda c, info: session.upload(c, info, paths, subdir))

    def end(self, status: str = "FINISHED") -> None:
        self.call(lambda c, info: c.set_terminated(info.run_id, status, now_ms()))


class Tracking:
    """A command's tracking: its experiment and runs. With tracking.enabled=false every run is inert."""

    def __init__(self, cfg, storage, warn: Warn | None = None):
        self.cfg = cfg
        self.storage = storage
        self.uri = resolve_uri(cfg)
        self.experiment_name = cfg.tracking.experiment or cfg.name
        self.tracker = Tracker(self.uri, warn, create=True, retry_seconds=cfg.tracking.retry_seconds)
        self.command_id = uuid.uuid4().hex  # tags every run of this command, the trials' included
        self.runs: list[Run] = []
        self._warn = self.tracker._warn
        self.parent: Run | None = None
        self.dataset_version: str | None = None
        if not cfg.tracking.enabled:
            self.tracker.off = True
        # started now: importing MLflow and opening the store overlap with Ray's start
        self._experiment = self.tracker.call(self._get_experiment)

    def _get_experiment(self, client) -> str:
        exp = client.get_experiment_by_name(self.experiment_name)
        if exp is None:
            try:
                return client.create_experiment(self.experiment_name,
                                                artifact_location=self.cfg.uri("mlflow", self.experiment_name))
            except Exception as e:  # another command created it meanwhile
                exp = client.get_experiment_by_name(self.experiment_name)
                if exp is None:
                    raise e from None
        return exp.experiment_id

    def shared_tags(self) -> dict[str, str]:
        """Tags of every run of the command, the runs other processes create (trials) included."""
        tags = {"workflows.config": self.cfg.name, "workflows.command_id": self.command_id,
                "mlflow.source.git.commit": git_commit(),
                "ray.job_id": ray_job_id(), "dataset.version": self.dataset_version}
        return {k: str(v) for k, v in tags.items() if v is not None}

    def start(self, name: str, parent: Run | None = None, tags: dict[str, Any] | None = None) -> Run:
        """A new run named `name`: a child of `parent`, else of the command's pipeline run, if any."""
        parent = parent if parent is not None else self.parent
        key = uuid.uuid4().hex
        base = {"workflows.stage": name, **self.shared_tags(), **(tags or {}), RUN_KEY_TAG: key}

        def create(client):
            exp = self._experiment.result()
            if exp is None:
                return None
            run_tags = {k: str(v) for k, v in base.items() if v is not None}
            parent_info = parent._run.result() if parent is not None and parent._run is not None else None
            if parent_info is not None:
                run_tags["mlflow.parentRunId"] = parent_info.run_id
            return client.create_run(exp, start_time=now_ms(), tags=run_tags, run_name=name).info
        run = Run(self, self.tracker.call(create), key)
        self.runs.append(run)
        return run

    @contextmanager
    def stage(self, name: str, cfg=None, parent: Run | None = None) -> Iterator[Run]:
        """A run for the block, with `cfg` (default: the command's) as params: FINISHED when the block
        ends, FAILED on an exception (which goes on)."""
        run = self.start(name, parent=parent)
        run.log_params(config_params(cfg or self.cfg))
        try:
            yield run
        except BaseException:
            run.end("FAILED")
            raise
        run.end("FINISHED")

    def upload(self, client, info, files: list[Path], subdir: str) -> None:
        """Files into the run's artifact location: through the storage layer for s3:// and local
        locations (the configured object store), else through MLflow (a server's proxied store)."""
        from workflows.storage.uri import filesystem, join, protocol_of

        root = info.artifact_uri
        if protocol_of(root) in ("s3", "s3a", "file") and not root.startswith("mlflow-artifacts:"):
            fs, _ = filesystem(root, self.storage)
            for f in files:
                target = filesystem(join(root, subdir, f.name) if subdir else join(root, f.name), self.storage)[1]
                if protocol_of(root) == "file":
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                fs.put_file(str(f), target)
        else:
            for f in files:
                client.log_artifact(info.run_id, str(f), subdir or None)

    def set_dataset(self, version: str) -> None:
        """Tag the pipeline run and every run started from now on with the dataset version."""
        self.dataset_version = version
        if self.parent is not None:
            self.parent.set_tags({"dataset.version": version})

    def close(self, timeout: float = 60) -> dict | None:
        """Send what is queued (retrying for at most `timeout` s). Then every run of the command that
        has a gap (this process's, or one a worker tagged) is marked FAILED, and the outcome goes to
        <output_dir>/<name>/tracking.json and, where something is missing, to a warning."""
        if not self.cfg.tracking.enabled:
            return None
        self.tracker.close(timeout)
        gap = self.tracker.gap
        created = [info.run_id for r in self.runs if (info := r.info(0)) is not None]
        gaps: dict[str, str] = {}
        if gap.lost:
            if self.tracker.record_gap(created, status="FAILED"):
                gaps = {run_id: gap.describe() for run_id in created}
        elif created:
            gaps = self._worker_gaps()
        report = {"uri": redact_uri(self.uri), "complete": not gap.lost and not gaps, "lost_calls": gap.lost,
                  "error": gap.error or None, "runs_with_gaps": gaps}
        if not report["complete"] and self.tracker._connected:  # never reached: its one warning said so
            what = gap.describe() if gap.lost else f"{len(gaps)} run(s) of this command have gaps"
            self._warn(f"experiment tracking incomplete: {what}; the run(s) are marked FAILED "
                       f"(tag {GAP_TAG}) where the store could be reached")

        out = Path(self.cfg.output_dir) / self.cfg.name
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "tracking.json", json.dumps(report, indent=2))
        return report

    def _worker_gaps(self) -> dict[str, str]:
        """The runs of this command that a worker tagged with a gap, now marked FAILED."""
        client = self.tracker._client
        exp = self._experiment.result() if self._experiment.done() else None
        if client is None or exp is None:
            return {}
        try:
            found = client.search_runs([exp], f"tags.`workflows.command_id` = '{self.command_id}' "
                                              f"and tags.`{GAP_TAG}` LIKE '%'", max_results=1000)
            for r in found:
                client.set_terminated(r.info.run_id, "FAILED", r.info.end_time or now_ms())
            return {r.info.run_id: r.data.tags[GAP_TAG] for r in found}
        except Exception as e:
            self._warn(f"experiment tracking: could not check the runs for gaps ({one_line(e)})")
            return {}

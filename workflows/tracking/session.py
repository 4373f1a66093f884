"""The driver's side of tracking: one experiment, the run tree (a `pipeline` parent run, a child run
per stage and per Tune trial), params, tags and artifacts. Runs are created in the background
(client.Tracker); `Run.spec()` waits for a run's id only where a worker needs it.

Artifacts go to the run's artifact location, which this experiment puts on the configured object
store under <storage.root>/mlflow/<experiment>/ (the embedded endpoint included); they are written
through the workflows storage layer, so no second set of S3 settings is needed.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from workflows.tracking.client import (
    Tracker,
    TrackingSpec,
    Warn,
    log_metrics,
    log_params,
    now_ms,
    redact_uri,
    resolve_uri,
    set_tags,
)

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

    def __init__(self, session: Tracking | None, run: Future | None):
        self._s = session
        self._run = run  # Future of the mlflow RunInfo (None when tracking is off)

    def _call(self, fn) -> Future | None:
        if self._s is None or self._run is None:
            return None

        def go(client):
            info = self._run.result()  # created earlier on this same thread
            return None if info is None else fn(client, info)
        return self._s.tracker.call(go)

    @property
    def id(self) -> str | None:
        """The run id (waits for the run's creation)."""
        info = self._run.result() if self._run is not None else None
        return info.run_id if info is not None else None

    def spec(self) -> TrackingSpec | None:
        """For a worker to log into this run; None when tracking is off."""
        info = self._run.result() if self._run is not None else None
        if info is None or self._s is None or self._s.tracker.off:
            return None
        return TrackingSpec(self._s.uri, info.run_id, info.experiment_id, self._s.cfg.tracking.step_loss_every,
                            tuple(self._s.shared_tags().items()))

    def log_params(self, params: dict[str, Any]) -> None:
        params = dict(params)  # as it is now: the call runs later, on the tracking thread
        self._call(lambda c, info: log_params(c, info.run_id, params))

    def log_metrics(self, metrics: dict[str, Any], step: int = 0) -> None:
        rows = [(k, float(v), step) for k, v in metrics.items() if isinstance(v, int | float) and v is not None]
        ts = now_ms()
        self._call(lambda c, info: log_metrics(c, info.run_id, rows, ts))

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._call(lambda c, info: set_tags(c, info.run_id, tags))

    def log_files(self, files: Sequence[Path | str | None], subdir: str = "") -> None:
        """Upload the files that exist (None and missing paths skipped) as artifacts of the run."""
        session = self._s
        if session is None:
            return
        paths = [Path(f) for f in files if f is not None and Path(f).is_file()]
        self._call(lambda c, info: session.upload(c, info, paths, subdir))

    def end(self, status: str = "FINISHED") -> None:
        self._call(lambda c, info: c.set_terminated(info.run_id, status, now_ms()))


class Tracking:
    """A command's tracking: its experiment and runs. With tracking.enabled=false every run is inert."""

    def __init__(self, cfg, storage, warn: Warn | None = None):
        self.cfg = cfg
        self.storage = storage
        self.uri = resolve_uri(cfg)
        self.experiment_name = cfg.tracking.experiment or cfg.name
        self.tracker = Tracker(self.uri, warn, create=True)
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
        tags = {"workflows.config": self.cfg.name, "mlflow.source.git.commit": git_commit(),
                "ray.job_id": ray_job_id(), "dataset.version": self.dataset_version}
        return {k: str(v) for k, v in tags.items() if v is not None}

    def start(self, name: str, parent: Run | None = None, tags: dict[str, Any] | None = None) -> Run:
        """A new run named `name`: a child of `parent`, else of the command's pipeline run, if any."""
        parent = parent if parent is not None else self.parent
        base = {"workflows.stage": name, **self.shared_tags(), **(tags or {})}

        def create(client):
            exp = self._experiment.result()
            if exp is None:
                return None
            run_tags = {k: str(v) for k, v in base.items() if v is not None}
            parent_info = parent._run.result() if parent is not None and parent._run is not None else None
            if parent_info is not None:
                run_tags["mlflow.parentRunId"] = parent_info.run_id
            return client.create_run(exp, start_time=now_ms(), tags=run_tags, run_name=name).info
        return Run(self, self.tracker.call(create))

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

    def close(self, timeout: float = 60) -> None:
        self.tracker.flush(timeout)
        self.tracker.close(1)

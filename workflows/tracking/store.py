"""The tracking store as this process reaches it: its URI (`resolve_uri`, and `redact_uri` for what
is shown), whether it can be used from here (`check_reachable`), the MLflow client on it (`connect`),
and which of its failures may pass (`transient`), so that the fail-soft client (tracking.client)
retries those and drops the rest."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

PERMANENT = ("INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST",
             "INVALID_STATE", "PERMISSION_DENIED", "UNAUTHENTICATED", "ENDPOINT_NOT_FOUND")


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


def http_defaults() -> None:
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


def connect(uri: str, create: bool):
    """An MlflowClient on `uri` (tracking and model registry), once the store is reachable, each of
    whose calls is retried briefly while SQLite reports the database locked (RetryLocked)."""
    http_defaults()
    check_reachable(uri, create)
    from mlflow import MlflowClient

    # MLflow's SQLite store logs its table creation and migrations at INFO on the terminal;
    # the platform's terminal shows its own lines only
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return RetryLocked(MlflowClient(tracking_uri=uri, registry_uri=uri))


class RetryLocked:
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

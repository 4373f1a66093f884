"""MLflow's model registry as a mirror of the bucket's: each registered version becomes a model version
of the registered model of the same name (source: the version's URI in the store, run: the training
run, tag `workflows.version`), and the aliases the promotion gate or `workflows models alias` moves
are set there too, so MLflow's UI shows `@production` on the version that holds it. The bucket stays
the registry (`workflows serve` reads it); MLflow's numbering may differ from ours (a version
registered with tracking off has no MLflow twin until an alias names it), hence the tag. Every call
goes through the fail-soft Tracker: an MLflow outage never fails a registration or a move."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workflows.tracking.client import Tracker
from workflows.tracking.store import http_defaults, resolve_uri

VERSION_TAG = "workflows.version"


def _exists_already(e: Exception) -> bool:
    return getattr(e, "error_code", None) == "RESOURCE_ALREADY_EXISTS"


def mlflow_version(client, name: str, version: int) -> str | None:
    """The MLflow model version that mirrors our `version` of `name`, if any."""
    for mv in client.search_model_versions(f"name='{name}'"):
        if (mv.tags or {}).get(VERSION_TAG) == str(version):
            return mv.version
    return None


def ensure_version(client, name: str, version: int, uri: str, run_id: str | None = None,
                   tags: dict[str, Any] | None = None) -> str:
    """The MLflow model version of our `version`, created (with its registered model) when missing."""
    try:
        client.create_registered_model(name, description="mirrors the workflows registry in the bucket; "
                                       "tag workflows.version is the bucket's version")
    except Exception as e:
        if not _exists_already(e):
            raise
    found = mlflow_version(client, name, version)
    if found is not None:
        return found
    all_tags = {VERSION_TAG: str(version), **{k: str(v) for k, v in (tags or {}).items() if v is not None}}
    return client.create_model_version(name, source=uri, run_id=run_id, tags=all_tags).version


def set_alias(client, name: str, alias: str, version: int | None, uri: str | None = None) -> None:
    """MLflow's alias `alias` of `name` on the mirror of our `version`; None removes it."""
    if version is None:
        try:
            client.delete_registered_model_alias(name, alias)
        except Exception as e:
            if getattr(e, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                raise
        return
    mv = mlflow_version(client, name, version)
    if mv is None:
        assert uri is not None, "a version without an MLflow twin needs its URI"
        mv = ensure_version(client, name, version, uri)
    client.set_registered_model_alias(name, alias, mv)


def sync_alias(cfg, name: str, alias: str, version: int | None, uri: str | None, warn=None) -> bool | None:
    """For a command without a tracking session (`workflows models alias`): the alias set in the
    config's MLflow store, where tracking is on and the store exists; True once done, None when
    there is nothing to mirror to."""
    if not cfg.tracking.enabled:
        return None
    store = resolve_uri(cfg)
    if store.startswith("sqlite:") and not Path(store.split(":///", 1)[-1]).exists():
        return None  # nothing tracked with this config: no registered model to mirror into
    http_defaults()
    tracker = Tracker(store, warn, retry_seconds=min(cfg.tracking.retry_seconds, 30.0))
    def call(client) -> bool:
        set_alias(client, name, alias, version, uri)
        return True

    done = tracker.call(call)
    tracker.close(30)
    return bool(done.result()) if done.done() else False

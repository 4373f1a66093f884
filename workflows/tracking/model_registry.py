"""MLflow's model registry as a mirror of the bucket's: each registered version becomes a model version
of the registered model of the same name (source: the version's URI in the store, run: the training
run, tag `workflows.version`), and every move of an alias (registry.move_alias: the promotion gate,
`workflows models alias`, the bench's rollout) is set there too, so MLflow's UI shows `@production`
on the version that holds it. The bucket stays the registry (`workflows serve` reads it); MLflow's
numbering may differ from ours (a version registered with tracking off has no MLflow twin until an
alias names it), hence the tag. Every call goes through the fail-soft Tracker: an MLflow outage never
fails a registration or a move."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workflows import console
from workflows.tracking.client import Tracker, Warn
from workflows.tracking.store import http_defaults, redact_uri, resolve_uri

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


def mirror_alias(cfg, name: str, alias: str, version: int | None, uri: str | None, tracker: Tracker | None = None,
                 warn: Warn | None = None) -> None:
    """MLflow's alias `alias` of `name` set as the bucket's newest record has it, where tracking is on
    (`uri`: the version's, for a twin to be created from). On `tracker`, a tracking session's (the
    promotion gate, the bench), the call queues behind the session's own, the registration's twin
    among them, and is sent with them. A command without a session (`workflows models alias`) opens
    the store for it, where the store exists, and waits for it (at most 30 s): one that could not be
    sent is said through `warn`."""
    if not cfg.tracking.enabled:
        return
    if tracker is not None:
        tracker.call(lambda client: set_alias(client, name, alias, version, uri))
        return
    store = resolve_uri(cfg)
    if store.startswith("sqlite:") and not Path(store.split(":///", 1)[-1]).exists():
        return  # nothing tracked with this config: no registered model to mirror into
    http_defaults()
    own = Tracker(store, warn, retry_seconds=min(cfg.tracking.retry_seconds, 30.0))

    def call(client) -> bool:
        set_alias(client, name, alias, version, uri)
        return True

    done = own.call(call)
    own.close(30)
    if not (done.done() and done.result()):
        (warn or console.warn)(f"{name}@{alias} is not set in MLflow's registry ({redact_uri(store)}); "
                               "moving the alias again sets it there")

"""Rows measured elsewhere, reported from their results files (never re-typed, never invented).

- serve_load, serve_replica_kill: `workflows bench serve` writes benchmarks/results/serve.json with
  `load_10k` (10,000 requests at concurrency 64) and `replica_kill` (one of 2 replicas SIGKILLed
  mid-load). Read from there, with the file's command and date.
- serve_rolling_update: the same file's `rolling_update` (a new model version deployed to the
  application while 2 replicas serve the old one under load).
"""

from __future__ import annotations

import json
from pathlib import Path

from reliability import make_row

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
NOT_MEASURED = "not measured in this run"


def _load(name: str) -> dict | None:
    path = RESULTS / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _source(doc: dict, file: str, key: str) -> str:
    return f"from benchmarks/results/{file} `{key}` (`{doc.get('command', '?')}`, {doc.get('measured_at', 'undated')})"


def _absent(name: str, why: str) -> dict:
    return make_row(name, injected=None, survived=None, failed=None, allowed_failures=None, lost=None,
                    detail=f"{NOT_MEASURED}: {why}", measured=False)


def serve_load(workdir: Path | None = None, seed: int = 0) -> dict:
    doc = _load("serve.json") or {}
    load = doc.get("load_10k")
    if not load:
        return _absent("serve_load", "benchmarks/results/serve.json has no `load_10k`; run `workflows bench serve` "
                                     "(needs a registered model: `make demo`)")
    errors = int(load.get("errors", 0))
    return make_row(
        "serve_load",
        injected=int(load["requests"]),
        survived=int(load.get("ok", load["requests"] - errors)),
        failed=errors,
        allowed_failures=0,
        lost=0,
        detail=f"{load['requests']} requests at concurrency {load.get('concurrency')}: {errors} errors "
        f"{load.get('error_kinds') or ''}, {load.get('rps')} req/s, p99 {load.get('p99_ms')} ms; "
        + _source(doc, "serve.json", "load_10k"),
        measured=True,
        measured_at=doc.get("measured_at"),
        source="benchmarks/results/serve.json",
    )


def serve_replica_kill(workdir: Path | None = None, seed: int = 0) -> dict:
    doc = _load("serve.json") or {}
    kill = doc.get("replica_kill")
    if not kill:
        return _absent(
            "serve_replica_kill", "benchmarks/results/serve.json has no `replica_kill`; run `workflows bench serve`"
        )
    requests, failed = int(kill["requests"]), int(kill["failed"])
    allowed = int(requests * 0.01)  # the benchmark's goal: < 1% failed
    recovery = kill.get("recovery_s")
    return make_row(
        "serve_replica_kill",
        injected=1,
        survived=requests - failed,
        failed=failed,
        allowed_failures=allowed,
        lost=0,
        detail=f"one of 2 replicas SIGKILLed under {requests} requests at concurrency 64: {failed} failed "
        f"({kill.get('failed_after_kill')} after the kill; {kill.get('error_kinds') or {}}), replica "
        f"replaced after {recovery if recovery is not None else 'never (within 120 s)'} s; allowed: "
        f"< 1% failed; " + _source(doc, "serve.json", "replica_kill"),
        measured=True,
        measured_at=doc.get("measured_at"),
        source="benchmarks/results/serve.json",
    )


def serve_rolling_update(workdir: Path | None = None, seed: int = 0) -> dict:
    doc = _load("serve.json") or {}
    u = doc.get("rolling_update")
    if not u:
        return _absent(
            "serve_rolling_update", "benchmarks/results/serve.json has no `rolling_update`; run `workflows bench serve`"
        )
    requests, failed = int(u["requests"]), int(u["failed"])
    # a rollout that never switched lost the new version: counted as a failed rollout
    failed_rollout = 0 if u.get("switched") else 1
    return make_row(
        "serve_rolling_update",
        injected=1,
        survived=requests - failed,
        failed=failed + failed_rollout,
        allowed_failures=0,
        lost=0,
        detail=f"v{u.get('to_version')} deployed over v{u.get('from_version')} (2 replicas) "
        f"under {requests} requests at concurrency {u.get('concurrency')}: {failed} failed "
        f"{u.get('error_kinds') or ''}; answered by {u['answered_by']}; first answer of the new "
        f"version {u.get('first_new_version_s')} s after the deploy began, last of the old one "
        f"{u.get('last_old_version_s')} s; " + _source(doc, "serve.json", "rolling_update"),
        measured=True,
        measured_at=doc.get("measured_at"),
        source="benchmarks/results/serve.json",
    )

"""Fault injection: what the platform does when processes die, the object store misbehaves or
goes away, and clients send garbage. `python -m reliability [--fast]` (`make reliability`)
runs the rows below and writes benchmarks/results/reliability.json and docs/RELIABILITY.md.

Every row is a function `row(workdir: Path, seed: int) -> dict` returning
    {"name", "injected", "survived", "failed", "allowed_failures", "lost", "detail", ...}
where `injected` counts the faults injected, `survived` the operations (or faults) that ended
correctly, `failed` the ones that ended in an error they should not have, `allowed_failures` how
many of those the row tolerates, and `lost` the operations that returned or left WRONG data
(corrupt reads, partial files, leaked secrets): lost must always be 0.

Rows marked fast run in `make test` (tests/test_reliability.py) as well.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: the rows run its configs and commands


@dataclass(frozen=True)
class RowSpec:
    name: str
    module: str
    fast: bool
    summary: str
    recorded: bool = False  # read from another results file: cheap, so `--fast` reports it too


ROWS: list[RowSpec] = [
    RowSpec(
        "cache_download_kill",
        "reliability.cache_kill",
        True,
        "SIGKILL a process at random points of shard downloads into the shard cache; every later read is exact",
    ),
    RowSpec(
        "object_store_faults",
        "reliability.object_store_faults",
        True,
        "503 SlowDown, slow responses and connection resets from a proxy in front of the S3 endpoint; "
        "the full run preprocesses and trains through it",
    ),
    RowSpec(
        "object_store_outage",
        "reliability.object_store_outage",
        True,
        "the endpoint goes away: clear errors in bounded time, nothing half-written",
    ),
    RowSpec(
        "secrets_hygiene",
        "reliability.secrets",
        True,
        "credentials in the environment never reach logs, summaries, the store or the cache; "
        "safe weight loading; path-safe names; bearer-token checks; Ray token auth for job submission (full run)",
    ),
    RowSpec(
        "store_hostile_objects",
        "reliability.store_hostile",
        True,
        "the hostile-store corpus: every object the platform reads back from the store (cards, manifests, LoRA "
        "adapters, tokenizer configs, checkpoints, search state, a version's evaluation and promotion records, "
        "alias records), each field it reads set to an escaping path, a foreign URI, an absolute path, a huge "
        "value and a wrong type, each record forged, unsigned, another key's or copied from elsewhere, each file "
        "of a signed version changed, added or removed: each refused in one line, nothing read, written or "
        "requested outside what the config allows, the serving predictor answering as before",
    ),
    RowSpec(
        "serve_hostile_inputs",
        "reliability.serve_hostile",
        False,
        "hostile HTTP requests to the Ray Serve app: every malformed body, header, auth, size and smuggling case "
        "is answered 4xx with a message, and it keeps serving; the ingress may read an unknown HTTP version as "
        "HTTP/1.1 (named as accepted ingress behaviour)",
    ),
    RowSpec(
        "serve_hostile_images",
        "reliability.serve_hostile_images",
        False,
        "hostile images (bombs, truncated, not images, bad base64, broken multipart, oversized bodies) sent "
        "several times to a served digits model between valid requests: 4xx with a one-line message, right "
        "labels for the valid ones, the same replica serving throughout",
    ),
    RowSpec(
        "serve_openapi_fuzz",
        "reliability.serve_openapi",
        False,
        "schemathesis (--checks all, 5 minutes) generates requests from the /openapi.json of a served text model "
        "and of an image model (JSON base64, raw and multipart bodies), with and without the token: no 5xx, every "
        "answer matches the declared status codes, content type and schema, no schema-valid request rejected, no "
        "schema-violating one accepted or answered outside the rejection statuses, except the decided answers no "
        "schema states (413 over the byte limit, 422 for random bytes as an image); POST /predict gets at least a "
        "third of each run's requests",
    ),
    RowSpec(
        "train_worker_kill",
        "reliability.train_kill",
        False,
        "a Ray Train worker SIGKILLed mid-epoch: restarted from the last checkpoint, same losses as without the kill",
    ),
    RowSpec(
        "serve_load",
        "reliability.recorded",
        False,
        "10k requests at concurrency 64 (recorded by `workflows bench serve`)",
        recorded=True,
    ),
    RowSpec(
        "serve_replica_kill",
        "reliability.recorded",
        False,
        "one of 2 Serve replicas SIGKILLed under load (recorded by `workflows bench serve`)",
        recorded=True,
    ),
    RowSpec(
        "serve_rolling_update",
        "reliability.recorded",
        False,
        "a new model version rolled out while 2 replicas serve under load: no request dropped "
        "(recorded by `workflows bench serve`)",
        recorded=True,
    ),
]
BY_NAME = {r.name: r for r in ROWS}


def row_function(name: str):
    spec = BY_NAME[name]
    return getattr(importlib.import_module(spec.module), name)


def make_row(
    name: str,
    *,
    injected: int | None,
    survived: int | None,
    failed: int | None,
    allowed_failures: int | None,
    lost: int | None,
    detail: str,
    **extra,
) -> dict:
    return {
        "name": name,
        "injected": injected,
        "survived": survived,
        "failed": failed,
        "allowed_failures": allowed_failures,
        "lost": lost,
        "detail": detail,
        **extra,
    }


def passed(row: dict) -> bool | None:
    """True/False for a measured row; None for one not measured in this run."""
    if row.get("lost") is None or row.get("failed") is None:
        return None
    return row["lost"] == 0 and row["failed"] <= (row.get("allowed_failures") or 0)


__all__ = ["ROOT", "ROWS", "BY_NAME", "RowSpec", "make_row", "passed", "row_function"]

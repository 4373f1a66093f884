"""What produced a registered version, in one form for its card, MLflow and `workflows models history`:
the data (the processed dataset's version, its source and processed URIs, a content digest, the rows
per split), the config (a digest of the resolved config) and the code (its commit)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from workflows.dataset import ProcessedDataset
from workflows.storage.uri import StorageContext, join, read_json
from workflows.tracking.session import git_commit


def dataset_digest(data: ProcessedDataset, ctx: StorageContext) -> str:
    """A digest of the data a model was trained and evaluated on: the raw shards' identities (URI,
    size and the store's version of each, its ETag: a content hash on S3), the processed files and
    the rows per split, as the dataset's manifest lists them. The same data gives the same digest;
    a changed shard, split or row count gives another, without reading the data again."""
    manifest = read_json(join(data.uri, "manifest.json"), ctx)
    key = {"shards": sorted((s.get("uri"), s.get("size"), s.get("version")) for s in manifest.get("shards") or []),
           "files": manifest.get("files"), "counts": manifest.get("counts"),
           "label_counts": manifest.get("label_counts")}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def dataset_lineage(data: ProcessedDataset, ctx: StorageContext) -> dict[str, Any]:
    return {"version": data.version, "digest": dataset_digest(data, ctx), "source": data.source, "uri": data.uri,
            "rows": dict(data.counts)}


def config_digest(cfg) -> str:
    """A digest of the resolved config (the training's, tuned values applied)."""
    return hashlib.sha256(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


def code_commit() -> str | None:
    return git_commit()


def version_lineage(card) -> dict[str, Any]:
    """(data version, digest, rows, config digest, commit, MLflow run) of a registered version's card,
    what `workflows models history` prints for it."""
    lineage = card.lineage or {}
    data = lineage.get("data") or {}
    return {"data_version": data.get("version") or lineage.get("dataset_version"), "digest": data.get("digest"),
            "rows": data.get("rows"), "config_digest": lineage.get("config_digest"),
            "commit": lineage.get("code_commit"), "run": (getattr(card, "mlflow", None) or {}).get("run_id")}

"""A training checkpoint fetched for export (the register step, workflows.pipeline.stages.export_artifact,
has the config's task write the serving artifact from its consolidated weights)."""

from __future__ import annotations

from workflows.storage.uri import StorageContext, download_dir


def download_checkpoint(uri: str, ctx: StorageContext, local_dir: str) -> str:
    download_dir(uri, ctx, local_dir)
    return local_dir

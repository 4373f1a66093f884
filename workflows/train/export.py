"""A training checkpoint fetched for export (the pipeline's export step, pipeline.export_artifact, has
the config's task write the serving artifact from its consolidated weights)."""

from __future__ import annotations

from workflows.model_card import write_card  # noqa: F401  (its former home)
from workflows.storage.uri import StorageContext, download_dir
from workflows.tasks.text.export import export_text_classifier  # noqa: F401  (the benches import it from here)


def download_checkpoint(uri: str, ctx: StorageContext, local_dir: str) -> str:
    download_dir(uri, ctx, local_dir)
    return local_dir

"""Export a sharded training checkpoint to a consolidated serving artifact (the task writes it)."""

from __future__ import annotations

import tempfile

from workflows.config import WorkflowConfig
from workflows.dataset import ProcessedDataset
from workflows.model_card import write_card  # noqa: F401  (its former home)
from workflows.storage.uri import StorageContext, download_dir
from workflows.tasks.text.export import export_text_classifier  # noqa: F401  (the benches import it from here)
from workflows.train.checkpoint import consolidated_model_state


def download_checkpoint(uri: str, ctx: StorageContext, local_dir: str) -> str:
    download_dir(uri, ctx, local_dir)
    return local_dir


def export_artifact(cfg: WorkflowConfig, ctx: StorageContext, data: ProcessedDataset, checkpoint_uri: str,
                    out_dir: str, lineage: dict) -> dict:
    """The checkpoint's consolidated weights, written by the config's task as its serving artifact
    (safetensors weights, what its predictor needs, workflows.json) into `out_dir`."""
    from workflows.tasks import get_task

    with tempfile.TemporaryDirectory() as tmp:
        state = consolidated_model_state(download_checkpoint(checkpoint_uri, ctx, tmp))
    lineage = {"dataset_version": data.version, "dataset_uri": data.uri, "source": data.source,
               "checkpoint": checkpoint_uri, **lineage}
    return get_task(cfg).export(state, data, out_dir, lineage)

"""Export a sharded training checkpoint to a consolidated serving artifact (the task writes it)."""

from __future__ import annotations

import tempfile

from workflows.config import WorkflowConfig
from workflows.dataset import ProcessedDataset
from workflows.model_card import ModelCard, write_card  # noqa: F401  (write_card: its former home)
from workflows.preprocess.encoding import resolve_model_dir
from workflows.storage.uri import StorageContext, download_dir
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


def export_text_classifier(cfg: WorkflowConfig, state: dict, data: ProcessedDataset, out_dir: str,
                           lineage: dict) -> dict:
    """safetensors weights, model config and tokenizer of a text classifier."""
    from transformers import AutoTokenizer

    from workflows.train.models import load_classifier

    if data.tokenizer is None:
        raise ValueError(f"the processed text dataset at {data.uri} names no tokenizer in its manifest")
    model = load_classifier(resolve_model_dir(cfg.model.name_or_path), data.labels, cfg.model.dropout,
                            cfg.model.pooling)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(resolve_model_dir(data.tokenizer)).save_pretrained(out_dir)
    return write_card(ModelCard(task=cfg.model.task, labels=data.labels, text_columns=data.text_columns,
                                label_column=data.label_column, max_length=data.max_length, lineage=lineage), out_dir)

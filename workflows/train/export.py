"""Export a sharded training checkpoint to a consolidated serving artifact."""

from __future__ import annotations

import json
import os
import tempfile

from workflows.config import WorkflowConfig
from workflows.model_card import ModelCard
from workflows.preprocess.encoding import resolve_model_dir
from workflows.preprocess.materialize import ProcessedDataset
from workflows.storage.uri import StorageContext, download_dir
from workflows.train.checkpoint import consolidated_model_state
from workflows.train.models import load_classifier


def download_checkpoint(uri: str, ctx: StorageContext, local_dir: str) -> str:
    download_dir(uri, ctx, local_dir)
    return local_dir


def export_artifact(cfg: WorkflowConfig, ctx: StorageContext, data: ProcessedDataset, checkpoint_uri: str,
                    out_dir: str, lineage: dict) -> dict:
    """Write safetensors weights, model config, tokenizer and workflows.json into `out_dir`."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        state = consolidated_model_state(download_checkpoint(checkpoint_uri, ctx, tmp))
    model = load_classifier(resolve_model_dir(cfg.model.name_or_path), data.labels, cfg.model.dropout,
                            cfg.model.pooling)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(resolve_model_dir(data.tokenizer)).save_pretrained(out_dir)
    card = ModelCard(
        task="sequence-classification",
        labels=data.labels,
        text_columns=data.text_columns,
        label_column=data.label_column,
        max_length=data.max_length,
        lineage={"dataset_version": data.version, "dataset_uri": data.uri, "source": data.source,
                 "checkpoint": checkpoint_uri, **lineage},
    )
    with open(os.path.join(out_dir, "workflows.json"), "w") as f:
        json.dump(card.to_dict(), f, indent=2)
    # a dict: the pipeline adds the baseline and validation metrics before registering it
    return card.to_dict()

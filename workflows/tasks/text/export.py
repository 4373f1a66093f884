"""The text classifier's serving artifact: safetensors weights, its model config and tokenizer, in
from_pretrained layout, and the card (workflows.json)."""

from __future__ import annotations

from workflows.config import WorkflowConfig
from workflows.dataset import ProcessedDataset
from workflows.model_card import ModelCard, write_card
from workflows.preprocess.encoding import resolve_model_dir
from workflows.tasks.seams import baseline


def export_text_classifier(cfg: WorkflowConfig, state: dict, data: ProcessedDataset, out_dir: str,
                           lineage: dict, options, tokenizer: str) -> dict:
    """safetensors weights, model config and tokenizer (`tokenizer`: the dataset's, checked against the
    config's) of a text classifier (`options`: the task's), and its card with the majority label
    (evaluation's baseline)."""
    from transformers import AutoTokenizer

    from workflows.tasks.text.model import load_classifier

    tokenizer = resolve_model_dir(tokenizer)
    model = load_classifier(resolve_model_dir(cfg.model.name_or_path), data.labels, cfg.model.dropout,
                            options.pooling)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out_dir)
    return write_card(ModelCard(task=cfg.model.task, labels=data.labels, text_columns=data.text_columns,
                                label_column=data.label_column, max_length=data.max_length, lineage=lineage,
                                options=options.model_dump(mode="json"), **baseline(data)), out_dir)

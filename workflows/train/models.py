"""Models: a sequence classifier from a local Hugging Face directory (MiniLM by default)."""

from __future__ import annotations

import torch.nn as nn

from workflows.errors import UserError


def load_classifier(model_dir: str, labels: list[str], dropout: float | None = None) -> nn.Module:
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the "classifier newly initialized" report is expected here
    try:
        config = AutoConfig.from_pretrained(
            model_dir, num_labels=len(labels),
            id2label=dict(enumerate(labels)), label2id={lab: i for i, lab in enumerate(labels)},
        )
    except (OSError, ValueError) as e:
        raise UserError(f"not a model directory: {model_dir} ({e})".splitlines()[0]) from None
    if dropout is not None:
        for attr in ("hidden_dropout_prob", "classifier_dropout", "dropout"):
            if hasattr(config, attr):
                setattr(config, attr, dropout)
    # safetensors weights only, never a pickle
    return AutoModelForSequenceClassification.from_pretrained(model_dir, config=config, use_safetensors=True)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformer (the largest ModuleList of same-typed modules).

    FSDP2 shards each block as its own unit, so only one block's full parameters are gathered at a
    time. Found structurally, so BERT-, GPT- and Llama-style models all work without a table.
    """
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                best = list(module)
    return best

"""The `model` section: the task, its model, and a causal LM's shape.

This module imports no task: `model.task` is checked here for its form only (a built-in's name, or
`module.path:ClassName`); the plug-in's import and its class are checked once the config has loaded,
before anything starts (workflows.tasks.check_task: the CLI's config load, workflows.runtime).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from workflows.config.base import Strict

# the built-in tasks' names (workflows.tasks.BUILTIN maps them to their classes; a test keeps the two alike)
BUILTIN_TASKS = ("classification", "causal_lm", "image_classification", "chat")
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

# GPT-2 family shapes (n_layer, n_embd, n_head) of the causal LM's size presets; "1b" is a GPT-2-style
# 1.2B (24 x 2048)
SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 64, 2),
    "small": (4, 256, 4),
    "gpt2-124m": (12, 768, 12),
    "gpt2-350m": (24, 1024, 16),
    "gpt2-774m": (36, 1280, 20),
    "1b": (24, 2048, 16),
}


def shape(lm_cfg: CausalLMConfig) -> tuple[int, int, int]:
    """(layers, hidden size, heads) of `model.lm`: its preset with the overrides applied."""
    layers, hidden, heads = SIZES[lm_cfg.size]
    return lm_cfg.n_layer or layers, lm_cfg.n_embd or hidden, lm_cfg.n_head or heads


class CausalLMConfig(Strict):
    """A GPT-2-style model built from a size preset, randomly initialized (model.task: causal_lm)."""

    size: Literal["tiny", "small", "gpt2-124m", "gpt2-350m", "gpt2-774m", "1b"] = "gpt2-124m"
    n_layer: int | None = Field(None, ge=1, description="overrides the preset's layers")
    n_embd: int | None = Field(None, ge=8, description="overrides the preset's hidden size")
    n_head: int | None = Field(None, ge=1, description="overrides the preset's attention heads")
    seq_len: int = Field(1024, ge=8, description="tokens per training block (rows are packed into blocks)")


class ModelConfig(Strict):
    task: str = Field(
        "classification",
        description="classification (fine-tune a text classifier), causal_lm (pretrain a causal LM from model.lm), "
        "image_classification, chat (fine-tune a pretrained causal LM on conversations), or a plug-in task by "
        "import path, module.path:ClassName (a workflows.tasks.base.Task)",
    )
    name_or_path: str = Field(
        "minilm",
        description="text: 'minilm' or a local Hugging Face model directory; chat: 'smollm2' (the packaged "
        "SmolLM2-135M-Instruct), a directory or object-store URI in from_pretrained layout, or "
        "registry:NAME[:VERSION]; images: an architecture by name "
        "(small_cnn, resnet18, resnet50, vit_small, convnext_tiny, pooled_linear: a linear classifier over 8x8 "
        "average-pooled pixels; new weights), or a directory or object-store "
        "URI in from_pretrained layout (safetensors) whose weights are fine-tuned on the dataset's labels",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="the task's own settings, validated by its Options model: "
        "the built-ins' are at the end of docs/CONFIG.md, a plug-in's are its own")
    trusted_tasks: list[str] = Field(
        default_factory=list, description="plug-in tasks (module.path:ClassName) that serve, evaluate and predict "
        "may import for a registered model whose card names them; model.task is always trusted. A card naming "
        "any other plug-in is refused: the card comes from the store, and must not choose the code that runs")
    dropout: float | None = Field(None, ge=0.0, lt=1.0)
    pooling: Literal["cls", "mean"] | None = Field(
        None, description="deprecated: the classification task's model.options.pooling (still read)")
    lm: CausalLMConfig = CausalLMConfig()

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        if v in BUILTIN_TASKS or IMPORT_PATH.match(v):
            return v
        raise ValueError(f"unknown task {v!r}: use one of {', '.join(BUILTIN_TASKS)}, or a plug-in as "
                         "module.path:ClassName")

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        _, hidden, heads = shape(self.lm)
        if hidden % heads:
            raise ValueError(f"lm: hidden size {hidden} is not divisible by {heads} heads")
        return self


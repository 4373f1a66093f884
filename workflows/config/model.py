"""The `model` section: the task, its model, and the task's own settings (`model.options`).

This module imports no task: `model.task` is checked here for its form only (a built-in's name, or
`module.path:ClassName`); the plug-in's import and its class are checked once the config has loaded,
before anything starts (workflows.tasks.check_task: the CLI's config load, workflows.runtime).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from workflows.config.base import Strict

# the built-in tasks' names (workflows.tasks.BUILTIN maps them to their classes; a test keeps the two alike)
BUILTIN_TASKS = ("classification", "causal_lm", "image_classification", "chat")
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

class ModelConfig(Strict):
    task: str = Field(
        "classification",
        description="classification (fine-tune a text classifier), causal_lm (pretrain a GPT-2-style causal LM, "
        "its size in model.options), "
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

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        if v in BUILTIN_TASKS or IMPORT_PATH.match(v):
            return v
        raise ValueError(f"unknown task {v!r}: use one of {', '.join(BUILTIN_TASKS)}, or a plug-in as "
                         "module.path:ClassName")

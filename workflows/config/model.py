"""The `model` section: the task, its model, and a causal LM's shape."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from workflows.config.base import Strict


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
        "image_classification, or a plug-in task by import path, module.path:ClassName (a workflows.tasks.base.Task)",
    )
    name_or_path: str = Field(
        "minilm",
        description="text: 'minilm' or a local Hugging Face model directory; images: an architecture by name "
        "(small_cnn, resnet18, resnet50, vit_small, convnext_tiny, pooled_linear: a linear classifier over 8x8 "
        "average-pooled pixels; new weights), or a directory or object-store "
        "URI in from_pretrained layout (safetensors) whose weights are fine-tuned on the dataset's labels",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="a plug-in task's own settings (its Options model validates them)")
    trusted_tasks: list[str] = Field(
        default_factory=list, description="plug-in tasks (module.path:ClassName) that serve, evaluate and predict "
        "may import for a registered model whose card names them; model.task is always trusted. A card naming "
        "any other plug-in is refused: the card comes from the store, and must not choose the code that runs")
    dropout: float | None = Field(None, ge=0.0, lt=1.0)
    pooling: Literal["cls", "mean"] = Field(
        "cls",
        description="classification: 'cls' (the checkpoint's pooler on the first token, Hugging Face's classifier) "
        "or 'mean' (normalized mean of all tokens: how sentence-embedding checkpoints such as MiniLM were trained)",
    )
    lm: CausalLMConfig = CausalLMConfig()

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        from workflows.tasks import check_task_name

        return check_task_name(v)

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        from workflows.train.lm import shape

        _, hidden, heads = shape(self.lm)
        if hidden % heads:
            raise ValueError(f"lm: hidden size {hidden} is not divisible by {heads} heads")
        return self


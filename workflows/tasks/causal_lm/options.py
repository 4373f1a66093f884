"""The causal_lm task's `model.options`: a GPT-2-style model's size preset, its overrides and the
training block length. Light (pydantic only): the config check and the planner read it without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


def shape(lm_cfg) -> tuple[int, int, int]:
    """(layers, hidden size, heads) of the options' preset with the overrides applied."""
    layers, hidden, heads = SIZES[lm_cfg.size]
    return lm_cfg.n_layer or layers, lm_cfg.n_embd or hidden, lm_cfg.n_head or heads


class CausalLMOptions(BaseModel):
    """The causal_lm task's `model.options`: a GPT-2-style model built from a size preset, randomly
    initialized."""

    model_config = ConfigDict(extra="forbid")

    size: Literal["tiny", "small", "gpt2-124m", "gpt2-350m", "gpt2-774m", "1b"] = "gpt2-124m"
    n_layer: int | None = Field(None, ge=1, description="overrides the preset's layers")
    n_embd: int | None = Field(None, ge=8, description="overrides the preset's hidden size")
    n_head: int | None = Field(None, ge=1, description="overrides the preset's attention heads")
    seq_len: int = Field(1024, ge=8, description="tokens per training block (rows are packed into blocks)")

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        _, hidden, heads = shape(self)
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        return self

"""Where a model's weights are and in what dtype: every tensor the engine makes goes there."""

from __future__ import annotations

import torch


def model_device(model) -> torch.device:
    """Where the model's weights are (a Hugging Face or peft model's `device`, else its first parameter's;
    the CPU for a model without parameters)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def model_dtype(model) -> torch.dtype:
    try:
        return next(model.parameters()).dtype
    except (AttributeError, StopIteration, TypeError):
        return torch.float32

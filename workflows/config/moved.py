"""Keys that left the config for a built-in task's `model.options`: each one, found in a config file
or a `--set`, is an error naming its new place (no setting is read from its old key).

The config defines none of these settings (the tasks' `Options` models do, under workflows/tasks/);
it keeps only where each old key went, so that the error can say it.
"""

from __future__ import annotations

from typing import Any

# old dotted key -> (its place now, the built-in task whose option it is)
MOVED: dict[str, tuple[str, str]] = {
    "model.pooling": ("model.options.pooling", "classification"),
    "train.head_init": ("model.options.head_init", "classification"),
    "train.linear_probe_l2": ("model.options.linear_probe_l2", "classification"),
    "train.head_lr": ("model.options.head_lr", "classification"),
    "train.freeze_embeddings": ("model.options.freeze_embeddings", "classification"),
    "preprocess.image_size": ("model.options.image_size", "image_classification"),
    "train.augment": ("model.options.augment", "image_classification"),
    "train.image_input": ("model.options.image_input", "image_classification"),
    "data.image_column": ("model.options.image_column", "image_classification"),
    "model.lm": ("model.options", "causal_lm"),
    "model.lm.size": ("model.options.size", "causal_lm"),
    "model.lm.n_layer": ("model.options.n_layer", "causal_lm"),
    "model.lm.n_embd": ("model.options.n_embd", "causal_lm"),
    "model.lm.n_head": ("model.options.n_head", "causal_lm"),
    "model.lm.seq_len": ("model.options.seq_len", "causal_lm"),
}


def moved_message(key: str) -> str:
    """'<old key> moved to <new place> (the <task> task's options)'."""
    place, task = MOVED[key]
    return f"{key} moved to {place} (the {task} task's options)"


def moved_keys(data: Any, prefix: str = "") -> list[str]:
    """The old keys (MOVED) a raw config mapping sets, in its order. A moved mapping whose own keys
    moved one by one (`model.lm`) is named by those keys; any other part of it by its own name."""
    found: list[str] = []
    if not isinstance(data, dict):
        return found
    for name, value in data.items():
        key = f"{prefix}{name}"
        if key in MOVED:
            children = any(k.startswith(key + ".") for k in MOVED)
            inner = [f"{key}.{c}" for c in value] if children and isinstance(value, dict) and value else []
            named = [k for k in inner if k in MOVED]
            found += named if named and len(named) == len(inner) else [key]
        elif isinstance(value, dict) and any(k.startswith(key + ".") for k in MOVED):
            found += moved_keys(value, key + ".")
    return found


def moved_error(data: Any, source: str) -> str | None:
    """One line naming `source` and each old key of `data` with its new place; None when there is none."""
    keys = moved_keys(data)
    if not keys:
        return None
    return "invalid config: " + "; ".join(f"{source}: {moved_message(k)}" for k in keys)

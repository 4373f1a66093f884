"""`--set section.key=value` overrides, applied to a config's raw YAML data before validation."""

from __future__ import annotations

import re
from typing import Any

import yaml

from workflows.errors import UserError


def _parse_value(raw: str) -> Any:
    """`--set` values are YAML scalars/lists: 3 -> int, 1e-4 -> float, [a,b] -> list, null -> None."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    # YAML 1.1 reads "1e-4" as a string; accept plain float literals too.
    if isinstance(value, str):
        try:
            return float(value) if re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value) else value
        except ValueError:
            return value
    return value


def apply_overrides(data: dict, overrides: list[str], source: str) -> dict:
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. train.lr=3e-5")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise UserError(f"--set {item!r}: empty part in key {key!r}")
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"--set {key}: {part!r} is not a section in {source}")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return data


def named_after_model(overrides: list[str] | None, ctx, model: str) -> list[str]:
    """`overrides` plus name=<model> for a command that names a registered model (`evaluate --model
    wine:2`) without --config (`ctx`: its typer.Context): its summary, plots and logs then go under
    the model's name, not the shipped quickstart config's. `--set name=...` still wins."""
    overrides = list(overrides or [])
    if ctx.get_parameter_source("config").name != "DEFAULT" or any(o.split("=", 1)[0].strip() == "name"
                                                                    for o in overrides):
        return overrides
    return [*overrides, f"name={re.split(r'[:@]', model, maxsplit=1)[0]}"]

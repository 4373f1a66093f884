"""The whole config, its sections together, and loading it from YAML with `--set` overrides."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, field_validator

from workflows.config.base import Strict, check_name
from workflows.config.cluster import RayConfig
from workflows.config.data import DataConfig, PreprocessConfig
from workflows.config.model import ModelConfig
from workflows.config.moved import moved_error
from workflows.config.registry import EvaluateConfig, RegistryConfig
from workflows.config.serve import ServeConfig
from workflows.config.storage import CacheConfig, StorageConfig
from workflows.config.tracking import TrackingConfig
from workflows.config.train import TrainConfig
from workflows.config.tune import TuneConfig
from workflows.errors import UserError
from workflows.overrides import apply_overrides


class WorkflowConfig(Strict):
    name: str = Field("quickstart", description="run name: prefixes runs and summaries")
    seed: int = 0
    output_dir: str = Field(".workflows/runs", description="local directory for JSON summaries and plots")
    storage: StorageConfig = StorageConfig()
    cache: CacheConfig = CacheConfig()
    ray: RayConfig = RayConfig()
    data: DataConfig
    preprocess: PreprocessConfig = PreprocessConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    tune: TuneConfig = TuneConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    registry: RegistryConfig = RegistryConfig()
    serve: ServeConfig = ServeConfig()
    tracking: TrackingConfig = TrackingConfig()

    @field_validator("name")
    @classmethod
    def valid_name(cls, v: str) -> str:
        return check_name(v, "run name")

    # Where things live under the storage root.
    def uri(self, *parts: str) -> str:
        return "/".join([self.storage.root.rstrip("/"), *parts])


def _format_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        else:
            msg = e["msg"]
            if "input" in e and not isinstance(e["input"], (dict, list)):
                msg += f" (got {e['input']!r})"
        lines.append(f"{source}: {key}: {msg}")
    return "invalid config: " + "; ".join(lines)


SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # workflows/configs


def shipped_configs() -> list[str]:
    """Names of the configs shipped in the package (`--config quickstart`)."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))


def resolve_config(path: str | os.PathLike) -> Path:
    """A config file: an existing path as given, else a bare name (no '/' or suffix) of a shipped
    config, so `--config quickstart` works from any directory."""
    p = Path(path)
    if p.is_file():
        return p
    name = str(path)
    if "/" not in name and not p.suffix and (SHIPPED_CONFIGS / f"{name}.yaml").is_file():
        return SHIPPED_CONFIGS / f"{name}.yaml"
    raise UserError(f"config file not found: {p} (shipped configs, by name: {', '.join(shipped_configs())})")


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> WorkflowConfig:
    """Read YAML at `path` (a file or a shipped config's name; None = defaults only), apply
    overrides, validate. A key that moved to a task's `model.options` (workflows.config.moved) is
    an error naming its new place, in the file or in a `--set`."""
    data: dict = {}
    source = "<defaults>"
    if path is not None:
        p = resolve_config(path)
        source = str(path) if p.parent == SHIPPED_CONFIGS else str(p)
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise UserError(f"{p}: not valid YAML: {e}".splitlines()[0]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise UserError(f"{p}: top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    if error := moved_error(data, source):
        raise UserError(error)
    if overrides:
        source = f"{source} (with --set)"
        data = apply_overrides(data, overrides, source)
        if error := moved_error(data, source):
            raise UserError(error)
    try:
        return WorkflowConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(_format_error(e, source)) from None


def dump_config(cfg: WorkflowConfig) -> dict:
    """A JSON-safe dict of the config (holds no credentials: they never enter the config)."""
    return cfg.model_dump(mode="json")


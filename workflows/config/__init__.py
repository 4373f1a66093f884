"""One typed config for the whole workflow, loaded from YAML with `--set a.b=c` overrides.

Every model forbids unknown keys, so a typo is reported with its dotted path and the file; a key
that moved to a task's `model.options` is reported with its new place (moved.py).
One module per section (storage.py: `storage` and `cache`, cluster.py: `ray`, ...); workflow.py
holds the whole config and its loading. Import the names from here.
"""

from workflows.config.base import NAME_RE, Strict, check_name
from workflows.config.cluster import RayConfig
from workflows.config.data import DataConfig, PreprocessConfig
from workflows.config.model import ModelConfig
from workflows.config.registry import EvaluateConfig, RegistryConfig
from workflows.config.serve import AutoscalingConfig, ServeConfig
from workflows.config.storage import CacheConfig, EmbeddedS3Config, StorageConfig
from workflows.config.tracking import TrackingConfig
from workflows.config.train import TrainConfig
from workflows.config.tune import SearchDim, TuneConfig
from workflows.config.workflow import (
    SHIPPED_CONFIGS,
    WorkflowConfig,
    _format_error,
    dump_config,
    load_config,
    resolve_config,
    shipped_configs,
)

__all__ = [
    "NAME_RE", "SHIPPED_CONFIGS", "AutoscalingConfig", "CacheConfig", "DataConfig", "EmbeddedS3Config",
    "EvaluateConfig", "ModelConfig", "PreprocessConfig", "RayConfig",
    "RegistryConfig", "SearchDim", "ServeConfig", "StorageConfig", "Strict", "TrackingConfig", "TrainConfig",
    "TuneConfig", "WorkflowConfig", "_format_error", "check_name", "dump_config", "load_config",
    "resolve_config", "shipped_configs",
]

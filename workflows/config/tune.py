"""The `tune` section: the hyperparameter search over train.* fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from workflows.config.base import Strict
from workflows.config.moved import MOVED, moved_message
from workflows.config.train import TrainConfig

OPTION_PREFIX = "model.options."  # a search dimension over one of the task's options


class SearchDim(Strict):
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None
    choice: list[Any] | None = None
    grid: list[Any] | None = None

    @model_validator(mode="after")
    def one_kind(self) -> SearchDim:
        kinds = [k for k in ("uniform", "loguniform", "choice", "grid") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("give exactly one of uniform, loguniform, choice, grid")
        return self


class TuneConfig(Strict):
    enabled: bool = True
    search: Literal["random", "optuna"] = Field(
        "random", description="random sampling (grid dims expand), or Optuna's TPE (`pip install optuna`; no grid dims)"
    )
    scheduler: Literal["asha", "fifo"] = Field(
        "asha", description="asha stops poor trials early; fifo runs every trial to max_epochs (a baseline)"
    )
    num_samples: int = Field(4, ge=1)
    metric: str | None = Field(
        None, description="the validation metric trials are ranked by; None: the task's checkpoint metric "
        "(val_f1 for a classifier, a plug-in task's `score`)")
    mode: Literal["max", "min"] | None = Field(
        None, description="None: the task's for its own metric, else max")
    max_epochs: int = Field(2, ge=1)
    grace_period: int = Field(1, ge=1)
    reduction_factor: float = Field(2, gt=1)
    num_workers: int = Field(
        1,
        ge=1,
        description="workers per trial: 1 runs the trial's loop in its Tune actor; more run a Ray Train run per trial",
    )
    checkpoint: bool = Field(
        True,
        description="one-worker trials: report a checkpoint every epoch (a failed or resumed trial continues from it)",
    )
    max_train_rows: int | None = Field(None, ge=1, description="cap rows per trial epoch")
    max_val_rows: int | None = Field(None, ge=1, description="cap validation rows per trial epoch")
    seed: int = 0
    space: dict[str, SearchDim] = Field(
        default_factory=dict, description="dotted train.* field or model.options.* key (the task's option, which "
        "its Options model validates in each trial) -> distribution")

    @field_validator("space")
    @classmethod
    def train_fields_only(cls, space: dict[str, SearchDim]) -> dict[str, SearchDim]:
        for key in space:
            option = key.removeprefix(OPTION_PREFIX)
            if key.startswith(OPTION_PREFIX) and option and "." not in option:
                continue
            if key in MOVED:
                raise ValueError(f"search dimension {moved_message(key)}")
            field = key.removeprefix("train.")
            if not key.startswith("train.") or field not in TrainConfig.model_fields:
                raise ValueError(f"search dimension {key!r} must name a train.* field or a model.options.* key")
        return space


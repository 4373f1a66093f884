"""The `evaluate` and `registry` sections: scoring a model and the name it is registered under."""

from __future__ import annotations

from pydantic import Field, field_validator

from workflows.config.base import Strict, check_name


class EvaluateConfig(Strict):
    batch_size: int = Field(64, ge=1)
    in_process_max_rows: int = Field(
        2000, ge=0, description="score a dataset of at most this many rows in the calling process, not in a "
        "Ray Data actor pool (an actor's start and model load cost more than scoring a few thousand rows); "
        "0: always the pool")


class RegistryConfig(Strict):
    name: str = Field("quickstart", description="the trained model is registered under this name")

    @field_validator("name")
    @classmethod
    def valid(cls, v: str) -> str:
        return check_name(v, "model name")


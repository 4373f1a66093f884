"""The `evaluate` and `registry` sections: scoring a model, the name it is registered under and the
promotion gate that moves an alias (`production`) to a new version only when it scores better."""

from __future__ import annotations

from pydantic import Field, field_validator

from workflows.config.base import Strict, check_alias_name, check_name


class EvaluateConfig(Strict):
    batch_size: int = Field(64, ge=1)
    in_process_max_rows: int = Field(
        2000, ge=0, description="score a dataset of at most this many rows in the calling process, not in a "
        "Ray Data actor pool (an actor's start and model load cost more than scoring a few thousand rows), a "
        "processed split's plain columns read there too, without a Ray Data job; 0: always the pool")


class PromoteConfig(Strict):
    """The pipeline's promotion gate: after evaluation, the new version and the alias's holder are scored
    on the same rows, and the alias moves only when the new one wins by `margin`."""

    alias: str = Field("production", description="the alias the gate moves (`serve --model NAME@ALIAS` follows it)")
    metric: str | None = Field(None, description="the evaluation metric compared; None: the task's headline "
                               "(a classifier's weighted F1); one the task can compare (its evaluation seam's "
                               "comparable_metrics)")
    margin: float = Field(0.0, ge=0, description="how much better (in the metric's direction) the new version "
                          "must score than the holder to take the alias; a tie never moves it")

    @field_validator("alias")
    @classmethod
    def valid_alias(cls, v: str) -> str:
        return check_alias_name(v)


class RegistryConfig(Strict):
    name: str = Field("quickstart", description="the trained model is registered under this name")
    promote: PromoteConfig | None = Field(
        None, description="the promotion gate (off when unset): `registry.promote.alias=production` turns it on")
    gate_data: str | None = Field(
        None, description="URI of labelled rows in the model's columns (CSV/JSONL/parquet) that the gate scores "
        "both versions on too, and decides on: common ground for runs on different data")
    signing_key: str = Field(
        "auto", description="the EC private key (PEM) registration signs each version with: a path, env:NAME (the "
        "variable holds the PEM), or auto: $WORKFLOWS_SIGNING_KEY where set (a cluster's Secret), else a key pair "
        "made once under the user's config directory, mode 0600")
    trusted_keys: list[str] = Field(
        ["auto"], min_length=1, description="public keys (PEM: paths, env:NAME, auto: $WORKFLOWS_SIGNING_PUBLIC_KEY "
        "where set, else the auto pair's) a version's signature must verify against before anything of it is "
        "loaded; on several machines, keys every node reads")
    allow_unsigned: bool = Field(
        False, description="load versions, and read lifecycle records (alias moves, evaluations, promotion "
        "decisions), that carry no signature (written before signing); a changed, added or missing file of a "
        "signed version, or an edited signed record, is refused whatever this says")

    @field_validator("name")
    @classmethod
    def valid(cls, v: str) -> str:
        return check_name(v, "model name")


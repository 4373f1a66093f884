"""The `tracking` section: MLflow experiment tracking."""

from __future__ import annotations

from pydantic import Field

from workflows.config.base import Strict


class TrackingConfig(Strict):
    """MLflow experiment tracking (workflows/tracking): a run per pipeline, stage and tune trial."""

    enabled: bool = True
    uri: str | None = Field(
        None, description="MLflow tracking URI (http://... for a team server); None: sqlite:///<output_dir>/mlflow.db"
    )
    experiment: str | None = Field(None, description="experiment name; None: the config's name")
    step_loss_every: int = Field(10, ge=1, description="log the training loss of every N-th optimizer step")
    retry_seconds: float = Field(
        300.0, gt=0, description="how long a failing tracking store is retried (with backoff, metrics buffered) "
        "before tracking turns off for the process and its runs are marked FAILED with the gap",
    )


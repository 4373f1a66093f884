"""Hand a Ray Train trial's epoch reports to Tune, and only those.

A trial of more than one worker is a Ray Train run, and Ray's TuneReportCallback gives Tune every
report of it as a result. A step checkpoint (train.checkpoint_every_steps) is a report too, with the
score NaN (workflows.train.trainer): to Tune it was a training_iteration, ASHA's unit of time with
tune.max_epochs its limit, so a trial was stopped after max_epochs step checkpoints, before its
first epoch was scored, and the search compared NaNs. Ray Train keeps those checkpoints for its own
restarts whatever Tune sees.
"""

from __future__ import annotations

from typing import Any

from ray.tune.integration.ray_train import TuneReportCallback

from workflows.train.report import is_step_checkpoint


class EpochReports(TuneReportCallback):
    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if metrics and is_step_checkpoint(metrics[0]):
            return
        super().after_report(run_context, metrics, checkpoint)

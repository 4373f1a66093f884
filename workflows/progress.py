"""Live progress of the long stages, one line per event as it happens (the stages sum up after).

Both hooks print with `say`. In the driver that is the terminal; in a Ray actor (Ray Train's
controller) the line reaches the driver through Ray's log forwarding, and workflows.console's relay
puts it on the terminal.
"""

from __future__ import annotations

from typing import Any

import ray.train
import ray.tune

from workflows.console import say
from workflows.train.report import is_step_checkpoint


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _pace(m: dict, done: int, total: int | None) -> str:
    """", 42 rows/s, 3s, ~6s left": an epoch's training rows per second, its seconds (steps and
    validation), and the rest of the budget at that pace (an upper bound for a tune trial, which
    ASHA may stop)."""
    if "epoch_seconds" not in m:
        return ""
    seconds = m["epoch_seconds"] + (m.get("val_seconds") or 0.0)
    left = f", ~{seconds * (total - done):.0f}s left" if total and total > done else ""
    return f", {m.get('samples_per_s', 0.0):.0f} rows/s, {seconds:.0f}s{left}"


def _params(config: dict) -> str:
    return ", ".join(f"{k.removeprefix('train.')}={_num(v)}" for k, v in sorted(config.items()))


class TrialProgress(ray.tune.Callback):
    """One line per trial that starts, per result it reports (one per epoch) and per trial that fails.
    Runs in the driver: `ray.tune.RunConfig(callbacks=[TrialProgress(metric, mode, num_samples, max_epochs)])`."""

    def __init__(self, metric: str, mode: str = "max", num_samples: int | None = None, max_epochs: int | None = None):
        self.metric, self.mode, self.total, self.max_epochs = metric, mode, num_samples, max_epochs
        self._best: float | None = None

    def _name(self, trials: list, trial) -> str:
        # Tune's list of trials is in order of creation, as the outcome's (tune_trials.md, .png)
        n = trials.index(trial) + 1
        return f"trial {n}/{self.total}" if self.total else f"trial {n}"

    def on_trial_start(self, iteration: int, trials: list, trial, **info):
        say(f"tune:   {self._name(trials, trial)} started: {_params(trial.config)}")

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info):
        value = result.get(self.metric)
        if isinstance(value, (int, float)) and (self._best is None or
                                                (value > self._best if self.mode == "max" else value < self._best)):
            self._best = value
        epoch = result.get("training_iteration", 1)
        of = f"/{self.max_epochs}" if self.max_epochs else ""
        best = f" (best so far {self._best:.4f})" if self._best is not None else ""
        shown = f"{value:.4f}" if isinstance(value, float) else value
        say(
            f"tune:   {self._name(trials, trial)} epoch {epoch}{of}: {self.metric}={shown}{best}"
            f"{_pace(result, epoch, self.max_epochs)}"
        )

    def on_trial_error(self, iteration: int, trials: list, trial, **info):
        say(f"tune:   {self._name(trials, trial)} failed: {trial.error_file or 'see the log'}")


class EpochProgress(ray.train.UserCallback):
    """One line per epoch that the workers report, as it ends. Runs in Ray Train's controller:
    `ray.train.RunConfig(callbacks=[EpochProgress(epochs)])`, or `trainer.fit(..., callbacks=[...])`."""

    def __init__(self, epochs: int | None = None, metric: str | None = None):
        self.epochs = epochs
        self.metric = metric  # the task's checkpoint metric (Task.score), shown first

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        m = metrics[0] if metrics else {}
        if "epoch" not in m or is_step_checkpoint(m):
            return
        of = f" ({m['epoch'] + 1} of {self.epochs})" if self.epochs else ""
        val = next((f", {k} {m[k]:.4f}" for k in (self.metric, "val_f1", "val_perplexity", "val_loss")
                    if k in m), "")
        say(f"train: epoch {m['epoch']}{of} done: loss {m.get('train_loss', float('nan')):.4f}{val}"
            f"{_pace(m, m['epoch'] + 1, self.epochs)}")

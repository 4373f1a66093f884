"""The MLflow calls a run's logging is made of (one batch per MLflow limit), shared by the driver's
runs (session.py) and a worker's RunLogger (client.py)."""

from __future__ import annotations

import time
from typing import Any


def now_ms() -> int:
    return int(time.time() * 1000)


# Per-epoch metrics a run logs (step = epoch), when the epoch's metrics have them; and every other
# number a task's validate reports (val_*: a plug-in's own, such as val_r2).
EPOCH_METRICS = ("train_loss", "val_f1", "val_accuracy", "val_loss", "val_perplexity", "samples_per_s",
                 "tokens_per_s", "epoch_seconds", "val_seconds", "data_wait_seconds", "checkpoint_seconds", "lr",
                 "mfu")


def epoch_metrics(metrics: dict, step_losses: list[float] | None, step_loss_every: int) -> list[tuple[str, float, int]]:
    """(key, value, step) of one epoch: the EPOCH_METRICS and the task's val_* numbers at step=epoch, and
    every `step_loss_every`-th optimizer step's loss (all ranks averaged) as train_step_loss at its global
    step."""
    epoch = int(metrics["epoch"])
    keys = [*EPOCH_METRICS, *sorted(k for k in metrics if k.startswith("val_") and k not in EPOCH_METRICS)]
    out = [(k, float(metrics[k]), epoch) for k in keys
           if isinstance(metrics.get(k), int | float) and not isinstance(metrics.get(k), bool)]
    losses = step_losses or []
    first = int(metrics.get("global_step", len(losses))) - len(losses)  # global step before this epoch
    out += [("train_step_loss", float(loss), first + i + 1) for i, loss in enumerate(losses)
            if (first + i + 1) % step_loss_every == 0]
    return out


def find_run(client, experiment_id: str, tags: dict[str, str]) -> Any:
    """The newest run of the experiment with all of `tags`, or None."""
    where = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    found = client.search_runs([experiment_id], where, max_results=1, order_by=["attributes.start_time DESC"])
    return found[0] if found else None


def log_metrics(client, run_id: str, rows: list[tuple[str, float, int]], ts: int) -> None:
    from mlflow.entities import Metric

    metrics = [Metric(k, v, ts, step) for k, v, step in rows]
    for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
        client.log_batch(run_id, metrics=metrics[i:i + 1000])


def log_params(client, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(k, str(v)) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow's limit per batch
        client.log_batch(run_id, params=items[i:i + 100])


def set_tags(client, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items() if v is not None])

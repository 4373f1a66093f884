"""A training run's reports: which of them end an epoch; and, for people, the loss curve (every step,
all ranks averaged) and validation loss per epoch."""

from __future__ import annotations

from pathlib import Path

# set in the report of a mid-epoch checkpoint (train.checkpoint_every_steps; workflows.train.trainer)
STEP_CHECKPOINT = "step_checkpoint"


def is_step_checkpoint(report: dict) -> bool:
    """A mid-epoch checkpoint's report (its score NaN, for resuming only), not an epoch's end."""
    return bool(report.get(STEP_CHECKPOINT))


def plot_losses(history: list[dict], path: Path, title: str = "") -> Path | None:
    """Per-step training loss and per-epoch validation loss against the global step; None without steps."""
    from workflows.plots import new_figure, save_png

    steps: list[int] = []
    losses: list[float] = []
    ends: list[int] = []
    val: list[float] = []
    for h in sorted(history, key=lambda r: r["epoch"]):
        per_step = h.get("step_losses") or []
        first = int(h.get("global_step", len(per_step))) - len(per_step)
        steps += range(first + 1, first + len(per_step) + 1)
        losses += per_step
        if h.get("val_loss") is not None:
            ends.append(first + len(per_step))
            val.append(h["val_loss"])
    if not losses:
        return None
    fig, ax = new_figure()
    ax.plot(steps, losses, lw=1, label="training loss (per step)")
    ax.plot(ends, val, "o-", label="validation loss (end of epoch)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return save_png(fig, path)

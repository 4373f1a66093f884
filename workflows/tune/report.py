"""Tuning results for people: a table of trials and a plot of the metric per epoch for every trial."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workflows.tune.search import TrialResult


def trials_table(trials: list[TrialResult], metric: str, max_epochs: int) -> str:
    """Markdown: one row per trial, best first (the order `mode` prefers is applied by the caller),
    each under its number in the plot and the live progress lines."""
    keys = sorted({k for t in trials for k in t.params})
    head = ["trial", *keys, metric, "epochs", "stopped early", "error"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for t in trials:
        vals = [_fmt(t.params.get(k)) for k in keys]
        row = [str(t.trial), *vals, "" if t.value is None else f"{t.value:.4f}", f"{t.epochs}/{max_epochs}",
               "yes" if t.stopped_early else "no", t.error or ""]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def plot_trials(trials: list[TrialResult], metric: str, path: Path) -> Path:
    from workflows.plots import new_figure, save_png

    fig, ax = new_figure()
    for t in trials:
        hist = t.history
        if hist:
            style = "--" if t.stopped_early else "-"
            params = ", ".join(f"{k.removeprefix('train.')}={_fmt(v)}" for k, v in t.params.items())
            label = f"{t.trial}: {params}"
            ax.plot([h["training_iteration"] for h in hist], [h[metric] for h in hist], style, marker="o", label=label)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    ax.set_xlabel("epoch")
    ax.set_ylabel(metric)
    ax.set_title("trials (dashed: stopped early by ASHA)", fontsize=9)
    ax.legend(fontsize=6)
    return save_png(fig, path)

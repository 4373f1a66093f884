"""The tuning report: the trials table (best first), the plot and the live lines name each trial alike."""

from __future__ import annotations

from types import SimpleNamespace

from workflows.tune.report import plot_trials, trials_table
from workflows.tune.search import TrialResult


def _trial(number: int, lr: float, loss: float) -> TrialResult:
    return TrialResult(trial=number, params={"train.lr": lr}, metric="val_loss", value=loss, best=loss, epochs=2,
                       stopped_early=False, error=None, history=[{"training_iteration": 1, "val_loss": loss}])


def test_table_plot_and_progress_lines_number_trials_alike(tmp_path, monkeypatch):
    import workflows.plots
    import workflows.progress

    trials = [_trial(1, 1.0, 0.9), _trial(2, 1e-4, 0.5)]  # Tune's order
    rows = trials_table(sorted(trials, key=lambda t: t.value), "val_loss", 2).splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| 2", "| 1"]  # best first, under their own numbers

    figures = []
    monkeypatch.setattr(workflows.plots, "save_png", lambda fig, path: figures.append(fig) or path)
    plot_trials(trials, "val_loss", tmp_path / "t.png")
    assert figures[0].axes[0].get_legend_handles_labels()[1] == ["1: lr=1", "2: lr=0.0001"]

    said = []
    monkeypatch.setattr(workflows.progress, "say", said.append)
    progress = workflows.progress.TrialProgress("val_loss", "min", 2)
    tune_trials = [SimpleNamespace(trial_id=i, config={"train.lr": t.params["train.lr"]}) for i, t in
                   enumerate(trials)]
    progress.on_trial_start(0, tune_trials, tune_trials[1])  # the second one created starts first
    assert said == ["tune:   trial 2/2 started: lr=0.0001"]

"""The notebook API's values, built from what the stages return (no runtime: the notebooks run it
end to end, tests/test_notebook.py)."""

import pytest

from workflows.errors import UserError
from workflows.tune.search import TrialResult, TuneOutcome
from workflows.workflow import TrainResult, TuneResult, Workflow, _epochs, _report, _trials


def test_a_workflow_is_built_from_a_config_with_overrides_and_needs_starting():
    wf = Workflow.from_config("quickstart", ["name=api", "train.epochs=3"])
    assert (wf.cfg.name, wf.cfg.train.epochs) == ("api", 3)
    assert repr(wf) == "Workflow('api', task='classification', not started)"
    with pytest.raises(UserError, match="not started"):
        wf.raw_shards()
    with pytest.raises(UserError, match="train"):
        wf.register()


def test_trials_and_their_curves_are_tables():
    trial = TrialResult(trial=0, params={"train.lr": 1e-4}, metric="val_loss", value=0.5, best=0.5, epochs=2,
                        stopped_early=False, error=None, history=[{"training_iteration": 1, "val_loss": 0.7},
                                                                  {"training_iteration": 2, "val_loss": 0.5}])
    trials, curves = _trials(TuneOutcome({"train.lr": 1e-4}, 0.5, [trial]))
    assert trials.to_dict("records") == [{"trial": 0, "train.lr": 1e-4, "val_loss": 0.5, "best": 0.5, "epochs": 2,
                                          "stopped_early": False, "error": None}]
    assert curves.to_dict("list") == {"trial": [0, 0], "epoch": [1, 2], "val_loss": [0.7, 0.5]}
    assert repr(TuneResult({"train.lr": 1.234567e-4}, 0.123456, "val_loss", trials, curves, 12.3456)) == \
        "TuneResult(best_params={'train.lr': 0.0001235}, best_metric=0.1235, metric='val_loss', trials=1, " \
        "seconds=12.35)"


def test_history_splits_into_epochs_and_steps():
    epochs, steps = _epochs([{"epoch": 0, "train_loss": 1.0, "step_losses": [1.2, 0.8]},
                             {"epoch": 1, "train_loss": 0.5, "step_losses": [0.6]}])
    assert list(epochs.columns) == ["epoch", "train_loss"]
    assert steps.to_dict("list") == {"step": [1, 2, 3], "epoch": [0, 0, 1], "loss": [1.2, 0.8, 0.6]}
    result = TrainResult("s3://b/runs/r", {"epoch": 1, "train_loss": 0.5, "val_f1": 0.912345, "val_seconds": 3.0,
                                           "samples": 48}, epochs, steps, 61.23)
    assert repr(result) == "TrainResult(run_uri='s3://b/runs/r', epochs=2, chosen={'epoch': 1, 'train_loss': 0.5, " \
                           "'val_f1': 0.9123}, seconds=61.23)"


def test_a_classifier_report_has_per_class_and_confusion_tables():
    metrics = {"rows": 3, "per_class": {"a": {"precision": 1.0, "recall": 0.5, "f1": 0.67, "support": 2},
                                        "b": {"precision": 0.5, "recall": 1.0, "f1": 0.67, "support": 1}},
               "confusion_matrix": {"labels": ["a", "b"], "matrix": [[1, 1], [0, 1]]}}
    report = _report("m:1", "test", metrics, ("weighted F1", 0.67, "majority baseline 0.5"))
    assert report.per_class.loc["a", "recall"] == 0.5
    assert report.confusion_matrix.loc["a", "b"] == 1 and report.confusion_matrix.index.name == "true"
    assert repr(report) == "Evaluation(model='m:1', split='test', rows=3, headline=('weighted F1', 0.67, " \
                           "'majority baseline 0.5'))"

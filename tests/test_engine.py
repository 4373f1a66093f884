"""engine.Trainer, the one training object under Ray Train, torchrun and one-worker Tune trials: the
checkpoint's train state is written in one place (Trainer.checkpoint_state), which every adapter
uses; and a Trainer stopped after an epoch resumes from its checkpoint to the uninterrupted run's
numbers. (Each adapter's checkpoints on the real path: test_train_resume for Ray Train and
torchrun, test_tune's optuna search for a Tune trial, all against EPOCH_STATE_KEYS.)"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from workflows.config import load_config

# what an epoch's train_state.json holds: Trainer.checkpoint_state's keys, and checkpoint.save's
EPOCH_STATE_KEYS = {"epoch", "global_step", "metrics", "history", "scheduler", "files"}
ENGINE = "workflows/train/engine.py"


def checkpoint_writers(root: Path) -> tuple[list[str], list[str]]:
    """Where the package under `root` saves a training checkpoint (calls of
    workflows.train.checkpoint.save, however imported) and where it builds a train-state dict (a dict
    display with the keys epoch, global_step and history): as 'path:function' lists."""
    saves, states = [], []
    for path in sorted((root / "workflows").rglob("*.py")):
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        modules, functions = set(), set()  # names bound to the checkpoint module / to its save
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "workflows.train":
                modules |= {a.asname or a.name for a in node.names if a.name == "checkpoint"}
            elif isinstance(node, ast.ImportFrom) and node.module == "workflows.train.checkpoint":
                functions |= {a.asname or a.name for a in node.names if a.name == "save"}
            elif isinstance(node, ast.Import):
                modules |= {a.asname for a in node.names if a.name == "workflows.train.checkpoint" and a.asname}

        def visit(node: ast.AST, where: str) -> None:
            for child in ast.iter_child_nodes(node):
                inner = where
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    inner = f"{where}.{child.name}" if where else child.name
                if isinstance(child, ast.Call):
                    f = child.func
                    if (isinstance(f, ast.Attribute) and f.attr == "save" and isinstance(f.value, ast.Name)
                            and f.value.id in modules) or (isinstance(f, ast.Name) and f.id in functions):
                        saves.append(f"{rel}:{inner}")
                if isinstance(child, ast.Dict):
                    keys = {k.value for k in child.keys if isinstance(k, ast.Constant)}
                    if {"epoch", "global_step", "history"} <= keys:
                        states.append(f"{rel}:{inner}")
                visit(child, inner)

        visit(tree, "")
    return saves, states


def test_the_checkpoint_state_is_written_in_one_place():
    """One method writes the train state and one saves a checkpoint; the three adapters inherit them.
    Before engine.Trainer the dict was built in trainer.py (twice), standalone.py and tune/trial.py,
    each calling checkpoint.save itself: this scan finds all four there."""
    from workflows.train.engine import Trainer
    from workflows.train.ray_worker import RayTrainWorker
    from workflows.train.standalone import TorchrunTrainer
    from workflows.tune.trial import TrialTrainer

    saves, states = checkpoint_writers(ROOT)
    assert saves == [f"{ENGINE}:Trainer.save_checkpoint"], saves
    assert states == [f"{ENGINE}:Trainer.checkpoint_state"], states
    for adapter in (RayTrainWorker, TorchrunTrainer, TrialTrainer):
        assert issubclass(adapter, Trainer)
        own = {"checkpoint_state", "save_checkpoint", "run_epoch", "fit"} & set(vars(adapter))
        assert not own, f"{adapter.__name__} overrides {own}"


def _classification(tmp_path: Path, *overrides: str):
    """The tabular classification example as a task (no pipeline), its dataset's description, and
    48 training and 13 validation rows of 2 features and 3 classes."""
    from workflows.api import ProcessedDataset

    examples = str(ROOT / "examples" / "tasks")
    if examples not in sys.path:  # as a user's project has them on its path
        sys.path.insert(0, examples)
    from tabular_classification import TabularClassification

    cfg = load_config(None, ["data.source=raw", f"output_dir={tmp_path}", "train.epochs=2", "train.batch_size=8",
                             "train.lr=1e-2", *overrides])
    info = {"features": ["a", "b"], "label": "y", "mean": [0.0, 0.0], "std": [1.0, 1.0]}
    data = ProcessedDataset(uri="", version="", labels=["p", "q", "r"], label_column="y", files={}, counts={},
                            label_counts={}, source="", info=info)
    task = TabularClassification(cfg)
    task.__dict__["options"] = task.Options(features=["a", "b"], label="y", hidden=8)
    rng = np.random.default_rng(0)

    def rows(n: int) -> dict:
        x = rng.normal(size=(n, 2))
        return {"a": x[:, 0], "b": x[:, 1], "label_id": (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 1)}

    return cfg, task, data, rows(48), rows(13)


def _torchrun_trainer(tmp_path: Path, checkpoint_dir: Path):
    from workflows.train.standalone import RowsInput, TorchrunTrainer

    cfg, task, data, train, val = _classification(tmp_path)
    return TorchrunTrainer(cfg, task, data, torch.device("cpu"), RowsInput(cfg, task, data, train, val), 48,
                           checkpoint_dir=str(checkpoint_dir))


def test_a_trainer_stopped_after_an_epoch_resumes_to_the_uninterrupted_run(tmp_path):
    """torchrun's adapter in one process: a 2-epoch run; another stopped after epoch 0 and a third
    resumed from that checkpoint train epoch 1 to the same step losses and validation metrics."""
    from workflows.train import checkpoint as ckpt

    torch.set_num_threads(1)
    whole = _torchrun_trainer(tmp_path, tmp_path / "whole")
    whole.build()
    reference = whole.fit()
    assert [h["epoch"] for h in reference] == [0, 1] and [h["global_step"] for h in reference] == [6, 12]

    stopped = _torchrun_trainer(tmp_path, tmp_path / "stopped")
    stopped.build()
    assert [h["epoch"] for h in stopped.fit(stop_after=0)] == [0]
    found = ckpt.latest_local(str(tmp_path / "stopped"))
    assert found is not None and found.endswith("epoch_0000")
    state = json.loads((Path(found) / ckpt.STATE_FILE).read_text())
    assert set(state) == EPOCH_STATE_KEYS, sorted(state)
    assert state["epoch"] == 0 and state["global_step"] == 6 and state["metrics"]["epoch"] == 0

    resumed = _torchrun_trainer(tmp_path, tmp_path / "stopped")
    resumed.build(probe=False)
    resumed.resume(found)
    assert (resumed.start_epoch, resumed.resumed_from, resumed.resume_at) == (1, 0, 0)
    history = resumed.fit()
    assert [h["epoch"] for h in history] == [0, 1] and history[1]["resumed_from_epoch"] == 0
    np.testing.assert_allclose(history[1]["step_losses"], reference[1]["step_losses"], rtol=1e-5)
    assert history[1]["val_loss"] == pytest.approx(reference[1]["val_loss"], rel=1e-5)
    # the same layout from every checkpoint the Trainer wrote, the last epoch's included
    last = json.loads((tmp_path / "stopped" / "epoch_0001" / ckpt.STATE_FILE).read_text())
    assert set(last) == EPOCH_STATE_KEYS and [h["epoch"] for h in last["history"]] == [0, 1]


def test_a_step_checkpoints_state_adds_the_samples_consumed(tmp_path):
    """A step checkpoint (Ray Train, train.loader=stream) holds the samples of its epoch consumed,
    from which the resumed run continues that epoch; an epoch's has no such key."""
    trainer = _torchrun_trainer(tmp_path, tmp_path / "ck")
    trainer.build()
    assert set(trainer.checkpoint_state(0, {}, consumed=16)) == EPOCH_STATE_KEYS - {"scheduler", "files"} | {"consumed"}
    assert "consumed" not in trainer.checkpoint_state(0, {})

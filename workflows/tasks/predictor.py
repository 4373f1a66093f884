"""A registered model loaded once (`Predictor`) and the default one (`ModelPredictor`: the exported
state dict loaded into the task's `build_model`, instances answered by its `predict_batch`), with
what every predictor shares: the replica's device, the serving precision and the dataset
description a registered model's card records."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from workflows.dataset import ProcessedDataset
    from workflows.model_card import ModelCard
    from workflows.tasks.base import Task

WEIGHTS = "model.safetensors"  # the default export's weights (ModelPredictor loads them)


def serving_device() -> torch.device:
    """Where a predictor runs its model: the replica's GPU when it has one (Serve gives a replica with
    serve.gpus_per_replica its GPU; one without sees none), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def serving_model(model: nn.Module, precision: str, threads: int | None) -> tuple[nn.Module, torch.device]:
    """A loaded model in serve.precision on its device: fp32, bf16, or int8 (dynamic quantization of
    the Linear layers, activations quantized per batch: CPU kernels only, so on the CPU); `threads`,
    if given, the CPU threads torch uses."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    device = serving_device()
    if precision == "int8":
        device = torch.device("cpu")
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    elif precision == "bf16":
        model = model.to(torch.bfloat16)
    elif precision != "fp32":
        raise ValueError(f"unknown precision {precision!r}")
    return model.to(device), device


class Predictor:
    """A registered model loaded once: raw instances in, predictions out (one per instance). Tasks
    keep the default, `ModelPredictor`, unless their model loads or reads its input differently.

    `predict` serves HTTP (instances as the task's request model validated them); `predict_frame`
    scores a pandas batch of stored or raw rows for batch inference and evaluation, adding the
    `prediction` (and, for classifiers, `score`) columns."""

    card: ModelCard
    input_columns: list[str]  # the columns of a row that `predict_frame` reads

    def predict(self, instances: Sequence[Mapping[str, Any]]) -> list[dict]:
        raise NotImplementedError

    def predict_frame(self, batch):
        raise NotImplementedError


def card_dataset(card: ModelCard) -> ProcessedDataset:
    """What `build_model`, `collate` and `predict_batch` read of a dataset, as a registered model's
    card recorded it (labels, label column, `info`): serving has the card, not the dataset."""
    from workflows.dataset import ProcessedDataset

    return ProcessedDataset(uri="", version=(card.lineage or {}).get("dataset_version", ""), labels=list(card.labels),
                            label_column=card.label_column or "", files={}, counts={}, label_counts={}, source="",
                            task=card.task or "", info=dict(getattr(card, "info", None) or {}))


class ModelPredictor(Predictor):
    """The default predictor: `build_model` on the card's dataset description with the exported
    weights, instances collated by the task's `collate` (train=False) and answered by its
    `predict_batch`, in eval mode without gradients."""

    def __init__(self, task: Task, model_dir: str, card: ModelCard, threads: int | None = None):
        import torch
        from safetensors.torch import load_file

        if threads:
            torch.set_num_threads(threads)
        self.task, self.card, self.data = task, card, card_dataset(card)
        self.inputs = task.inputs()
        self.input_columns = list(self.inputs)
        self.model = task.build_model(self.data)
        self.model.load_state_dict(load_file(os.path.join(model_dir, WEIGHTS)))
        self.model.eval()
        self.collate = task.collate(self.data, train=False)

    def _predict(self, columns: dict) -> list[dict]:
        import torch

        with torch.inference_mode():
            return self.task.predict_batch(self.model, self.collate(columns), self.data)

    def predict(self, instances: Sequence[Mapping[str, Any]]) -> list[dict]:
        import numpy as np

        return self._predict({c: np.array([row[c] for row in instances]) for c in self.input_columns})

    def predict_frame(self, batch):
        predictions = self._predict({c: batch[c].to_numpy() for c in self.input_columns})
        batch["prediction"] = [p[self.task.serving.prediction_key] for p in predictions]
        if predictions and "score" in predictions[0]:
            batch["score"] = [p["score"] for p in predictions]
        return batch

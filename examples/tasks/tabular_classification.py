"""Tabular classification, a plug-in task: numeric feature columns of CSV, JSONL or parquet shards ->
one of the label column's classes, with a small MLP. Copy this file into your project and name it:

    model:
      task: tabular_classification:TabularClassification
      options: {features: [alcohol, malic_acid, flavanoids], label: cultivar, hidden: 32}

`workflows.api` is all it imports of the platform: preprocessing (splits, the train split's feature
means and standard deviations), the validation metrics (weighted F1, accuracy), export, serving
({feature: number, ...} -> label, score, probabilities) and the per-class report come from there.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from pydantic import BaseModel, Field

from workflows.api import Classification, DatasetSeam, ModelOutput, preprocess_table


class Options(BaseModel, extra="forbid"):
    features: list[str] = Field(..., min_length=1, description="numeric feature columns")
    label: str = Field(..., description="the column of classes")
    hidden: int = Field(32, ge=1, description="units of the hidden layer")


class MLP(nn.Module):
    """Standardized features -> one hidden layer -> a logit per class."""

    def __init__(self, mean: list[float], std: list[float], classes: int, hidden: int):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))  # saved with the weights
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.net = nn.Sequential(nn.Linear(len(mean), hidden), nn.GELU(), nn.Linear(hidden, classes))

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        logits = self.net((features - self.mean) / self.std)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ModelOutput(logits=logits, loss=loss)


class TabularClassification(Classification):
    name = "tabular_classification"
    Options = Options

    class Dataset(DatasetSeam):  # an optional seam: the processed dataset's version
        model_only_options = ("hidden",)  # the rest (features, label) change the processed dataset

    @property
    def columns(self) -> tuple[str, ...]:  # type: ignore[override]  # the stored columns training reads
        return (*self.options.features, "label_id")

    def preprocess(self, ctx, say):
        return preprocess_table(self, ctx, say, self.options.features, self.options.label, classes=True)

    def collate(self, data, *, train, seed=None):
        def collate(batch: dict) -> dict:
            x = np.stack([np.asarray(batch[c], np.float32) for c in data.info["features"]], axis=1)
            out = {"features": torch.from_numpy(x)}
            if "label_id" in batch:  # not when serving
                out["labels"] = torch.from_numpy(np.asarray(batch["label_id"], np.int64))
            return out
        return collate

    def build_model(self, data) -> nn.Module:
        return MLP(data.info["mean"], data.info["std"], len(data.labels), self.options.hidden)

    def inputs(self) -> dict[str, type]:  # what a served instance holds
        return {c: float for c in self.options.features}

"""Tabular regression, a plug-in task: numeric feature columns -> a numeric target, by an MLP trained on the
standardized target; val_r2 ranks checkpoints (val_mse, val_loss beside it), serving answers {"value": y}. Config:
    model: {task: tabular_regression:TabularRegression, options: {features: [x1, x2], target: y}}"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from pydantic import BaseModel, Field

from workflows.api import DatasetSeam, ModelOutput, Task, preprocess_table


class Options(BaseModel, extra="forbid"):
    features: list[str] = Field(..., min_length=1, description="numeric feature columns")
    target: str = Field(..., description="the numeric column to predict")
    hidden: int = Field(32, ge=1, description="units per hidden layer")
    layers: int = Field(2, ge=1, le=8, description="hidden layers")


class MLP(nn.Module):
    def __init__(self, info: dict, hidden: int, layers: int):
        super().__init__()
        for k in ("mean", "std", "target_mean", "target_std"):  # the train split's, saved with the weights
            self.register_buffer(k, torch.tensor(info[k], dtype=torch.float32))
        body = [m for i in range(layers) for m in (nn.Linear(hidden if i else len(info["mean"]), hidden), nn.GELU())]
        self.net = nn.Sequential(*body, nn.Linear(hidden, 1))

    def forward(self, features, labels=None) -> ModelOutput:
        z = self.net((features - self.mean) / self.std).squeeze(-1)  # the standardized target
        loss = None if labels is None else nn.functional.mse_loss(z, (labels - self.target_mean) / self.target_std)
        return ModelOutput(logits=z * self.target_std + self.target_mean, loss=loss)


class TabularRegression(Task):
    name, score, Options = "tabular_regression", ("val_r2", "max"), Options

    class Dataset(DatasetSeam):  # an optional seam: the processed dataset's version
        model_only_options = ("hidden", "layers")  # left out of it (features, target are in)

    @property
    def columns(self) -> tuple[str, ...]:  # type: ignore[override]  # the stored columns training reads
        return (*self.options.features, self.options.target)

    def preprocess(self, ctx, say):
        return preprocess_table(self, ctx, say, self.options.features, self.options.target, classes=False)

    def collate(self, data, *, train, seed=None):
        def collate(batch: dict) -> dict:
            x = np.stack([np.asarray(batch[c], np.float32) for c in data.info["features"]], axis=1)
            y = batch.get(data.info["label"])  # None when serving
            return {"features": torch.from_numpy(x)} | ({} if y is None else {"labels": torch.tensor(y).float()})
        return collate

    def build_model(self, data) -> nn.Module:
        return MLP(data.info, self.options.hidden, self.options.layers)

    def inputs(self) -> dict[str, type]:  # what a served instance holds
        return {c: float for c in self.options.features}

    def metric_states(self, model, batch) -> dict:  # sums: the platform adds them up over batches and ranks
        out, y = model(**batch), batch["labels"].double()
        return {"n": len(y), "sse": ((out.logits.double() - y) ** 2).sum(), "sy": y.sum(), "syy": (y * y).sum(),
                "loss": out.loss.item() * len(y)}

    def compute_metrics(self, states, data) -> dict:
        n, sse = max(states["n"], 1), states["sse"]
        sst = states["syy"] - states["sy"] ** 2 / n
        return {"val_r2": 1 - sse / sst if sst > 0 else 0.0, "val_mse": sse / n, "val_loss": states["loss"] / n}

    def predict_batch(self, model, batch, data) -> list[dict]:
        return [{"value": float(v)} for v in model(**batch).logits]

    def evaluate_rows(self, y_true, y_pred, card) -> dict:
        y, p = np.asarray(y_true, np.float64), np.asarray(y_pred, np.float64)
        sst, mean = float(((y - y.mean()) ** 2).sum()) or 1.0, np.full_like(y, card.info["target_mean"])
        scores = {name: {"mse": float(((q - y) ** 2).mean()), "r2": 1 - float(((q - y) ** 2).sum()) / sst}
                  for name, q in (("model", p), ("baseline", mean))}  # baseline: the train split's mean
        return {"rows": len(y), "target": card.label_column, **scores["model"], "baseline": scores["baseline"]}

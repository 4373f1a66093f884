"""A user's own task, kept in the user's project (outside the workflows package): regression of a
numeric target on numeric feature columns of CSV/JSONL/parquet shards with a small MLP.

    model:
      task: tabular_task:TabularRegression      # importable where the stages run
      options: {features: [x1, x2, x3], target: y, hidden: 32}

Preprocessing (Ray Data) keeps the rows whose features and target are numbers, splits them by a
hash of their values (identical rows share a split) and stores them as they are, with the mean and
standard deviation of every column fitted on the train split in the manifest's `info`. Training
batches, the predictor and so serving and evaluation all standardize with those statistics
(`standardize`): one transform, no skew between training and serving.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from workflows.errors import UserError
from workflows.model_card import ModelCard
from workflows.preprocess.materialize import (
    SPLITS,
    ProcessedDataset,
    materialized,
    split_of,
    write_manifest,
    write_splits,
)
from workflows.tasks.base import Predictor, Task

FORMAT_VERSION = 2  # 2: rows stored in a seeded random order (write_splits)
WEIGHTS = "model.safetensors"


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")

    features: list[str] = Field(..., min_length=1, description="numeric feature columns")
    target: str = Field(..., description="the numeric column to predict")
    hidden: int = Field(32, ge=1, description="units per hidden layer")
    layers: int = Field(2, ge=1, le=8, description="hidden layers")

    @model_validator(mode="after")
    def _distinct(self):
        if len(set(self.features)) != len(self.features) or self.target in self.features or "split" in self.features:
            raise ValueError("features must be distinct, exclude the target and not be named 'split'")
        return self


# --- transforms shared by preprocessing, training and serving -------------------------------------
def numeric(batch: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """The columns as float64; rows with a missing or non-numeric value dropped."""
    out = batch[columns].apply(pd.to_numeric, errors="coerce").astype(np.float64)
    return out[np.isfinite(out.to_numpy()).all(axis=1)]


def with_split(batch: pd.DataFrame, columns: list[str], seed: int, val: float, test: float) -> pd.DataFrame:
    """Ray Data: numeric rows and their split, by a hash of the row's values (as the text path splits)."""
    out = numeric(batch, columns)
    out["split"] = [split_of(row.tobytes().hex(), seed, val, test) for row in out.to_numpy()]
    return out


def split_sums(batch: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Ray Data: per split of the batch, its rows and each column's sum (s<i>) and sum of squares (q<i>)."""
    values = batch[columns].to_numpy(np.float64)
    frame = pd.DataFrame({**{f"s{i}": values[:, i] for i in range(len(columns))},
                          **{f"q{i}": values[:, i] ** 2 for i in range(len(columns))}, "n": 1})
    return frame.groupby(batch["split"].to_numpy()).sum().rename_axis("split").reset_index()


def standardize(values: np.ndarray, mean: list[float], std: list[float]) -> np.ndarray:
    return ((np.asarray(values, np.float64) - mean) / std).astype(np.float32)


# --- model ---------------------------------------------------------------------------------------
@dataclass
class RegressionOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor  # (n, 1): the standardized prediction
    predictions: torch.Tensor  # (n,)


class MLP(nn.Module):
    def __init__(self, inputs: int, hidden: int, layers: int):
        super().__init__()
        dims, body = [inputs] + [hidden] * layers, []
        for a, b in zip(dims[:-1], dims[1:]):
            body += [nn.Linear(a, b), nn.GELU()]
        self.net = nn.Sequential(*body, nn.Linear(dims[-1], 1))

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> RegressionOutput:
        logits = self.net(features)
        pred = logits.squeeze(-1).clone()  # not a view of the output (FSDP2 hooks the outputs)
        loss = nn.functional.mse_loss(pred.float(), labels.float()) if labels is not None else None
        return RegressionOutput(loss=loss, logits=logits, predictions=pred)


def regression_metrics(y: np.ndarray, pred: np.ndarray) -> dict:
    err = pred - y
    sst = float(((y - y.mean()) ** 2).sum()) if len(y) else 0.0
    return {"mse": float((err**2).mean()), "mae": float(np.abs(err).mean()),
            "r2": 1.0 - float((err**2).sum()) / sst if sst > 0 else 0.0}


# --- the task ------------------------------------------------------------------------------------
class TabularRegression(Task):
    name = "tabular_regression"
    score = ("val_r2", "max")
    Options = Options

    @property
    def columns(self) -> tuple[str, ...]:  # type: ignore[override]
        return (*self.options.features, self.options.target)

    # data
    def dataset_version(self, shards, ctx) -> str:
        d, o = self.cfg.data, self.options
        key = {"format_version": FORMAT_VERSION, "task": self.name, "features": o.features, "target": o.target,
               "shards": [(s.uri, s.version, s.size) for s in shards], "val": d.val_fraction,
               "test": d.test_fraction, "split_seed": d.split_seed}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def preprocess(self, ctx, say) -> ProcessedDataset:
        from workflows.preprocess.sources import list_shards, read_dataset

        d, o = self.cfg.data, self.options
        if d.max_rows is not None:
            raise UserError(f"data.max_rows: not supported by {self.name}")
        shards, fmt = list_shards(d.source, ctx, d.format)
        version = self.dataset_version(shards, ctx)
        out_uri = self.cfg.uri("processed", version)
        if (done := materialized(out_uri, ctx, say)) is not None:
            return done
        t0, columns = time.time(), [*o.features, o.target]
        say(f"preprocess: {len(shards)} {fmt} shard(s) from {d.source} -> {out_uri}")
        rows = read_dataset(shards, fmt, ctx, self.cfg.cache, required_columns=columns).select_columns(columns)
        rows = rows.map_batches(with_split, batch_format="pandas",
                                fn_args=(columns, d.split_seed, d.val_fraction, d.test_fraction)).materialize()
        # per block sums, added up here: a few numbers per block come back, never the rows
        sums = rows.map_batches(split_sums, batch_format="pandas", fn_args=(columns,)).to_pandas()
        counts = {s: int(sums.loc[sums["split"] == s, "n"].sum()) for s in SPLITS}
        if counts["train"] < 2:
            raise UserError(f"{d.source}: {counts['train']} numeric training row(s) of {columns}")
        train = sums[sums["split"] == "train"].sum(numeric_only=True)
        mean = np.array([train[f"s{i}"] for i in range(len(columns))]) / counts["train"]
        var = np.array([train[f"q{i}"] for i in range(len(columns))]) / counts["train"] - mean**2
        std = np.where(var > 1e-12, np.sqrt(np.maximum(var, 0)), 1.0)  # a constant column stays as it is
        files = write_splits(rows, out_uri, ctx, self.cfg.preprocess.rows_per_shard, d.split_seed)
        info = {"features": o.features, "target": o.target, "mean": mean[:-1].tolist(), "std": std[:-1].tolist(),
                "target_mean": float(mean[-1]), "target_std": float(std[-1])}
        data = ProcessedDataset(uri=out_uri, version=version, labels=[], label_column=o.target, files=files,
                                counts=counts, label_counts={}, source=d.source, task=self.cfg.model.task, info=info)
        write_manifest(data, ctx, shards=[asdict(s) for s in shards], format=fmt, seconds=round(time.time() - t0, 2))
        say(f"preprocess: {sum(counts.values())} rows ({counts}) in {time.time() - t0:.1f}s")
        return data

    def collate(self, data, *, train, seed=None):
        info = data.info

        def collate(batch: dict) -> dict:
            x = np.stack([np.asarray(batch[c], np.float64) for c in info["features"]], axis=1)
            y = (np.asarray(batch[info["target"]], np.float64) - info["target_mean"]) / info["target_std"]
            return {"features": torch.from_numpy(standardize(x, info["mean"], info["std"])),
                    "labels": torch.from_numpy(y.astype(np.float32))}
        return collate

    # model
    def build_model(self, data) -> nn.Module:
        return MLP(len(data.info["features"]), self.options.hidden, self.options.layers)

    def validate(self, model, batches, device, data) -> dict:
        from workflows.train.loop import in_step
        from workflows.train.parallel import all_reduce_sum

        model.eval()
        sums = torch.zeros(4, dtype=torch.float64)  # rows, squared error, y, y^2 (standardized)
        with torch.no_grad():
            for batch in in_step(batches, device):
                y, pred = batch["labels"].double(), model(**batch).predictions.double()
                sums += torch.tensor([len(y), ((pred - y) ** 2).sum().item(), y.sum().item(), (y**2).sum().item()],
                                     dtype=torch.float64)
        n, sse, sy, syy = all_reduce_sum(sums).tolist()
        sst = syy - sy * sy / n if n else 0.0
        mse = sse / max(n, 1)
        return {"val_mse": float(mse * data.info["target_std"] ** 2), "val_r2": 1 - sse / sst if sst > 0 else 0.0,
                "val_loss": mse}  # val_mse in the target's units; val_loss, the training loss, standardized

    def export(self, state, data, out_dir, lineage) -> dict:
        from safetensors.torch import save_file

        from workflows.train.export import write_card

        model = self.build_model(data)
        model.load_state_dict(state, strict=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out_dir, WEIGHTS))
        return write_card(ModelCard(task=self.cfg.model.task, label_column=data.info["target"], lineage=lineage,
                                    hidden=self.options.hidden, layers=self.options.layers, **data.info), out_dir)

    # metrics
    def evaluate_rows(self, y_true, y_pred, card) -> dict:
        y, pred = np.asarray(y_true, np.float64), np.asarray(y_pred, np.float64)
        baseline = regression_metrics(y, np.full_like(y, card.target_mean))  # the train split's mean
        return {"rows": len(y), "target": card.label_column, **regression_metrics(y, pred),
                "baseline": {"predict": "train mean", **baseline}}

    def format_report(self, metrics: dict) -> str:
        b = metrics["baseline"]
        return "\n".join([f"{'':<24} {'MSE':>10} {'MAE':>10} {'R2':>8}",
                          f"{'model':<24} {metrics['mse']:>10.4f} {metrics['mae']:>10.4f} {metrics['r2']:>8.4f}",
                          f"{'baseline (train mean)':<24} {b['mse']:>10.4f} {b['mae']:>10.4f} {b['r2']:>8.4f}"])

    def headline(self, metrics: dict) -> tuple[str, float, str]:
        return "R2", metrics["r2"], f"train-mean baseline {metrics['baseline']['r2']:.4f}"

    # serving
    def predictor(self, model_dir, card, threads=None, precision="fp32") -> Predictor:
        return RegressionPredictor(model_dir, card, threads)

    def http_contract(self, card, max_instances):
        from workflows.serve.contract import JsonInstances

        # fields by position, named by alias: any column name ("sepal length (cm)") is a JSON key
        fields = {f"f{i}": (float, Field(..., alias=c)) for i, c in enumerate(card.features)}
        instance = create_model("Instance", __config__=ConfigDict(extra="forbid", allow_inf_nan=False), **fields)
        prediction = create_model("Prediction", value=(float, Field(..., description=f"predicted {card.target}")))
        example = {c: round(m, 3) for c, m in zip(card.features, card.mean)}
        return JsonInstances(instance, prediction, card, max_instances, example)

    def input_columns(self, card, available) -> list[str]:
        return list(card.features)

    def demo_instances(self, data, ctx, n) -> list[dict]:
        from workflows.storage.shards import read_parquet

        files = data.files.get("test") or []
        if n <= 0 or not files:
            return []
        table = read_parquet(files[0], ctx, data.info["features"])
        return [{c: float(v) for c, v in row.items()} for row in table.slice(0, n).to_pylist()]

    def describe(self, instance) -> str:
        return ", ".join(f"{k}={v:.3g}" for k, v in instance.items())[:70]


class RegressionPredictor(Predictor):
    def __init__(self, model_dir: str, card: ModelCard, threads: int | None = None):
        from safetensors.torch import load_file

        if threads:
            torch.set_num_threads(threads)
        self.card, self.input_columns = card, list(card.features)
        self.model = MLP(len(card.features), card.hidden, card.layers)
        self.model.load_state_dict(load_file(os.path.join(model_dir, WEIGHTS)))
        self.model.eval()

    @torch.inference_mode()
    def values(self, x: np.ndarray) -> np.ndarray:
        pred = self.model(torch.from_numpy(standardize(x, self.card.mean, self.card.std))).predictions.double()
        return pred.numpy() * self.card.target_std + self.card.target_mean

    def predict(self, instances) -> list[dict]:
        x = np.array([[float(row[c]) for c in self.input_columns] for row in instances], np.float64)
        return [{"value": float(v)} for v in self.values(x.reshape(len(instances), -1))]

    def predict_frame(self, batch):
        batch["prediction"] = self.values(batch[self.input_columns].to_numpy(np.float64))
        return batch

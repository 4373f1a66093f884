"""A task's optional seams: four objects, each with the platform's defaults, that a task replaces by
naming its own subclass (`Task.Dataset`, `Task.Training`, `Task.Evaluation`, `Task.Serving`) only
where a default does not fit. Each is built once per task (`task.dataset`, `task.training`,
`task.evaluation`, `task.serving`) and reads the task, its config and options through `self.task`.

- `DatasetSeam`: what `preprocess` writes and how training reads it back: the dataset's version,
  its tokenizer, a last in-memory step, a streamed training source;
- `TrainingSeam`: the model around the training loop: checks, preparation before sharding, the
  loss, the head's learning rate, epoch extras, the planner's memory spec, the padding label;
- `EvaluationSeam`: the held-out report from the predictor's output, its headline, and the numbers
  the promotion gate compares two versions by;
- `ServingSeam`: the registered artifact (`export` writes it, `predictor` loads it) and how it is
  served: the HTTP contract, Serve's deployment options, the pipeline's demo requests.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from workflows.errors import UserError
from workflows.model_card import ModelCard, write_card
from workflows.tasks.contract import HttpContract, JsonInstances
from workflows.tasks.predictor import WEIGHTS, ModelPredictor, Predictor

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from pydantic import BaseModel

    from workflows.dataset import ProcessedDataset
    from workflows.storage.uri import StorageContext
    from workflows.tasks.base import Task


class Seam:
    """One optional part of a task, built for one task instance (`self.task`)."""

    def __init__(self, task: Task):
        self.task = task

    @property
    def cfg(self):
        return self.task.cfg

    @property
    def options(self) -> Any:
        return self.task.options


class DatasetSeam(Seam):
    """The processed dataset: its version, tokenizer, and the last steps before training reads it."""

    data_version: int = 1  # part of the default `version`: bump when the task's `preprocess` changes
    # options that shape the model alone, never what `preprocess` writes: left out of the default
    # `version` (every other option enters it), so changing one reuses the processed dataset
    model_only_options: tuple[str, ...] = ()

    def version(self, shards: list, ctx: StorageContext) -> str:
        """The processed dataset's version: a hash of everything that changes what `preprocess`
        writes. Default: the raw shards (name, version, size), the split settings,
        `preprocess.rows_per_shard`, the task, its options (less `model_only_options`), its stored
        `columns` and `data_version`."""
        d = self.cfg.data
        options = self.options.model_dump(mode="json") if self.options is not None else {}
        key = {"task": self.cfg.model.task, "columns": list(self.task.columns), "data_version": self.data_version,
               "options": {k: v for k, v in options.items() if k not in self.model_only_options},
               "shards": [(s.uri, s.version, s.size) for s in shards], "val": d.val_fraction,
               "test": d.test_fraction, "split_seed": d.split_seed,
               "rows_per_shard": self.cfg.preprocess.rows_per_shard}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def tokenizer(self) -> str | None:
        """The tokenizer `preprocess` writes into a text dataset's manifest, which a dataset read back
        must name (ProcessedDataset.tokenizer_of). Default: preprocess.tokenizer."""
        return self.cfg.preprocess.tokenizer

    def tokenizer_of(self, data: ProcessedDataset) -> str:
        """The tokenizer a processed text dataset was written with, checked against this config's."""
        return data.tokenizer_of(self.tokenizer())

    def prepare(self, ds):
        """A last step on a split's Ray Dataset before training reads it (default: none)."""
        return ds

    def prepare_rows(self, rows: dict[str, Any]) -> dict[str, Any]:
        """The same step on a split's rows held in memory (torchrun, one-worker trials)."""
        return rows

    def stream_source(self, data: ProcessedDataset, storage) -> tuple[Any, Callable] | None:
        """train.loader=stream: (a loader index of the training samples, the per-sample transform
        the loader's decode processes run) when the task trains from something other than the
        processed rows; None (default): the processed training split's parquet rows."""
        return None


class TrainingSeam(Seam):
    """The model around the training loop."""

    # the integer label the task's loss ignores (Hugging Face's and torch's cross-entropy: -100): a
    # compiled training run (train.compile) pads a short batch with rows of it, to keep the compiled
    # shape. None (default, a plug-in's loss may count every row): never padded
    pad_label: int | None = None

    def check(self, data: ProcessedDataset) -> None:
        """Fail fast, on the driver, before any worker starts (default: nothing to check)."""
        return None

    def prepare_model(self, model: nn.Module, device: torch.device, probe_batches: Iterable[dict] | None) -> None:
        """Before sharding: frozen layers, a fitted head (`probe_batches`: this rank's training
        batches, None when resuming from a checkpoint). Default: nothing."""
        return None

    def needs_probe_batches(self) -> bool:
        """Whether `prepare_model` reads `probe_batches` (only then does a loader open them)."""
        return False

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The training loss of a batch, a scalar tensor averaged over its labels. Default: the
        model's forward returns it, `model(**batch).loss` (as a Hugging Face model does)."""
        return model(**batch).loss

    def head_lr(self) -> float | None:
        """Learning rate of the `classifier` head when it differs from train.lr (default: none)."""
        return None

    def epoch_extras(self, model: nn.Module, stats: dict, device: torch.device) -> dict:
        """More metrics of a training epoch (a causal LM's MFU on GPU). Default: none."""
        return {}

    def memory_spec(self):
        """(ModelSpec, sequence length) for `workflows plan`'s memory estimate of a transformer."""
        raise UserError(f"workflows plan estimates transformer models; model.task={self.cfg.model.task} has none")


class EvaluationSeam(Seam):
    """The held-out report and the numbers that compare two registered versions."""

    columns: tuple[str, ...] = ("prediction",)  # what the predictor's `predict_frame` adds that `frame` reads

    def frame(self, table, label_column: str, card: ModelCard) -> dict:
        """The held-out report of a pandas table of the label column and the `columns` the predictor
        added. Default: the task's `evaluate_rows` of the labels and the `prediction` column."""
        return self.task.evaluate_rows(table[label_column].tolist(), table["prediction"].tolist(), card)

    def report(self, metrics: dict) -> str:
        """The report `workflows evaluate` prints. Default: each number, and the baseline's."""
        base = metrics.get("baseline") or {}
        lines = [f"{k:<16} {v:>12.4f}" + (f"   baseline {base[k]:.4f}" if isinstance(base.get(k), float) else "")
                 for k, v in metrics.items() if isinstance(v, float)]
        return "\n".join(lines)

    def headline(self, metrics: dict) -> tuple[str, float, str]:
        """(name, value, comparison) of an evaluation for the pipeline's last line. Default: the
        evaluation's number named as the task's `score` without its val_ prefix."""
        key = self.task.score[0].removeprefix("val_")
        base = (metrics.get("baseline") or {}).get(key)
        return key, float(metrics[key]), f"baseline {base:.4f}" if isinstance(base, float) else ""

    def comparable_metrics(self) -> dict[str, str]:
        """The evaluation's numbers the promotion gate (`registry.promote`) may compare two versions by,
        {name: "max" | "min"} (the direction that is better), the headline's first: its default metric.
        Default: the number named as `score` without its val_ prefix; none for a task that registers
        no model (a config that turns the gate on for such a task is refused when it loads)."""
        score = self.task.score
        return {score[0].removeprefix("val_"): score[1]} if self.task.registers else {}

    def metric_value(self, metrics: dict, name: str) -> float:
        """The value of `name` (one of `comparable_metrics`) in an evaluation's metrics."""
        return float(metrics[name])


def baseline(data: ProcessedDataset) -> dict[str, str]:
    """What a card records for evaluation's baseline: a classifier's `majority_label`, the train split's
    most common label ({} for a dataset without labels). Every export of a classifier writes it."""
    train = data.label_counts.get("train") or {}
    return {"majority_label": max(train, key=train.__getitem__)} if train else {}


def held_out_rows(data: ProcessedDataset, ctx: StorageContext, columns: list[str], n: int, split: str = "val",
                  cache=None) -> list[dict]:
    """The `columns` of the first `n` rows of a split, read straight from its first file (through
    `cache`, a node's shard cache, if given): a few demo rows need no Ray Data job."""
    from workflows.storage.shards import read_parquet

    files = data.files.get(split) or []
    if n <= 0 or not files:
        return []
    return read_parquet(files[0], ctx, columns, cache).slice(0, n).to_pylist()


class ServingSeam(Seam):
    """The registered artifact, written by `export` and loaded by `predictor` (HTTP serving, batch
    inference and evaluation share it), and how it is served. The defaults read the task's `inputs`
    and `predict_batch`."""

    prediction_key: str = "value"  # the key of `predict_batch`'s dicts that evaluation scores

    def export(self, state: dict, data: ProcessedDataset, out_dir: str, lineage: dict) -> dict:
        """Write the serving artifact and its workflows.json into `out_dir`; returns the card as a
        dict. Default: the state dict (loaded into `build_model`) as model.safetensors, and a card
        with the labels, label column, dataset `info`, options and the train split's majority label."""
        from safetensors.torch import save_file

        task = self.task
        model = task.build_model(data)
        model.load_state_dict(state, strict=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out_dir, WEIGHTS))
        options = task.options.model_dump(mode="json", by_alias=True) if task.Options else {}
        return write_card(ModelCard(task=self.cfg.model.task, labels=data.labels, label_column=data.label_column,
                                    lineage=lineage, info=data.info, options=options, **baseline(data)), out_dir)

    def predictor(self, model_dir: str, card: ModelCard, threads: int | None = None,
                  precision: str = "fp32") -> Predictor:
        """The registered model in `model_dir` loaded once (default: `ModelPredictor`)."""
        return ModelPredictor(self.task.for_card(card), model_dir, card, threads)

    def prediction_model(self, card: ModelCard) -> type[BaseModel]:
        """The pydantic model of one prediction, for the OpenAPI document. Default: {"value": float}."""
        from pydantic import Field, create_model

        return create_model("Prediction", value=(float, Field(..., description=f"predicted {card.label_column}")))

    def http_contract(self, card: ModelCard, max_instances: int) -> HttpContract:
        """POST /predict's contract. Default: {"instances": [{column: value}]}, the `inputs`, each
        instance validated by a pydantic model (no other keys, no NaN), `prediction_model` answers."""
        from pydantic import ConfigDict, Field, create_model

        inputs = self.task.for_card(card).inputs()
        # fields by position, named by alias: any column name ("od280/od315") is a JSON key
        fields: dict[str, Any] = {f"f{i}": (t, Field(..., alias=c)) for i, (c, t) in enumerate(inputs.items())}
        config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
        instance = create_model("Instance", __config__=config, **fields)
        example = {c: 1.0 if t is float else t() for c, t in inputs.items()}
        return JsonInstances(instance, self.prediction_model(card), card, max_instances, example)

    def deployment_options(self) -> dict[str, Any]:
        """Ray Serve deployment options this task's replicas need beyond the app's defaults
        (workflows.serve.app.deployment_options), e.g. how many requests one replica takes at once and
        how Serve refuses more. Default: none."""
        return {}

    def input_columns(self, card: ModelCard, available: set[str]) -> list[str]:
        """The columns of a dataset's rows that the predictor reads (`available`: the dataset's)."""
        return list(self.task.for_card(card).inputs())

    def demo_instances(self, data: ProcessedDataset, ctx: StorageContext, n: int) -> list[dict]:
        """The first `n` held-out rows as request instances, for the pipeline's demo requests.
        Default: the `inputs` of the val split's first rows."""
        inputs = self.task.inputs()
        return [{c: inputs[c](v) for c, v in row.items()} for row in held_out_rows(data, ctx, list(inputs), n)]

    def describe(self, instance: Mapping[str, Any]) -> str:
        """A short text of a request instance for the pipeline's demo lines."""
        return " ".join(str(v) for v in instance.values())[:70]

    def describe_prediction(self, prediction: Mapping[str, Any]) -> str:
        """A short text of one served answer for the pipeline's demo lines. Default: its JSON, cut short."""
        return json.dumps(prediction)[:60]

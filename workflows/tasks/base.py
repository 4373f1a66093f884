"""The task seam: what a kind of model (text classification, causal LM, image classification, a
user's own) tells the stages. The stages (preprocess, train, tune, evaluate, serve, predict) call
these methods and never ask which task they run.

A task is built from the workflow config (`Task(cfg)`), in the driver and again in every Ray worker,
Tune trial, Ray Data actor and Serve replica that needs it, so it holds nothing that cannot be made
from the config (and, for serving, from the registered model's card).

What a task implements, by stage:

- config: `Options`, a pydantic model of the task's own settings (`model.options`), validated into
  `self.options` on first use (a wrong key is a UserError naming `model.options.<key>`);
- data: `preprocess` raw shards -> a ProcessedDataset (Ray Data, materialized once per version;
  workflows.dataset has the helpers to find, write and describe one),
  `dataset_version`, the stored `columns` training reads, `prepare_rows`/`prepare_dataset` for a
  last in-memory step (a causal LM packs rows into blocks);
- batches: `collate(columns, train, seed)` numpy columns -> the model's keyword tensors (the
  augmentation of the training split runs here, in the training workers);
- model: `build_model`, `prepare_model` (anything before sharding: a linear probe, frozen layers),
  `head_lr`, `export` (the registry artifact);
- training: `loss(model, batch)` (default: `model(**batch).loss`);
- metrics: `score` (the checkpoint-ranking metric), `metric_states` (a validation batch's sums and
  counts) and `compute_metrics` (val_* metrics from those states, summed over batches and ranks by
  the platform: workflows.train.loop.validate), `evaluate_rows`/`format_report` (the held-out report;
  `evaluate_frame` and `evaluation_columns` to read more of the predictor's output than its prediction);
- serving: `predictor(model_dir, card)` (shared by HTTP serving, batch inference and evaluation),
  `http_contract(card, max_instances)` (request and response models, how a body becomes instances),
  `demo_instances`, `describe` and `describe_prediction` (the pipeline's demo requests and their lines).

The abstract methods are what every task writes; the rest have defaults that a small task keeps
(`ModelPredictor`: the exported state dict loaded into `build_model` and `predict_batch` called on
collated instances; a JSON contract from the declared `inputs`). `required_methods` says which a
class must define, checked with the signatures when the task is looked up (workflows.tasks.task_class),
before Ray starts. workflows.api is the public face of this module for plug-ins.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from workflows.errors import UserError
from workflows.model_card import ModelCard, write_card
from workflows.tasks.contract import HttpContract, JsonInstances
from workflows.tasks.options import parse_options

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from pydantic import BaseModel

    from workflows.config import WorkflowConfig
    from workflows.dataset import ProcessedDataset
    from workflows.model_card import ModelCard
    from workflows.storage.uri import StorageContext


def serving_device() -> torch.device:
    """Where a predictor runs its model: the replica's GPU when it has one (Serve gives a replica with
    serve.gpus_per_replica its GPU; one without sees none), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


WEIGHTS = "model.safetensors"  # the default export's weights (ModelPredictor loads them)


@dataclass
class ModelOutput:
    """What a model's forward may return: `logits` (its raw outputs: a classifier's per-label
    scores, a regression's values) and `loss` (a scalar, given `labels`; the `loss` hook's default
    reads it). Any object with these attributes does (a Hugging Face model's output is one)."""

    logits: Any
    loss: Any = None


class MetricStates(dict):
    """What `compute_metrics` gets: each state `metric_states` returned, summed over the batches and
    ranks (numpy float64 arrays; a scalar state as a float). A state no batch produced (no
    validation batch at all) reads as 0.0."""

    def __missing__(self, key: str) -> float:
        return 0.0


class Task(abc.ABC):
    """Base class of every task: a plug-in subclasses it (or `Classification`) and names it in
    `model.task: my_module:MyTask`.

    Every task writes `preprocess`, `collate`, `build_model`, `metric_states` and `compute_metrics`
    (abstract); one that registers its model (`registers`, the default) also writes `evaluate_rows`,
    and, with the default predictor and HTTP contract, `inputs` and `predict_batch`. The model's
    forward returns an object with `.loss` (the `loss` hook's default) when the batch has `labels`.
    The other methods have defaults: override them for what they do not fit."""

    name: ClassVar[str] = ""
    columns: ClassVar[tuple[str, ...]] = ()  # the stored columns training reads (a property if options name them)
    registers: ClassVar[bool] = True  # the trained model goes to the registry and can be served
    score: ClassVar[tuple[str, str]] = ("val_f1", "max")  # checkpoint ranking: (metric, max|min)
    Options: ClassVar[type[BaseModel] | None] = None  # model.options' model; None: the task takes none
    data_version: ClassVar[int] = 1  # part of the default `dataset_version`: bump when `preprocess` changes
    # options that shape the model alone, never what `preprocess` writes: left out of the default
    # `dataset_version` (every other option enters it), so changing one reuses the processed dataset
    model_only_options: ClassVar[tuple[str, ...]] = ()
    # the integer label the task's loss ignores (Hugging Face's and torch's cross-entropy: -100): a
    # compiled training run (train.compile) pads a short batch with rows of it, to keep the compiled
    # shape. None (default, a plug-in's loss may count every row): never padded
    pad_label: ClassVar[int | None] = None
    prediction_key: ClassVar[str] = "value"  # the key of `predict_batch`'s dicts that evaluation scores
    # the columns the predictor's `predict_frame` adds that `evaluate_frame` reads
    evaluation_columns: ClassVar[tuple[str, ...]] = ("prediction",)

    def __init__(self, cfg: WorkflowConfig):
        self.cfg = cfg

    @cached_property
    def options(self) -> Any:
        """`model.options` validated by the task's `Options` model. On first use, not in __init__:
        serving builds the task from any config and reads what it needs from the model's card."""
        return parse_options(type(self), self.cfg.model.options)

    def check_config(self) -> None:
        """Fail fast, before Ray starts, on a config this task cannot run (default: its options)."""
        self.options  # noqa: B018

    @classmethod
    def required_methods(cls) -> list[str]:
        """The methods this class must define: the abstract ones, and those the defaults it keeps
        call (a model that is registered is evaluated and served)."""
        names = ["preprocess", "collate", "build_model", "metric_states", "compute_metrics"]
        if cls.registers:
            names.append("evaluate_rows")
            if cls.predictor is Task.predictor:
                names.append("predict_batch")
            if any(getattr(cls, m) is getattr(Task, m)
                   for m in ("predictor", "http_contract", "input_columns", "demo_instances")):
                names.append("inputs")
        return names

    def for_card(self, card: ModelCard) -> Task:
        """This task with the options the registered model was trained with (the default export
        writes them into the card): a serving config need not repeat them."""
        if getattr(card, "options", None) is None:
            return self
        task = type(self)(self.cfg)
        task.__dict__["options"] = parse_options(type(self), card.options)  # type: ignore[attr-defined]
        return task

    # --- data -------------------------------------------------------------------------------
    @abc.abstractmethod
    def preprocess(self, ctx: StorageContext, say: Callable[[str], None]) -> ProcessedDataset:
        """Raw shards (`data.source`) -> the processed dataset, written once per `dataset_version`
        (workflows.api.preprocess_table does it for rows of columns)."""

    def dataset_version(self, shards: list, ctx: StorageContext) -> str:
        """The processed dataset's version: a hash of everything that changes what `preprocess`
        writes. Default: the raw shards (name, version, size), the split settings,
        `preprocess.rows_per_shard`, the task, its options (less `model_only_options`), its stored
        `columns` and `data_version`."""
        d = self.cfg.data
        options = self.options.model_dump(mode="json") if self.options is not None else {}
        key = {"task": self.cfg.model.task, "columns": list(self.columns), "data_version": self.data_version,
               "options": {k: v for k, v in options.items() if k not in self.model_only_options},
               "shards": [(s.uri, s.version, s.size) for s in shards], "val": d.val_fraction,
               "test": d.test_fraction, "split_seed": d.split_seed,
               "rows_per_shard": self.cfg.preprocess.rows_per_shard}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def dataset_tokenizer(self) -> str | None:
        """The tokenizer `preprocess` writes into a text dataset's manifest, which a dataset read back
        must name (ProcessedDataset.tokenizer_of). Default: preprocess.tokenizer."""
        return self.cfg.preprocess.tokenizer

    def tokenizer_of(self, data) -> str:
        """The tokenizer a processed text dataset was written with, checked against this config's
        (ProcessedDataset.tokenizer_of)."""
        return data.tokenizer_of(self.dataset_tokenizer())

    def prepare_dataset(self, ds):
        """A last step on a split's Ray Dataset before training reads it (default: none)."""
        return ds

    def prepare_rows(self, rows: dict[str, Any]) -> dict[str, Any]:
        """The same step on a split's rows held in memory (torchrun, one-worker trials)."""
        return rows

    @abc.abstractmethod
    def collate(self, data: ProcessedDataset, *, train: bool, seed: int | None = None) -> Callable:
        """A function: a dict of numpy columns (`columns`) -> the model's keyword tensors, with
        `labels` when the label column is there (the default predictor collates served instances,
        `inputs` only, with `train=False`). `train`: the training split (augmentation, if any,
        seeded by `seed`)."""

    def stream_source(self, data: ProcessedDataset, storage) -> tuple[Any, Callable] | None:
        """train.loader=stream: (a loader index of the training samples, the per-sample transform
        the loader's decode processes run) when the task trains from something other than the
        processed rows; None (default): the processed training split's parquet rows."""
        return None

    # --- model ------------------------------------------------------------------------------
    def check(self, data: ProcessedDataset) -> None:
        """Fail fast, on the driver, before any worker starts (default: nothing to check)."""
        return None

    @abc.abstractmethod
    def build_model(self, data: ProcessedDataset) -> nn.Module:
        """The model to train, with seeded new weights (the caller seeds torch first). The default
        predictor builds it again from the card (`card_dataset`: labels, label column, info)."""

    def prepare_model(self, model: nn.Module, device: torch.device, probe_batches: Iterable[dict] | None) -> None:
        """Before sharding: frozen layers, a fitted head (`probe_batches`: this rank's training
        batches, None when resuming from a checkpoint). Default: nothing."""
        return None

    def needs_probe_batches(self) -> bool:
        """Whether `prepare_model` reads `probe_batches` (only then does a loader open them).
        Default: no."""
        return False

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The training loss of a batch, a scalar tensor averaged over its labels. Default: the
        model's forward returns it, `model(**batch).loss` (as a Hugging Face model does)."""
        return model(**batch).loss

    def memory_spec(self):
        """(ModelSpec, sequence length) for `workflows plan`'s memory estimate of a transformer."""
        raise UserError(f"workflows plan estimates transformer models; model.task={self.cfg.model.task} has none")

    def head_lr(self) -> float | None:
        """Learning rate of the `classifier` head when it differs from train.lr."""
        return None

    def export(self, state: dict, data: ProcessedDataset, out_dir: str, lineage: dict) -> dict:
        """Write the serving artifact and its workflows.json into `out_dir`; returns the card as a
        dict. Default: the state dict (loaded into `build_model`) as model.safetensors, and a card
        with the labels, label column, dataset `info`, options and the train split's majority label."""
        from safetensors.torch import save_file

        model = self.build_model(data)
        model.load_state_dict(state, strict=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out_dir, WEIGHTS))
        options = self.options.model_dump(mode="json", by_alias=True) if self.Options else {}
        return write_card(ModelCard(task=self.cfg.model.task, labels=data.labels, label_column=data.label_column,
                                    lineage=lineage, info=data.info, options=options, **baseline(data)), out_dir)

    # --- metrics ----------------------------------------------------------------------------
    @abc.abstractmethod
    def metric_states(self, model: nn.Module, batch: dict) -> Mapping[str, Any]:
        """One validation batch's metric states: sums and counts (tensors or numbers, the same keys
        and shapes for every batch), e.g. {"rows": n, "squared_error": ((pred - y) ** 2).sum()}.
        The platform runs it in eval mode without gradients and sums the states over batches and
        ranks (one all-reduce), then calls `compute_metrics` once."""

    @abc.abstractmethod
    def compute_metrics(self, states: MetricStates, data: ProcessedDataset) -> dict:
        """The val_* metrics (`score`'s among them) from the summed `metric_states`."""

    def epoch_extras(self, model: nn.Module, stats: dict, device: torch.device) -> dict:
        """More metrics of a training epoch (a causal LM's MFU on GPU). Default: none."""
        return {}

    def evaluate_rows(self, y_true: list, y_pred: list, card: ModelCard) -> dict:
        """The held-out report's metrics of predictions against the label column (`card.label_column`),
        with `rows`; a `baseline` dict of numbers, if any, is logged beside them."""
        raise NotImplementedError(f"{type(self).__name__}.evaluate_rows")

    def evaluate_frame(self, table, label_column: str, card: ModelCard) -> dict:
        """The held-out report of a pandas table of the label column and the `evaluation_columns` the
        predictor added. Default: `evaluate_rows` of the labels and the `prediction` column."""
        return self.evaluate_rows(table[label_column].tolist(), table["prediction"].tolist(), card)

    def format_report(self, metrics: dict) -> str:
        """The report `workflows evaluate` prints. Default: each number, and the baseline's."""
        base = metrics.get("baseline") or {}
        lines = [f"{k:<16} {v:>12.4f}" + (f"   baseline {base[k]:.4f}" if isinstance(base.get(k), float) else "")
                 for k, v in metrics.items() if isinstance(v, float)]
        return "\n".join(lines)

    def headline(self, metrics: dict) -> tuple[str, float, str]:
        """(name, value, comparison) of an evaluation for the pipeline's last line. Default: the
        evaluation's number named as `score` without its val_ prefix."""
        key = self.score[0].removeprefix("val_")
        base = (metrics.get("baseline") or {}).get(key)
        return key, float(metrics[key]), f"baseline {base:.4f}" if isinstance(base, float) else ""

    @classmethod
    def comparable_metrics(cls) -> dict[str, str]:
        """The evaluation's numbers the promotion gate (`registry.promote`) may compare two versions by,
        {name: "max" | "min"} (the direction that is better), the headline's first: its default metric.
        Default: the number named as `score` without its val_ prefix; none for a task that registers
        no model (a config that turns the gate on for such a task is refused when it loads)."""
        return {cls.score[0].removeprefix("val_"): cls.score[1]} if cls.registers else {}

    def metric_value(self, metrics: dict, name: str) -> float:
        """The value of `name` (one of `comparable_metrics`) in an evaluation's metrics."""
        return float(metrics[name])

    # --- serving ----------------------------------------------------------------------------
    def inputs(self) -> dict[str, type]:
        """The columns a served instance holds and their JSON types (float, int, str, bool): the
        default HTTP contract, predictor input and demo requests."""
        raise NotImplementedError(f"{type(self).__name__}.inputs")

    def predict_batch(self, model: nn.Module, batch: dict, data: ProcessedDataset) -> list[dict]:
        """The default predictor's step: the model (eval mode, no gradients) on a collated batch of
        instances -> one prediction dict per instance, `prediction_key` among its keys (what an
        HTTP answer holds; `score`, if there, is kept by batch inference too)."""
        raise NotImplementedError(f"{type(self).__name__}.predict_batch")

    def prediction_model(self, card: ModelCard) -> type[BaseModel]:
        """The pydantic model of one prediction, for the OpenAPI document. Default: {"value": float}."""
        from pydantic import Field, create_model

        return create_model("Prediction", value=(float, Field(..., description=f"predicted {card.label_column}")))

    def predictor(self, model_dir: str, card: ModelCard, threads: int | None = None,
                  precision: str = "fp32") -> Predictor:
        """The registered model in `model_dir` loaded once (default: `ModelPredictor`)."""
        return ModelPredictor(self.for_card(card), model_dir, card, threads)

    def http_contract(self, card: ModelCard, max_instances: int) -> HttpContract:
        """POST /predict's contract. Default: {"instances": [{column: value}]}, the `inputs`, each
        instance validated by a pydantic model (no other keys, no NaN), `prediction_model` answers."""
        from pydantic import ConfigDict, Field, create_model

        inputs = self.for_card(card).inputs()
        # fields by position, named by alias: any column name ("od280/od315") is a JSON key
        fields: dict[str, Any] = {f"f{i}": (t, Field(..., alias=c)) for i, (c, t) in enumerate(inputs.items())}
        config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
        instance = create_model("Instance", __config__=config, **fields)
        example = {c: 1.0 if t is float else t() for c, t in inputs.items()}
        return JsonInstances(instance, self.prediction_model(card), card, max_instances, example)

    def serve_options(self) -> dict[str, Any]:
        """Ray Serve deployment options this task's replicas need beyond the app's defaults
        (workflows.serve.app.deployment_options), e.g. how many requests one replica takes at once and
        how Serve refuses more. Default: none."""
        return {}

    def input_columns(self, card: ModelCard, available: set[str]) -> list[str]:
        """The columns of a dataset's rows that the predictor reads (`available`: the dataset's)."""
        return list(self.for_card(card).inputs())

    def demo_instances(self, data: ProcessedDataset, ctx: StorageContext, n: int) -> list[dict]:
        """The first `n` held-out rows as request instances, for the pipeline's demo requests.
        Default: the `inputs` of the val split's first rows."""
        from workflows.storage.shards import read_parquet

        inputs, files = self.inputs(), data.files.get("val") or []
        if n <= 0 or not files:
            return []
        table = read_parquet(files[0], ctx, list(inputs))
        return [{c: inputs[c](v) for c, v in row.items()} for row in table.slice(0, n).to_pylist()]

    def describe(self, instance: Mapping[str, Any]) -> str:
        """A short text of a request instance for the pipeline's demo lines."""
        return " ".join(str(v) for v in instance.values())[:70]

    def describe_prediction(self, prediction: Mapping[str, Any]) -> str:
        """A short text of one served answer for the pipeline's demo lines. Default: its JSON, cut short."""
        return json.dumps(prediction)[:60]


def baseline(data: ProcessedDataset) -> dict[str, str]:
    """What a card records for evaluation's baseline: a classifier's `majority_label`, the train split's
    most common label ({} for a dataset without labels). Every export of a classifier writes it."""
    train = data.label_counts.get("train") or {}
    return {"majority_label": max(train, key=train.__getitem__)} if train else {}


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
        batch["prediction"] = [p[self.task.prediction_key] for p in predictions]
        if predictions and "score" in predictions[0]:
            batch["score"] = [p["score"] for p in predictions]
        return batch

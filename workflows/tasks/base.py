"""The task seam: what a kind of model (text classification, causal LM, image classification, a
user's own) tells the stages. The stages (preprocess, train, tune, evaluate, serve, predict) call
it and never ask which task they run.

A task is built from the workflow config (`Task(cfg)`), in the driver and again in every Ray worker,
Tune trial, Ray Data actor and Serve replica that needs it, so it holds nothing that cannot be made
from the config (and, for serving, from the registered model's card).

What every task writes is on `Task` itself, like a Lightning module's steps:

- declarations: `name`, `Options` (a pydantic model of `model.options`, validated into
  `self.options` on first use; a wrong key is a UserError naming `model.options.<key>`), the stored
  `columns` training reads, the checkpoint-ranking `score`, whether it `registers` its model;
- the five abstract methods: `preprocess` raw shards -> a ProcessedDataset (Ray Data, materialized
  once per version; workflows.dataset has the helpers to find, write and describe one),
  `collate(columns, train, seed)` numpy columns -> the model's keyword tensors (the augmentation of
  the training split runs here), `build_model`, and the validation metrics: `metric_states` (a
  batch's sums and counts) and `compute_metrics` (val_* metrics from those states, summed over
  batches and ranks by the platform: workflows.train.loop.validate);
- a task that registers its model, with the default seams: `evaluate_rows` (the held-out report),
  `inputs` (a served instance's columns) and `predict_batch` (a collated batch -> predictions).

Everything else is optional and grouped in four seams (workflows.tasks.seams), each with defaults
that a small task keeps: `Dataset` (the dataset's version, tokenizer, last steps, a streamed
source), `Training` (checks, model preparation, loss, head learning rate, epoch extras, memory
spec, padding label), `Evaluation` (the held-out report, its headline, the numbers the promotion
gate compares) and `Serving` (the artifact's export and predictor, the HTTP contract, Serve's
options, the demo requests). A task names its own subclass of a seam where a default does not fit.

`required_methods` says which methods a class must define, checked with the signatures when the
task is looked up (workflows.tasks.task_class), before Ray starts. workflows.api is the public face
of this module for plug-ins.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from workflows.tasks.contract import HttpContract
from workflows.tasks.options import parse_options
from workflows.tasks.predictor import ModelPredictor, Predictor, card_dataset, serving_device
from workflows.tasks.seams import DatasetSeam, EvaluationSeam, ServingSeam, TrainingSeam, baseline

if TYPE_CHECKING:
    import torch.nn as nn
    from pydantic import BaseModel

    from workflows.config import WorkflowConfig
    from workflows.dataset import ProcessedDataset
    from workflows.model_card import ModelCard
    from workflows.storage.uri import StorageContext

# what a task's own modules read from here besides Task
__all__ = ["HttpContract", "MetricStates", "ModelOutput", "ModelPredictor", "Predictor", "Task", "baseline",
           "card_dataset", "serving_device"]


@dataclass
class ModelOutput:
    """What a model's forward may return: `logits` (its raw outputs: a classifier's per-label
    scores, a regression's values) and `loss` (a scalar, given `labels`; the training seam's default
    `loss` reads it). Any object with these attributes does (a Hugging Face model's output is one)."""

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

    Required: `preprocess`, `collate`, `build_model`, `metric_states` and `compute_metrics`
    (abstract); a task that registers its model (`registers`, the default) also writes
    `evaluate_rows`, and, with the default serving seam, `inputs` and `predict_batch`. The model's
    forward returns an object with `.loss` when the batch has `labels` (the training seam's default
    `loss` reads it). Optional: the four seams, `Dataset`, `Training`, `Evaluation` and `Serving`
    (workflows.tasks.seams), each a class whose defaults a task keeps unless it names its own."""

    # --- what the task declares
    name: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel] | None] = None  # model.options' model; None: the task takes none
    columns: ClassVar[tuple[str, ...]] = ()  # the stored columns training reads (a property if options name them)
    score: ClassVar[tuple[str, str]] = ("val_f1", "max")  # checkpoint ranking: (metric, max|min)
    registers: ClassVar[bool] = True  # the trained model goes to the registry and can be served

    # --- the optional seams: a subclass of one replaces its defaults
    Dataset: ClassVar[type[DatasetSeam]] = DatasetSeam
    Training: ClassVar[type[TrainingSeam]] = TrainingSeam
    Evaluation: ClassVar[type[EvaluationSeam]] = EvaluationSeam
    Serving: ClassVar[type[ServingSeam]] = ServingSeam

    def __init__(self, cfg: WorkflowConfig):
        self.cfg = cfg

    @cached_property
    def options(self) -> Any:
        """`model.options` validated by the task's `Options` model. On first use, not in __init__:
        serving builds the task from any config and reads what it needs from the model's card."""
        return parse_options(type(self), self.cfg.model.options)

    @cached_property
    def dataset(self) -> DatasetSeam:
        return self.Dataset(self)

    @cached_property
    def training(self) -> TrainingSeam:
        return self.Training(self)

    @cached_property
    def evaluation(self) -> EvaluationSeam:
        return self.Evaluation(self)

    @cached_property
    def serving(self) -> ServingSeam:
        return self.Serving(self)

    def check_config(self) -> None:
        """Fail fast, before Ray starts, on a config this task cannot run (default: its options)."""
        self.options  # noqa: B018

    @classmethod
    def required_methods(cls) -> list[str]:
        """The methods this class must define: the abstract ones, and those the default seams it keeps
        call (a model that is registered is evaluated and served)."""
        names = ["preprocess", "collate", "build_model", "metric_states", "compute_metrics"]
        if cls.registers:
            if cls.Evaluation.frame is EvaluationSeam.frame:
                names.append("evaluate_rows")
            if cls.Serving.predictor is ServingSeam.predictor:
                names.append("predict_batch")
            if any(getattr(cls.Serving, m) is getattr(ServingSeam, m)
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

    # --- required of every task ---------------------------------------------------------------
    @abc.abstractmethod
    def preprocess(self, ctx: StorageContext, say: Callable[[str], None]) -> ProcessedDataset:
        """Raw shards (`data.source`) -> the processed dataset, written once per version
        (`self.dataset.version`; workflows.api.preprocess_table does it for rows of columns)."""

    @abc.abstractmethod
    def collate(self, data: ProcessedDataset, *, train: bool, seed: int | None = None) -> Callable:
        """A function: a dict of numpy columns (`columns`) -> the model's keyword tensors, with
        `labels` when the label column is there (the default predictor collates served instances,
        `inputs` only, with `train=False`). `train`: the training split (augmentation, if any,
        seeded by `seed`)."""

    @abc.abstractmethod
    def build_model(self, data: ProcessedDataset) -> nn.Module:
        """The model to train, with seeded new weights (the caller seeds torch first). The default
        predictor builds it again from the card (`card_dataset`: labels, label column, info)."""

    @abc.abstractmethod
    def metric_states(self, model: nn.Module, batch: dict) -> Mapping[str, Any]:
        """One validation batch's metric states: sums and counts (tensors or numbers, the same keys
        and shapes for every batch), e.g. {"rows": n, "squared_error": ((pred - y) ** 2).sum()}.
        The platform runs it in eval mode without gradients and sums the states over batches and
        ranks (one all-reduce), then calls `compute_metrics` once."""

    @abc.abstractmethod
    def compute_metrics(self, states: MetricStates, data: ProcessedDataset) -> dict:
        """The val_* metrics (`score`'s among them) from the summed `metric_states`."""

    # --- required of a task that registers its model, with the default seams ------------------
    def evaluate_rows(self, y_true: list, y_pred: list, card: ModelCard) -> dict:
        """The held-out report's metrics of predictions against the label column (`card.label_column`),
        with `rows`; a `baseline` dict of numbers, if any, is logged beside them."""
        raise NotImplementedError(f"{type(self).__name__}.evaluate_rows")

    def inputs(self) -> dict[str, type]:
        """The columns a served instance holds and their JSON types (float, int, str, bool): the
        default HTTP contract, predictor input and demo requests."""
        raise NotImplementedError(f"{type(self).__name__}.inputs")

    def predict_batch(self, model: nn.Module, batch: dict, data: ProcessedDataset) -> list[dict]:
        """The default predictor's step: the model (eval mode, no gradients) on a collated batch of
        instances -> one prediction dict per instance, the serving seam's `prediction_key` among its
        keys (what an HTTP answer holds; `score`, if there, is kept by batch inference too)."""
        raise NotImplementedError(f"{type(self).__name__}.predict_batch")

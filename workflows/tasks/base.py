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
  workflows.preprocess.materialize has the helpers to find, write and describe one),
  `dataset_version`, the stored `columns` training reads, `prepare_rows`/`prepare_dataset` for a
  last in-memory step (a causal LM packs rows into blocks), `record_encoder` (preprocessing's
  per-record function, built for one process: what `workflows bench` times against the stage);
- batches: `collate(columns, train, seed)` numpy columns -> the model's keyword tensors (the
  augmentation of the training split runs here, in the training workers);
- model: `build_model`, `prepare_model` (anything before sharding: a linear probe, frozen layers),
  `head_lr`, `export` (the registry artifact);
- metrics: `score` (the checkpoint-ranking metric), `validate` (val_* metrics over all ranks),
  `evaluate_rows`/`format_report` (the held-out report);
- serving: `predictor(model_dir, card)` (shared by HTTP serving, batch inference and evaluation),
  `http_contract(card, max_instances)` (request and response models, how a body becomes instances).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from pydantic import BaseModel

    from workflows.config import WorkflowConfig
    from workflows.model_card import ModelCard
    from workflows.preprocess.materialize import ProcessedDataset
    from workflows.storage.uri import StorageContext


class Predictor:
    """A registered model loaded once: raw instances in, predictions out (one per instance).

    `predict` serves HTTP (instances as the task's request model validated them); `predict_frame`
    scores a pandas batch of stored or raw rows for batch inference and evaluation, adding the
    `prediction` (and, for classifiers, `score`) columns."""

    card: ModelCard
    input_columns: list[str]  # the columns of a row that `predict_frame` reads

    def predict(self, instances: Sequence[Mapping[str, Any]]) -> list[dict]:
        raise NotImplementedError

    def predict_frame(self, batch):
        raise NotImplementedError


class HttpContract:
    """How a served model's POST /predict body becomes instances, and its OpenAPI models.

    `parse(content_type, body)` returns the instances (dicts handed to Predictor.predict), or an
    (HTTP status, one-line message) tuple for a body that is not a valid request."""

    request_model: Any  # pydantic model of the JSON body
    response_model: Any
    errors: tuple[int, ...] = (400, 401, 413, 422, 431, 503)  # the statuses POST /predict can answer

    def parse(self, content_type: str | None, body: bytes) -> list[dict] | tuple[int, str]:
        raise NotImplementedError

    def openapi(self, document: dict, path: str) -> dict:
        """Declare the request body of POST `path` in a FastAPI-generated OpenAPI document."""
        raise NotImplementedError

    def example(self) -> dict:
        """One request body the /docs page shows."""
        raise NotImplementedError


class Task:
    """Base class of every task. Subclasses set `name` and implement the methods the stages call."""

    name: ClassVar[str] = ""
    columns: ClassVar[tuple[str, ...]] = ()  # the stored columns training reads (a property if options name them)
    registers: ClassVar[bool] = True  # the trained model goes to the registry and can be served
    score: ClassVar[tuple[str, str]] = ("val_f1", "max")  # checkpoint ranking: (metric, max|min)
    Options: ClassVar[type[BaseModel] | None] = None  # model.options' model; None: the task takes none

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

    # --- data -------------------------------------------------------------------------------
    def preprocess(self, ctx: StorageContext, say: Callable[[str], None]) -> ProcessedDataset:
        raise NotImplementedError

    def dataset_version(self, shards: list, ctx: StorageContext) -> str:
        raise NotImplementedError

    def record_encoder(self, data: ProcessedDataset) -> Callable:
        """The function `preprocess` maps over raw records on Ray Data, built here in the calling
        process: a pandas batch of raw records (as storage.shards reads the raw shards) -> processed
        rows. `data`: the dataset `preprocess` made of them (its labels). Benchmarks time the stage's
        work with it, without Ray."""
        raise NotImplementedError

    def prepare_dataset(self, ds):
        """A last step on a split's Ray Dataset before training reads it (default: none)."""
        return ds

    def prepare_rows(self, rows: dict[str, Any]) -> dict[str, Any]:
        """The same step on a split's rows held in memory (torchrun, one-worker trials)."""
        return rows

    def collate(self, data: ProcessedDataset, *, train: bool, seed: int | None = None) -> Callable:
        """A function: a dict of numpy columns (`columns`) -> the model's keyword tensors with
        `labels`. `train`: the training split (augmentation, if any, seeded by `seed`)."""
        raise NotImplementedError

    def stream_source(self, data: ProcessedDataset, storage) -> tuple[Any, Callable] | None:
        """train.loader=stream: (a loader index of the training samples, the per-sample transform
        the loader's decode processes run) when the task trains from something other than the
        processed rows; None (default): the processed training split's parquet rows."""
        return None

    # --- model ------------------------------------------------------------------------------
    def check(self, data: ProcessedDataset) -> None:
        """Fail fast, on the driver, before any worker starts (default: nothing to check)."""

    def build_model(self, data: ProcessedDataset) -> nn.Module:
        """The model to train, with seeded new weights (the caller seeds torch first)."""
        raise NotImplementedError

    def prepare_model(self, model: nn.Module, device: torch.device, probe_batches: Iterable[dict] | None) -> None:
        """Before sharding: frozen layers, a fitted head (`probe_batches`: this rank's training
        batches, None when resuming from a checkpoint). Default: nothing."""

    def memory_spec(self):
        """(ModelSpec, sequence length) for `workflows plan`'s memory estimate of a transformer."""
        from workflows.errors import UserError

        raise UserError(f"workflows plan estimates transformer models; model.task={self.cfg.model.task} has none")

    def head_lr(self) -> float | None:
        """Learning rate of the `classifier` head when it differs from train.lr."""
        return None

    def export(self, state: dict, data: ProcessedDataset, out_dir: str, lineage: dict) -> dict:
        """Write the serving artifact (safetensors weights + what the predictor needs) and its
        workflows.json into `out_dir`; returns the card as a dict."""
        raise NotImplementedError

    # --- metrics ----------------------------------------------------------------------------
    def validate(self, model: nn.Module, batches: Iterable[dict], device: torch.device,
                 data: ProcessedDataset) -> dict:
        """val_* metrics over all ranks."""
        raise NotImplementedError

    def epoch_extras(self, model: nn.Module, stats: dict, device: torch.device) -> dict:
        """More metrics of a training epoch (a causal LM's MFU on GPU). Default: none."""
        return {}

    def evaluate_rows(self, y_true: list, y_pred: list, card: ModelCard) -> dict:
        """The held-out report's metrics of predictions against the label column (`card.label_column`),
        with `rows`; a `baseline` dict of numbers, if any, is logged beside them."""
        raise NotImplementedError

    def format_report(self, metrics: dict) -> str:
        raise NotImplementedError

    def headline(self, metrics: dict) -> tuple[str, float, str]:
        """(name, value, comparison) of an evaluation for the pipeline's last line."""
        raise NotImplementedError

    # --- serving ----------------------------------------------------------------------------
    def predictor(self, model_dir: str, card: ModelCard, threads: int | None = None,
                  precision: str = "fp32") -> Predictor:
        raise NotImplementedError

    def http_contract(self, card: ModelCard, max_instances: int) -> HttpContract:
        raise NotImplementedError

    def input_columns(self, card: ModelCard, available: set[str]) -> list[str]:
        """The columns of a dataset's rows that the predictor reads (`available`: the dataset's)."""
        raise NotImplementedError

    def demo_instances(self, data: ProcessedDataset, ctx: StorageContext, n: int) -> list[dict]:
        """The first `n` held-out rows as request instances, for the pipeline's demo requests."""
        return []

    def describe(self, instance: Mapping[str, Any]) -> str:
        """A short text of a request instance for the pipeline's demo lines."""
        return " ".join(str(v) for v in instance.values())[:70]


def parse_options(task: type[Task], options: Mapping[str, Any]) -> Any:
    """`model.options` validated by `task.Options`; any error is a UserError naming the key."""
    from pydantic import ValidationError

    from workflows.errors import UserError

    name = task.name or task.__name__
    if task.Options is None:
        if options:
            raise UserError(f"model.options: task {name} takes no options (got {', '.join(map(str, options))})")
        return None
    fields = task.Options.model_fields
    known = [*fields, *(f.alias for f in fields.values() if f.alias and f.alias not in fields)]
    problems = []
    if task.Options.model_config.get("extra", "ignore") == "ignore":  # a typo is an error even so
        problems = [f"model.options.{k}: unknown option" for k in options if k not in known]
    try:
        if not problems:
            return task.Options.model_validate(dict(options))
    except ValidationError as e:
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            msg = {"extra_forbidden": "unknown option", "missing": "required option is missing"}.get(
                err["type"], err["msg"])
            if err["type"] not in ("extra_forbidden", "missing") and not isinstance(err.get("input"), dict | list):
                msg += f" (got {err.get('input')!r})"
            problems.append(f"model.options{'.' + key if key else ''}: {msg}")
    raise UserError(f"task {name}: " + "; ".join(problems) + f" (its options: {', '.join(known) or 'none'})")

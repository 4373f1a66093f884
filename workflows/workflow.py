"""The public Python API for notebooks and scripts: a `Workflow` runs the pipeline's stages one call at
a time, on the same runtime and with the same code as the commands, and returns what each produced as
typed values with tables as pandas DataFrames. (`workflows.api` is the other public API: for task
plug-ins.)

    from workflows.workflow import Workflow

    with Workflow.from_config("quickstart", ["name=nb", "registry.name=nb"]) as wf:
        data = wf.preprocess()                    # ProcessedDataset: counts, label_counts, ...
        tuned = wf.tune()                         # TuneResult: .trials, .curves, .best_params
        trained = wf.train(tuned.best_params)     # TrainResult: .history, .step_losses
        ref = wf.register()                       # ModelRef: name, version, uri
        report = wf.evaluate("test")              # Evaluation: .per_class, .confusion_matrix
        endpoint = wf.serve()                     # Endpoint: .url, .predict(instances)

A stage's lines (and Ray's) print as the command's do; its summary goes to
`<output_dir>/<name>/<stage>.json` and its tracking run to MLflow, as the command's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import requests

from workflows import registry
from workflows.cluster_state import metric_samples
from workflows.config import WorkflowConfig, load_config
from workflows.dataset import ProcessedDataset, SplitRows
from workflows.errors import UserError
from workflows.pipeline.stages import (
    Trained,
    ensure_raw_data,
    model_split,
    stage_evaluate,
    stage_preprocess,
    stage_register,
    stage_serve,
    stage_train,
    stage_tune,
)
from workflows.preprocess.encoding import resolve_model_dir
from workflows.preprocess.sources import list_shards, read_dataset
from workflows.runtime import Runtime, runtime
from workflows.serve.guards import bearer_token
from workflows.storage.shards import read_parquet
from workflows.tasks import get_task, task_for_card
from workflows.tune.search import TuneOutcome

__all__ = ["Endpoint", "Evaluation", "TrainResult", "TuneResult", "Workflow"]


def _short(value: Any) -> Any:
    """Floats to 4 significant digits, in dicts and tuples too: for the results' reprs."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_short(v) for v in value)
    return value


def _repr(obj: Any, **fields: Any) -> str:
    return f"{type(obj).__name__}({', '.join(f'{k}={_short(v)!r}' for k, v in fields.items())})"


@dataclass
class TuneResult:
    """A search's outcome: the best parameters (what `Workflow.train` takes) and every trial."""

    best_params: dict[str, Any]
    best_metric: float
    metric: str  # tune.metric (the task's own when the config names none)
    trials: pd.DataFrame = field(repr=False)  # one row a trial: its parameters, metric, epochs, how it ended
    curves: pd.DataFrame = field(repr=False)  # one row a trial and epoch: trial, epoch, <metric>
    seconds: float = 0.0
    outcome: TuneOutcome | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return _repr(self, best_params=self.best_params, best_metric=self.best_metric, metric=self.metric,
                     trials=len(self.trials), seconds=self.seconds)


@dataclass
class TrainResult:
    """A training run: its epochs and steps, and the checkpoint chosen for registering."""

    run_uri: str
    best_metrics: dict[str, Any]  # the chosen epoch's (train.checkpoint_select)
    history: pd.DataFrame = field(repr=False)  # one row an epoch: train_loss, val_* metrics, throughput
    step_losses: pd.DataFrame = field(repr=False)  # one row an optimizer step: step, epoch, loss
    seconds: float = 0.0
    trained: Trained | None = field(default=None, repr=False)  # what the register stage takes

    def __repr__(self) -> str:
        chosen = {k: v for k, v in self.best_metrics.items()
                  if k in ("epoch", "train_loss") or (k.startswith("val_") and k != "val_seconds")}
        return _repr(self, run_uri=self.run_uri, epochs=len(self.history), chosen=chosen, seconds=self.seconds)


@dataclass
class Evaluation:
    """A registered model scored on labelled rows: the task's report (`metrics`, as the evaluate
    command's JSON), with a classifier's per-class scores and confusion matrix as DataFrames."""

    model: str  # NAME:VERSION
    split: str
    rows: int
    headline: tuple[str, float, str]  # (name, value, what it is against), as the pipeline's last line
    metrics: dict[str, Any] = field(repr=False)
    per_class: pd.DataFrame | None = field(default=None, repr=False)  # precision, recall, f1, support per label
    confusion_matrix: pd.DataFrame | None = field(default=None, repr=False)  # rows: true label, columns: predicted

    def __repr__(self) -> str:
        return _repr(self, model=self.model, split=self.split, rows=self.rows, headline=self.headline)


@dataclass
class Endpoint:
    """A model served by Ray Serve: its base URL and a small client (with the bearer token of
    `serve.auth_token_env`, when the config names one)."""

    url: str
    model: str  # NAME:VERSION
    route: str = "/predict"  # the route a user calls first (the task's HTTP contract)
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    timeout: float = field(default=60.0, repr=False)

    def get(self, path: str = "/healthz") -> requests.Response:
        resp = requests.get(f"{self.url}{path}", headers=self.headers, timeout=self.timeout)
        resp.raise_for_status()
        return resp

    def post(self, path: str, **kwargs: Any) -> requests.Response:
        """POST to a route (`json=`, `data=`, `files=` as in requests); raises on an error status."""
        headers = {**self.headers, **kwargs.pop("headers", {})}
        resp = requests.post(f"{self.url}{path}", headers=headers, timeout=self.timeout, **kwargs)
        resp.raise_for_status()
        return resp

    def predict(self, instances: Sequence[dict]) -> dict[str, Any]:
        """POST /predict {"instances": [...]}: the answer (`predictions`, one per instance, `model`, `version`)."""
        return self.post("/predict", json={"instances": list(instances)}).json()


def _trials(outcome: TuneOutcome) -> tuple[pd.DataFrame, pd.DataFrame]:
    metric = outcome.trials[0].metric if outcome.trials else "metric"
    trials = pd.DataFrame([{"trial": t.trial, **t.params, metric: t.value, "best": t.best, "epochs": t.epochs,
                            "stopped_early": t.stopped_early, "error": t.error} for t in outcome.trials])
    curves = pd.DataFrame([{"trial": t.trial, "epoch": h["training_iteration"], metric: h.get(metric)}
                           for t in outcome.trials for h in t.history], columns=["trial", "epoch", metric])
    return trials, curves


def _epochs(history: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    epochs = pd.DataFrame(history).drop(columns=["step_losses"], errors="ignore")
    steps = pd.DataFrame([{"epoch": h.get("epoch"), "loss": loss}
                          for h in history for loss in h.get("step_losses", [])], columns=["epoch", "loss"])
    steps.insert(0, "step", range(1, len(steps) + 1))
    return epochs, steps


def _report(spec: str, split: str, metrics: dict, headline: tuple[str, float, str]) -> Evaluation:
    per_class = pd.DataFrame(metrics["per_class"]).T if "per_class" in metrics else None
    confusion = None
    if "confusion_matrix" in metrics:
        labels = metrics["confusion_matrix"]["labels"]
        confusion = pd.DataFrame(metrics["confusion_matrix"]["matrix"], index=pd.Index(labels, name="true"),
                                 columns=pd.Index(labels, name="predicted"))
    return Evaluation(spec, split, metrics["rows"], headline, metrics, per_class, confusion)


class Workflow:
    """One config's pipeline, stage by stage, inside one runtime (the object store, Ray, tracking):
    `with Workflow.from_config(...) as wf:`, or `wf.start()` ... `wf.close()` across notebook cells.
    Each stage method returns what it produced and keeps it for the next (`data`, `trained`, `model`)."""

    def __init__(self, cfg: WorkflowConfig):
        self.cfg = cfg
        self._stack: ExitStack | None = None
        self._rt: Runtime | None = None
        self.data: ProcessedDataset | None = None
        self.trained: TrainResult | None = None
        self.model: registry.ModelRef | None = None
        self.endpoint: Endpoint | None = None

    @classmethod
    def from_config(cls, config: str | os.PathLike = "quickstart", overrides: Iterable[str] = ()) -> Workflow:
        """A config file or a shipped config's name, with `--set`-style `key=value` overrides."""
        return cls(load_config(config, list(overrides)))

    def __repr__(self) -> str:
        state = "started" if self._rt is not None else "not started"
        return f"Workflow({self.cfg.name!r}, task={self.cfg.model.task!r}, {state})"

    # --- the runtime -----------------------------------------------------------------------------
    def start(self) -> Workflow:
        """Start the runtime: the embedded S3 endpoint (if configured), Ray (or join `ray.address`), tracking."""
        if self._rt is None:
            stack = ExitStack()
            self._rt = stack.enter_context(runtime(self.cfg))
            self._stack = stack
        return self

    def close(self) -> None:
        """Stop what was served, Ray, and the runtime (its store persisted on disk)."""
        import ray
        from ray import serve

        if self._stack is None:
            return
        try:
            if self.endpoint is not None:
                serve.shutdown()
                self.endpoint = None
        finally:
            stack, self._stack, self._rt = self._stack, None, None
            stack.close()
            if ray.is_initialized():  # a cluster this process joined
                ray.shutdown()

    def __enter__(self) -> Workflow:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def runtime(self) -> Runtime:
        """The running session (`rt.cfg`: the config with the embedded endpoint's URL; `rt.storage`)."""
        if self._rt is None:
            raise UserError("the workflow is not started: use `with Workflow(...) as wf:` or wf.start()")
        return self._rt

    def _data(self) -> ProcessedDataset:
        return self.data if self.data is not None else self.preprocess()

    # --- data ------------------------------------------------------------------------------------
    def raw_shards(self) -> pd.DataFrame:
        """The raw shards at `data.source` (the built-in dataset built there first, where asked for)."""
        rt = self.runtime
        ensure_raw_data(rt)
        shards, fmt = list_shards(rt.cfg.data.source, rt.storage, rt.cfg.data.format)
        return pd.DataFrame([{"shard": s.uri, "bytes": s.size, "format": fmt} for s in shards])

    def raw_rows(self, n: int = 5) -> pd.DataFrame:
        """The first `n` rows of the first raw shard, as the task reads them (any format)."""
        rt = self.runtime
        ensure_raw_data(rt)
        shards, fmt = list_shards(rt.cfg.data.source, rt.storage, rt.cfg.data.format)
        return read_dataset(shards[:1], fmt, rt.storage, rt.cfg.cache).limit(n).to_pandas()

    def preprocess(self) -> ProcessedDataset:
        """The raw shards -> the processed dataset (reused when this version is stored already)."""
        self.data = stage_preprocess(self.runtime)
        return self.data

    def rows(self, split: str = "train", n: int = 5) -> pd.DataFrame:
        """The first `n` stored rows of a split of the processed dataset (what the model trains on)."""
        data = self._data()
        files = data.files.get(split) or []
        if not files:
            raise UserError(f"processed dataset {data.version} has no rows in split {split!r}")
        # by rows: a tensor column's cells are numpy arrays (a table's to_pandas would wrap them)
        return pd.DataFrame(read_parquet(files[0], self.runtime.storage).slice(0, n).to_pylist())

    def tokenizer(self):
        """The processed dataset's tokenizer (a text task's), to read stored token ids."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(resolve_model_dir(get_task(self.cfg).dataset.tokenizer_of(self._data())))

    # --- tune, train, register -------------------------------------------------------------------
    def tune(self, resume: bool = False) -> TuneResult:
        """The hyperparameter search (`tune.*`) on the processed dataset."""
        outcome = stage_tune(self.runtime, self._data(), resume=resume)
        trials, curves = _trials(outcome)
        metric = outcome.trials[0].metric if outcome.trials else str(self.cfg.tune.metric)
        return TuneResult(outcome.best_params, outcome.best_metric, metric, trials, curves, outcome.seconds, outcome)

    def train(self, params: dict[str, Any] | None = None, resume: bool = False) -> TrainResult:
        """Train with `params` (a search's `best_params`) over the config's values."""
        trained = stage_train(self.runtime, self._data(), params, resume=resume)
        history, steps = _epochs(trained.outcome.history)
        self.trained = TrainResult(trained.outcome.run_uri, trained.outcome.best_metrics, history, steps,
                                   trained.outcome.seconds, trained)
        return self.trained

    def register(self, trained: TrainResult | None = None) -> registry.ModelRef:
        """Register the chosen checkpoint of `trained` (default: the last `train`) as `registry.name`'s next version."""
        trained = trained or self.trained
        if trained is None or trained.trained is None:
            raise UserError("nothing trained to register: call wf.train() first")
        ref = stage_register(self.runtime, self._data(), trained.trained)
        if ref is None:
            raise UserError(f"model.task={self.cfg.model.task} registers no model")
        self.model = ref
        return ref

    def _spec(self, model: str | None) -> str:
        if model is not None:
            return model
        if self.model is None:
            raise UserError("no model named and none registered here: pass model='NAME[:VERSION]'")
        return f"{self.model.name}:{self.model.version}"

    # --- evaluate, serve -------------------------------------------------------------------------
    def evaluate(self, split: str = "test", model: str | None = None, write_back: bool = False) -> Evaluation:
        """Score a registered model (default: the one registered here) on a split of the processed
        dataset it was trained on; `write_back` stores the metrics with the version (as the pipeline
        does with the held-out split's)."""
        rt = self.runtime
        spec = self._spec(model)
        card, _, data = model_split(rt.cfg, rt.storage, spec, split)
        metrics = stage_evaluate(rt, spec, SplitRows(data, split, rt.storage, rt.cfg.cache), write_back=write_back,
                                 card=card)
        headline = task_for_card(rt.cfg, card).evaluation.headline(metrics)
        return _report(f"{card.name}:{card.version}", split, metrics, headline)

    def serve(self, model: str | None = None) -> Endpoint:
        """Deploy a registered model (default: the one registered here) on Ray Serve at `serve.host:serve.port`."""
        rt = self.runtime
        served = stage_serve(rt, self._spec(model))
        token = bearer_token(rt.cfg.serve)
        self.endpoint = Endpoint(served["url"], served["model"], served["route"],
                                 {"Authorization": f"Bearer {token}"} if token else {})
        return self.endpoint

    # --- the cluster's metrics -------------------------------------------------------------------
    def metrics(self, prefix: str = "ray_workflows_", wait_for: Iterable[str] = (),
                timeout: float = 60) -> pd.DataFrame:
        """The Prometheus samples named `prefix`* of every live Ray node (its metrics export port): one
        row a sample (name, labels, value). Ray exports every few seconds: `wait_for` names metrics
        to wait for, up to `timeout` seconds."""
        _ = self.runtime  # started
        wanted, deadline = set(wait_for), time.time() + timeout
        while True:
            frame = pd.DataFrame(metric_samples(prefix), columns=["name", "labels", "value", "node"])
            if wanted <= set(frame["name"]) or time.time() > deadline:
                return frame
            time.sleep(2)

    def summaries(self) -> list[Path]:
        """The stages' JSON summaries written so far (`<output_dir>/<name>/*.json`)."""
        return sorted((Path(self.cfg.output_dir) / self.cfg.name).glob("*.json"))

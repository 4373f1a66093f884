"""Ray Tune with ASHA: each trial trains one sampled config and reports every epoch.

A one-worker trial runs the training loop in its own Tune actor (tune/trial.py); a trial of more
workers is a Ray Train run (a driver function that builds and fits a TorchTrainer with
TuneReportCallback: `Tuner(TorchTrainer(...))` no longer works in Ray 2.60). Trials read the
already materialized dataset: nothing is re-tokenized per trial.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workflows.cluster_state import cluster_resources
from workflows.config import SearchDim, WorkflowConfig
from workflows.config.tune import OPTION_PREFIX
from workflows.dataset import ProcessedDataset
from workflows.errors import UserError
from workflows.storage.uri import StorageContext, pyarrow_filesystem
from workflows.tasks import get_task
from workflows.tracking.run_logger import TrackingSpec
from workflows.tune.state import check_tuner_state, remember_tuner_state

if TYPE_CHECKING:
    from ray.tune import Result


def to_tune_space(space: dict[str, SearchDim]) -> dict[str, Any]:
    from ray import tune

    out = {}
    for key, dim in space.items():
        if dim.uniform is not None:
            out[key] = tune.uniform(*dim.uniform)
        elif dim.loguniform is not None:
            out[key] = tune.loguniform(*dim.loguniform)
        elif dim.choice is not None:
            out[key] = tune.choice(dim.choice)
        else:
            out[key] = tune.grid_search(dim.grid or [])
    return out


def trial_config(cfg: WorkflowConfig, params: dict[str, Any]) -> WorkflowConfig:
    """The workflow config of one trial: the sampled train.* values, the trial budget."""
    data = cfg.model_dump(mode="json")
    for key, value in params.items():
        if key.startswith(OPTION_PREFIX):
            data["model"]["options"][key.removeprefix(OPTION_PREFIX)] = value
        else:
            data["train"][key.removeprefix("train.")] = value
    t = cfg.tune
    data["train"].update(epochs=t.max_epochs, num_workers=t.num_workers, num_to_keep=1, max_failures=0)
    for cap in ("max_train_rows", "max_val_rows"):
        if getattr(t, cap) is not None:
            data["train"][cap] = getattr(t, cap)
    return WorkflowConfig.model_validate(data)


def with_task_metric(cfg: WorkflowConfig) -> WorkflowConfig:
    """`cfg` with tune.metric and tune.mode set: unset, they are the task's checkpoint metric (Task.score)."""
    t = cfg.tune
    if t.metric is not None and t.mode is not None:
        return cfg
    metric, mode = get_task(cfg).score
    chosen = t.metric or metric
    tune = t.model_copy(update={"metric": chosen, "mode": t.mode or (mode if chosen == metric else "max")})
    return cfg.model_copy(update={"tune": tune})


def max_concurrent_trials(cfg: WorkflowConfig) -> int:
    """As many trials as the cluster's CPUs hold at once; at least 1, or fail fast."""
    cpus = cluster_resources().get("CPU", 0)
    per_trial = cfg.tune.num_workers * cfg.train.cpus_per_worker
    if per_trial > cpus:
        raise UserError(
            f"a tune trial asks for {cfg.tune.num_workers} worker(s) x {cfg.train.cpus_per_worker:g} CPU "
            f"= {per_trial:g} CPUs, "
            f"but the Ray cluster has {cpus:g}; lower tune.num_workers or train.cpus_per_worker"
        )
    return max(1, math.floor(cpus / per_trial))


def _trial(params: dict, cfg: WorkflowConfig, storage: StorageContext, data: ProcessedDataset,
           tracking: TrackingSpec | None = None) -> None:
    from workflows.train.trainer import fit
    from workflows.tune.epoch_reports import EpochReports
    from workflows.tune.trial import run_local_trial, trial_logger

    if cfg.tune.num_workers == 1:
        # Tune reuses this actor for the next trial only if this function's thread ends within
        # TUNE_FUNCTION_THREAD_TIMEOUT_S (2 s) of the trial's stop; on a busy 2-core node it may
        # not, and a failed reuse errors the next trial. Its reset_config reads the variable in
        # this process, after this function first ran.
        os.environ.setdefault("TUNE_FUNCTION_THREAD_TIMEOUT_S", "60")
        run_local_trial(trial_config(cfg, params), storage, data, tracking)
        return
    # a Ray Train trial: this driver creates the trial's run, its rank 0 logs the epochs into it
    # (how a trial stopped early is marked by the tune stage: tracking.stages.log_tune)
    trial_cfg = trial_config(cfg, params)
    with trial_logger(trial_cfg, tracking, data.version) as logger:
        fit(trial_cfg, storage, data, run_prefix=f"{cfg.name}-trial",
            callbacks=[EpochReports()], check=False, tracking=logger.child_spec() if logger else None)


def trial_resources(cfg: WorkflowConfig):
    """A one-worker trial trains in its own actor, which asks for the worker's CPU (and GPU). A
    Ray Train trial's driver only waits on its TorchTrainer: it asks for no CPU (a bundle may not
    be empty, so 1 MiB of memory instead); its workers ask for their own CPUs."""
    from ray import tune

    tc = cfg.train
    if cfg.tune.num_workers == 1:
        return tune.PlacementGroupFactory([{"CPU": tc.cpus_per_worker, **({"GPU": 1} if tc.use_gpu else {})}])
    return tune.PlacementGroupFactory([{"memory": 1 << 20}])


def trial_count(cfg: WorkflowConfig) -> int:
    """Trials the search runs: num_samples times the product of the grid dimensions' sizes."""
    return cfg.tune.num_samples * math.prod(len(d.grid) for d in cfg.tune.space.values() if d.grid is not None)


def search_algorithm(cfg: WorkflowConfig, concurrency: int):
    """Random/grid sampling, or Optuna's TPE; either capped at `concurrency` trials at once
    (a search algorithm ignores TuneConfig.max_concurrent_trials)."""
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    t = cfg.tune
    if t.search == "random":
        return BasicVariantGenerator(random_state=t.seed, max_concurrent=concurrency)
    grids = [k for k, d in t.space.items() if d.grid is not None]
    if grids:
        raise UserError(f"tune.search=optuna samples; it cannot expand grid dimension(s) {grids}: use choice instead")
    try:
        import optuna
        from ray.tune.search.optuna import OptunaSearch
    except ImportError:
        raise UserError("tune.search=optuna needs Optuna: pip install optuna (or: pip install -e '.[tune]')") from None
    sampler = optuna.samplers.TPESampler(seed=t.seed)
    return ConcurrencyLimiter(OptunaSearch(sampler=sampler, metric=t.metric, mode=t.mode), max_concurrent=concurrency)


def _best(history, metric: str, mode: str) -> float | None:
    """The best value a trial reached at any epoch (its last one need not be its best)."""
    if history is None or metric not in history or not len(history):
        return None
    values = history[metric].dropna()
    return float(values.max() if mode == "max" else values.min()) if len(values) else None


def _trial_seconds(history) -> dict[str, float]:
    """Where a trial's time went, from its epoch reports: training steps, validation, checkpoints,
    and (one-worker trials) reading its rows and building the model before the first epoch."""
    out: dict[str, float] = {}
    if history is None or not len(history):
        return out
    for key, column in (
        ("train_steps", "epoch_seconds"),
        ("validation", "val_seconds"),
        ("checkpoint", "checkpoint_seconds"),
    ):
        if column in history:
            out[key] = round(float(history[column].fillna(0).sum()), 3)
    for key, column in (("read_rows", "read_seconds"), ("startup", "startup_seconds")):
        if column in history:
            out[key] = round(float(history[column].iloc[0]), 3)
    return out


@dataclass
class TrialResult:
    """One trial of a search, as the reports and tune.json show it."""

    trial: int  # place in Tune's list of trials (order of creation), as the live lines number it
    params: dict[str, Any]  # the sampled train.* values
    metric: str  # tune.metric
    value: float | None  # the metric at the trial's last epoch
    best: float | None  # its best value at any epoch (the last one need not be the best)
    epochs: int
    stopped_early: bool  # by the scheduler (ASHA), before tune.max_epochs
    error: str | None  # the first line of the trial's error
    history: list[dict[str, Any]] = field(default_factory=list)  # {training_iteration, <metric>} per epoch
    seconds: dict[str, float] = field(default_factory=dict)  # where its time went (_trial_seconds)
    trial_id: str | None = None  # Tune's id (the trial's MLflow run carries it as tag ray.trial_id)


@dataclass
class TuneOutcome:
    best_params: dict[str, Any]
    best_metric: float
    trials: list[TrialResult] = field(default_factory=list)
    experiment_uri: str = ""
    seconds: float = 0.0
    concurrency: int = 1  # trials at once


def run_tune(cfg: WorkflowConfig, storage: StorageContext, data: ProcessedDataset, resume: bool = False,
             tracking: TrackingSpec | None = None) -> TuneOutcome:
    import ray.tune
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from workflows.progress import TrialProgress

    experiment = f"{cfg.name}-tune"
    runs_uri = cfg.uri("tune")
    if resume:  # before anything of it is read: Tuner.restore unpickles it
        check_tuner_state(cfg, f"{runs_uri}/{experiment}", storage)
    cfg = with_task_metric(cfg)
    t = cfg.tune
    metric, mode = t.metric, t.mode
    assert metric is not None and mode is not None  # with_task_metric set both
    if not t.space:
        raise UserError("tune.space is empty: add at least one train.* dimension")
    concurrency = max_concurrent_trials(cfg)
    pa_fs, runs_path = pyarrow_filesystem(runs_uri, storage)
    trainable = tune.with_resources(tune.with_parameters(_trial, cfg=cfg, storage=storage, data=data,
                                                         tracking=tracking),
                                    trial_resources(cfg))
    t0 = time.time()
    if resume:
        path = f"{runs_path}/{experiment}"
        if not tune.Tuner.can_restore(path, storage_filesystem=pa_fs):
            raise UserError(f"--resume: no tuning experiment to restore at {runs_uri}/{experiment}")
        tuner = tune.Tuner.restore(path, trainable=trainable, storage_filesystem=pa_fs, resume_errored=True)
    else:
        scheduler = ASHAScheduler(
            time_attr="training_iteration", max_t=t.max_epochs,
            grace_period=min(t.grace_period, t.max_epochs), reduction_factor=t.reduction_factor,
        ) if t.scheduler == "asha" else FIFOScheduler()
        tuner = tune.Tuner(
            trainable,
            param_space=to_tune_space(t.space),
            tune_config=tune.TuneConfig(
                metric=t.metric, mode=t.mode, scheduler=scheduler, num_samples=t.num_samples,
                search_alg=search_algorithm(cfg, concurrency),
                # a finished one-worker trial's actor runs the next one: torch, the tokenizer
                # and the model files are loaded once per process, not once per trial. Not for
                # Ray Train trials: their driver loads nothing, and the seconds it spends tearing
                # down its run after the last report fail the reuse, which errors the next trial
                # and leaves Tune waiting 600 s for it (Ray 2.60's BasicVariantGenerator).
                reuse_actors=t.num_workers == 1,
            ),
            run_config=ray.tune.RunConfig(
                name=experiment, storage_path=runs_path, storage_filesystem=pa_fs,
                failure_config=ray.tune.FailureConfig(max_failures=1), verbose=0,
                # a trial resumes from its latest epoch: older checkpoints are only bytes to store
                checkpoint_config=ray.tune.CheckpointConfig(num_to_keep=1),
                callbacks=[TrialProgress(metric, mode, trial_count(cfg), t.max_epochs)],
            ),
        )
        remember_tuner_state(cfg, f"{runs_uri}/{experiment}", storage)  # the tuner.pkl it just wrote
    grid = tuner.fit()
    best = grid.get_best_result(metric=t.metric, mode=t.mode)
    trials = []
    results: list[Result] = [grid[i] for i in range(len(grid))]
    for number, r in enumerate(results, 1):  # Tune's order of creation, as TrialProgress numbers them
        history = r.metrics_dataframe
        epochs = int(history["training_iteration"].max()) if history is not None and len(history) else 0
        trials.append(TrialResult(
            trial=number, trial_id=(r.metrics or {}).get("trial_id"),
            params={k: (r.config or {}).get(k) for k in t.space}, metric=metric,
            value=(r.metrics or {}).get(metric), best=_best(history, metric, mode), epochs=epochs,
            stopped_early=epochs < t.max_epochs and r.error is None,
            error=str(r.error).splitlines()[0] if r.error else None,
            history=history[["training_iteration", t.metric]].to_dict("records")
            if history is not None and t.metric in history else [],
            seconds=_trial_seconds(history),
        ))
    return TuneOutcome(
        best_params={k: (best.config or {})[k] for k in t.space}, best_metric=float((best.metrics or {})[t.metric]),
        trials=trials, experiment_uri=f"{runs_uri}/{experiment}", seconds=time.time() - t0, concurrency=concurrency,
    )

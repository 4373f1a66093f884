"""The stages, each usable alone (one CLI command each) and chained by `workflows.pipeline.run_pipeline`.

A stage takes what the stages before it produced as values and returns what it produces: the
processed dataset, the search's outcome (its best parameters), the training's outcome, the registered
model's reference, the evaluation's metrics, the served endpoint. Each runs in one `stage` frame,
which holds what every stage shares: its tracking run, the shard-cache counts of its work on the
cluster, the store made durable after it, and its summary (<stage>.json)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workflows import registry
from workflows.config import WorkflowConfig
from workflows.console import show
from workflows.dataset import SPLITS, ProcessedDataset
from workflows.errors import UserError, surface_user_errors
from workflows.runtime import Runtime, say, warn
from workflows.storage.uri import StorageContext, protocol_of
from workflows.tasks import check_card_task, get_task, task_for_card
from workflows.tracking import stages as tracking

if TYPE_CHECKING:
    from workflows.train.trainer import TrainOutcome


@dataclass
class Stage:
    """A running stage: its runtime (with the config the stage runs with), its tracking run, and the
    summary it writes when it ends (what the stage puts in `summary`)."""

    rt: Runtime
    run: Any  # workflows.tracking.session.Run
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def cfg(self) -> WorkflowConfig:
        return self.rt.cfg

    @property
    def out_dir(self) -> Path:
        """Where the stage's summary and its files (plots, tables) go."""
        return Path(self.cfg.output_dir) / self.cfg.name

    @contextmanager
    def work(self) -> Iterator[None]:
        """The stage's work on the cluster: the shard cache's counts while it runs go into the
        summary (`shard_cache`), and what it produced is made durable (`Runtime.persist`) after it."""
        with self.rt.cache_counts() as cache:
            yield
        self.summary["shard_cache"] = cache
        self.rt.persist()


@contextmanager
def stage(rt: Runtime, name: str, cfg: WorkflowConfig | None = None) -> Iterator[Stage]:
    """The frame of the stage `name`: a tracking run with the stage's config as params and, when the
    block ends without an error, <name>.json of its `Stage.summary` (none where the block reports
    nothing: evaluate's command writes its own). `cfg`: the config the stage runs with when it is not
    the runtime's (tune's with its metric, train's with tuned values); the caller's runtime keeps its own."""
    rt = rt if cfg is None else replace(rt, cfg=cfg)
    with tracking.tracked(rt, name) as run:
        s = Stage(rt, run)
        yield s
        if s.summary:
            rt.write_summary(name, s.summary)


# --- preprocess ----------------------------------------------------------------------------------
def builtin_dataset(name: str, cfg: WorkflowConfig):
    """(what it is, build() -> (rows, {skipped module: why}), write_shards(rows, uri, ctx) -> URIs)
    of a built-in dataset."""
    if name == "digits":
        from workflows.preprocess import digits_data

        return ("scikit-learn's bundled handwritten digits as PNGs", lambda: (digits_data.build(), {}),
                digits_data.write_shards)
    if name == "chat":
        from workflows.preprocess import chat_data

        return ("the seeded synthetic instruction set", lambda: (chat_data.build(cfg.data.builtin_rows_per_class), {}),
                chat_data.write_shards)
    from workflows.preprocess import quickstart_data

    def build():
        built = quickstart_data.build_dataset(cfg.data.builtin_rows_per_class)
        return built.rows, built.skipped

    return "the quickstart dataset from installed libraries' docstrings", build, quickstart_data.write_shards


def ensure_raw_data(rt: Runtime) -> dict[str, Any]:
    """Build the built-in dataset into `data.source` when asked for and nothing is there yet (no
    shard matched: a store that cannot be reached or read, or shards of mixed formats, is an error
    as it is, with nothing built)."""
    from workflows.preprocess.sources import NoShards, list_shards

    d = rt.cfg.data
    if d.builtin is None:
        return {"built": False}
    try:
        shards, _ = list_shards(d.source, rt.storage, d.format)
        return {"built": False, "shards": len(shards)}
    except NoShards as e:
        # a user's own bucket or directory that is empty by mistake must not fill up with demo data
        in_embedded = protocol_of(d.source) in ("s3", "s3a") and rt.storage.for_uri(d.source).embedded
        if not (d.write_builtin or in_embedded):
            raise UserError(f"{e}; data.builtin={d.builtin} is built only into the embedded store: "
                            "point data.source at your data (and set data.builtin=null), or set "
                            "data.write_builtin=true to build it there") from None
    what, build, write_shards = builtin_dataset(d.builtin, rt.cfg)
    say(f"data: building {what} -> {d.source}")
    t0 = time.time()
    rows, skipped = build()
    uris = write_shards(rows, d.source, rt.storage)
    rt.persist()
    say(f"data: wrote {len(rows)} rows in {len(uris)} shards")
    if skipped:
        from workflows.preprocess.quickstart_data import describe_skipped

        warn(f"data: {describe_skipped(skipped)}")
    return {"built": True, "rows": len(rows), "shards": len(uris), "seconds": round(time.time() - t0, 2),
            "skipped_modules": skipped}


@surface_user_errors()
def preprocess(cfg: WorkflowConfig, ctx, say=print) -> ProcessedDataset:
    """The config's task turns the raw shards into its processed dataset (or finds it made)."""
    return get_task(cfg).preprocess(ctx, say)


def stage_preprocess(rt: Runtime) -> ProcessedDataset:
    """The raw shards (the built-in dataset built first, where asked for) -> the processed dataset."""
    with stage(rt, "preprocess") as s:
        built = ensure_raw_data(rt)
        t0 = time.time()
        with s.work():
            data = preprocess(rt.cfg, rt.storage, say)
        seconds = time.time() - t0
        s.summary.update(dataset=asdict(data), raw_data=built, seconds=seconds)
        tracking.log_preprocess(rt, s.run, data)
        s.run.log_metrics({"seconds": seconds})
    return data


# --- tune ----------------------------------------------------------------------------------------
def registering_task_only(cfg: WorkflowConfig, what: str) -> None:
    """Tuning and the pipeline end in a registered model: a task that registers none (causal-LM
    pretraining) is trained with `workflows train` or torchrun."""
    if not get_task(cfg).registers:
        raise UserError(f"{what} takes a task that registers its model; model.task={cfg.model.task} is trained "
                        "with `workflows train` or torchrun (python -m workflows.train.standalone)")


def stage_tune(rt: Runtime, data: ProcessedDataset, resume: bool = False):
    """The hyperparameter search on `data`: its TuneOutcome, whose `best_params` `stage_train` takes."""
    from workflows.tune.search import run_tune, with_task_metric

    registering_task_only(rt.cfg, "tuning")
    cfg = with_task_metric(rt.cfg)
    t = cfg.tune
    how = "ASHA" if t.scheduler == "asha" else "every trial to its end (fifo)"
    say(f"tune: {t.num_samples} trial(s), {how} on {t.metric} ({t.mode}), up to {t.max_epochs} epoch(s) each")
    if t.num_workers == 1 and cfg.train.checkpoint_every_steps:
        warn("tune: train.checkpoint_every_steps applies to Ray Train trials (tune.num_workers > 1); a one-worker "
             "trial restarts from its last epoch")
    with stage(rt, "tune", cfg) as s:
        with s.work():
            outcome = run_tune(cfg, rt.storage, data, resume=resume, tracking=s.run.spec())
        _report_tune(s, outcome)
    return outcome


def _report_tune(s: Stage, outcome) -> None:
    """Each trial's line, the best, the trials table (best first) and plot, and the tune run's logs."""
    from workflows.tune.report import plot_trials, trials_table

    t = s.cfg.tune
    assert t.metric is not None  # set by with_task_metric in stage_tune
    for trial in outcome.trials:
        say(f"tune:   {trial.params} -> {t.metric}={trial.value} after {trial.epochs} epoch(s)"
            f"{' (stopped early)' if trial.stopped_early else ''}{' ERROR ' + trial.error if trial.error else ''}")
    say(f"tune: best {outcome.best_params} ({t.metric}={outcome.best_metric:.4f}) in {outcome.seconds:.0f}s")
    ordered = sorted(outcome.trials, key=lambda r: (r.value is None,
                                                    -(r.value or 0) if t.mode == "max" else (r.value or 0)))
    table = trials_table(ordered, t.metric, t.max_epochs)
    show(table)
    s.summary.update(asdict(outcome))
    s.out_dir.mkdir(parents=True, exist_ok=True)
    (s.out_dir / "tune_trials.md").write_text(table + "\n")
    plot = plot_trials(outcome.trials, t.metric, s.out_dir / "tune_trials.png")
    say(f"tune: trials table {s.out_dir / 'tune_trials.md'}, plot {plot}")
    tracking.log_tune(s.run, outcome, s.cfg, [s.out_dir / "tune_trials.md", plot])


def apply_params(cfg: WorkflowConfig, params: dict[str, Any]) -> WorkflowConfig:
    """A new config with the tuned `train.*` values and task options (`model.options.*`), validated as
    loading validates them (the options by the task's Options model); `cfg` is unchanged."""
    from workflows.config.tune import OPTION_PREFIX

    options = {k.removeprefix(OPTION_PREFIX): v for k, v in params.items() if k.startswith(OPTION_PREFIX)}
    train = {**cfg.train.model_dump(), **{key.removeprefix("train."): value for key, value in params.items()
                                          if not key.startswith(OPTION_PREFIX)}}
    out = cfg.model_copy(update={"train": cfg.train.model_validate(train)})
    if options:
        model = cfg.model.model_copy(update={"options": {**cfg.model.options, **options}})
        out = out.model_copy(update={"model": model})
        get_task(out).check_config()
    return out


# --- train ---------------------------------------------------------------------------------------
@dataclass
class Trained:
    """What the train stage produced: the fit's outcome, and the stage that produced it (the config it
    trained with, tuned values applied; its tracking run; its summary, train.json), in which the
    register stage records the version it registers."""

    outcome: TrainOutcome
    stage: Stage

    @property
    def cfg(self) -> WorkflowConfig:
        return self.stage.cfg


def stage_train(rt: Runtime, data: ProcessedDataset, params: dict[str, Any] | None = None,
                resume: bool = False) -> Trained:
    """Train on `data` with `params` (tuned values, `stage_tune`'s best) over the config's: what
    `stage_register` takes."""
    with stage(rt, "train", apply_params(rt.cfg, params) if params else None) as s:
        outcome = train(s, data, resume)
    return Trained(outcome, s)


def train(s: Stage, data: ProcessedDataset, resume: bool = False):
    """Fit the model (Ray Train; auto's one worker of CPUs in one actor, train.local_run); its epochs, loss curve
    and outcome go to the stage's summary and run."""
    from workflows.progress import EpochProgress
    from workflows.train.layout import described, layout_summary, resolved
    from workflows.train.loop import epoch_line
    from workflows.train.report import plot_losses
    from workflows.train.trainer import fit

    cfg, why = resolved(s.cfg)
    tc = cfg.train
    say(f"train: {described(tc, why)}, {tc.epochs} epoch(s), lr={tc.lr:.2e}, batch {tc.batch_size}/worker on "
        f"{data.counts['train']} rows")
    with s.work():
        outcome = fit(s.cfg, s.rt.storage, data, resume=resume,  # fit resolves auto as `cfg` shows it
                      callbacks=[EpochProgress(tc.epochs, get_task(s.cfg).score[0])], tracking=s.run.spec())
    for h in outcome.history:
        say(f"train:   {epoch_line(h)}")
    s.summary.update(train=asdict(outcome), layout=layout_summary(tc, why))
    curve = plot_losses(outcome.history, s.out_dir / "train_loss.png", title=outcome.run_uri.rsplit("/", 1)[-1])
    if curve is not None:
        s.summary["loss_curve"] = str(curve)
        say(f"train: loss curve {curve}")
    tracking.log_train(s.run, outcome, curve)
    return outcome


# --- register ------------------------------------------------------------------------------------
def stage_register(rt: Runtime, data: ProcessedDataset, trained: Trained) -> registry.ModelRef | None:
    """The trained outcome's chosen checkpoint, exported by the task, as the registry's next version;
    None for a task that registers no model. Its card holds the task's, the validation metrics of that
    epoch and the tracking run that trained it; that run gets the version's tags and the training's
    summary (train.json) its `registered` and `register_seconds`."""
    s = trained.stage
    t0 = time.time()
    if not get_task(s.cfg).registers:
        say(f"train: a {s.cfg.model.task} run registers no model; its checkpoints stay at {trained.outcome.run_uri}")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        card = export_artifact(s.cfg, rt.storage, data, trained.outcome.best_checkpoint_uri, tmp,
                               {"run": trained.outcome.run_uri, "train_config": s.cfg.train.model_dump(mode="json")})
        card["val_metrics"] = val_metrics(trained.outcome.best_metrics)
        link = tracking.registry_link(s.run, rt.tracking.uri if rt.tracking else "")
        if link is not None:  # the MLflow run that trained this version
            card["mlflow"] = link
        ref = registry.register(s.cfg, rt.storage, tmp, s.cfg.registry.name, card)
    rt.persist()
    tracking.log_registered(s.run, ref, card)
    say(f"train: registered {ref.name}:v{ref.version} at {ref.uri}")
    s.summary["registered"] = asdict(ref)
    s.summary["register_seconds"] = round(time.time() - t0, 2)  # export + upload to the registry
    s.rt.write_summary("train", s.summary, announce=False)
    return ref


def export_artifact(cfg: WorkflowConfig, ctx: StorageContext, data: ProcessedDataset, checkpoint_uri: str,
                    out_dir: str, lineage: dict) -> dict:
    """The checkpoint's consolidated weights, written by the config's task as its serving artifact
    (safetensors weights, what its predictor needs, workflows.json) into `out_dir`; the card as a dict."""
    from workflows.train.checkpoint import consolidated_model_state
    from workflows.train.export import download_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        state = consolidated_model_state(download_checkpoint(checkpoint_uri, ctx, tmp))
    from workflows.lineage import code_commit, config_digest, dataset_lineage

    lineage = {"dataset_version": data.version, "dataset_uri": data.uri, "source": data.source,
               "checkpoint": checkpoint_uri, "data": dataset_lineage(data, ctx), "config_digest": config_digest(cfg),
               "code_commit": code_commit(), **lineage}
    return get_task(cfg).serving.export(state, data, out_dir, lineage)


def val_metrics(metrics: dict) -> dict:
    """The validation metrics of the registered epoch (every val_* number the task reports) for its card."""
    return {**{k: v for k, v in metrics.items() if k.startswith("val_") and k != "val_seconds"},
            "epoch": metrics.get("epoch")}


# --- evaluate ------------------------------------------------------------------------------------
def stage_evaluate(rt: Runtime, model_spec: str, ds=None, label_column: str | None = None,
                   write_back: bool = False, card=None) -> dict:
    """Evaluate a registered model on a Ray Dataset of raw rows (the held-out split by default).
    `card`: the model's, when the caller has read it already (its version is then the one evaluated)."""
    from workflows.evaluate import evaluate_dataset, plot_confusion

    with stage(rt, "evaluate") as s:
        if card is None:
            card = registry.model_card(rt.cfg, rt.storage, model_spec)
        elif card.name and card.version:
            model_spec = f"{card.name}:{card.version}"  # the version read, not whichever is latest now
        say(f"evaluate: {card.name}:v{card.version}")
        metrics = evaluate_dataset(rt.cfg, model_spec, card, ds, label_column)
        say(f"evaluate: {metrics['rows']} rows")
        show(task_for_card(rt.cfg, card).evaluation.report(metrics))
        png = None
        if "confusion_matrix" in metrics:
            png = plot_confusion(metrics, s.out_dir / "confusion_matrix.png")
            say(f"evaluate: confusion matrix {png}")
        if write_back:
            registry.write_evaluation(rt.cfg, rt.storage, registry.resolve(rt.cfg, rt.storage, model_spec), metrics)
            rt.persist()
        tracking.log_evaluation(s.run, f"{card.name}:v{card.version}", metrics, s.out_dir / "evaluation", png)
    return metrics


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"--split {split!r}: expected one of {', '.join(SPLITS)}")


def model_split(cfg: WorkflowConfig, storage, model_spec: str, split: str):
    """(the model's card, the URI of the split, the ProcessedDataset) of a split of the processed
    dataset a registered model was trained on, found through its lineage: `--split test` is the
    model's own held-out rows. Needs only the store: `evaluate --split` runs it before Ray starts,
    and reads the card here only (ProcessedDataset.read then gives the Ray Dataset)."""
    check_split(split)
    card = registry.model_card(cfg, storage, model_spec)
    check_card_task(cfg, card)
    data = registry.lineage_dataset(cfg, storage, card)
    return card, f"{data.uri}/split={split}/", data


# --- serve ---------------------------------------------------------------------------------------
def stage_serve(rt: Runtime, model_spec: str, demo_rows: list[dict] | None = None, route_prefix: str = "/",
                app_name: str | None = None) -> dict:
    """Deploy a registered model with Ray Serve and send it `demo_rows`: its URL, main route (the task's
    HTTP contract's), ingress and answers."""
    from workflows.serve import ingress
    from workflows.serve.app import deploy
    from workflows.serve.guards import bearer_token

    ref = registry.resolve(rt.cfg, rt.storage, model_spec)
    spec = f"{ref.name}:{ref.version}"
    card = registry.model_card(rt.cfg, rt.storage, spec)
    task = task_for_card(rt.cfg, card)
    contract = task.serving.http_contract(card, rt.cfg.serve.max_instances)
    served_as = model_spec if registry.split_alias(model_spec)[1] else None  # NAME@ALIAS: its holder now
    say(f"serve: deploying {spec}{f' ({served_as})' if served_as else ''} with Ray Serve")
    t0 = time.time()
    url = deploy(rt.cfg, spec, name=app_name, route_prefix=route_prefix, served_as=served_as)
    deploy_seconds = time.time() - t0
    front = ingress.describe(rt.cfg)
    say(f"serve: {url}{contract.main_route} is up behind {front} (docs at {url}/docs)")
    token = bearer_token(rt.cfg.serve)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    sent = []
    for row in demo_rows or []:
        route, pred = contract.demo(url, row, headers)
        say(f"serve:   {route} {task.serving.describe(row)!r} -> {task.serving.describe_prediction(pred)}")
        sent.append({"instance": row, "prediction": pred})
    return {"url": url, "model": spec, "route": contract.main_route, "ingress": front, "requests": sent,
            "deploy_seconds": round(deploy_seconds, 2), **({"served_as": served_as} if served_as else {})}


def demo_rows(data: ProcessedDataset, rt: Runtime, n: int) -> list[dict]:
    """The first `n` held-out rows as request instances (the task reads them)."""
    return get_task(rt.cfg).serving.demo_instances(data, rt.storage, n)

"""The stages, each usable alone (one CLI command each) or chained by `run_pipeline`."""

from __future__ import annotations

import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from workflows import registry
from workflows.config import WorkflowConfig
from workflows.console import show
from workflows.dataset import SPLITS, ProcessedDataset
from workflows.errors import UserError, surface_user_errors
from workflows.runtime import Runtime, say, warn
from workflows.storage.uri import StorageContext, protocol_of
from workflows.tasks import check_card_task, get_task
from workflows.tracking import stages as tracking


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
    with tracking.tracked(rt, "preprocess") as run:
        built = ensure_raw_data(rt)
        t0 = time.time()
        with rt.cache_counts() as cache:
            data = preprocess(rt.cfg, rt.storage, say)
        rt.persist()
        rt.write_summary("preprocess", {"dataset": asdict(data), "raw_data": built, "seconds": time.time() - t0,
                                        "shard_cache": cache})
        tracking.log_preprocess(rt, run, data)
        run.log_metrics({"seconds": time.time() - t0})
    return data


def registering_task_only(cfg: WorkflowConfig, what: str) -> None:
    """Tuning and the pipeline end in a registered model: a task that registers none (causal-LM
    pretraining) is trained with `workflows train` or torchrun."""
    if not get_task(cfg).registers:
        raise UserError(f"{what} takes a task that registers its model; model.task={cfg.model.task} is trained "
                        "with `workflows train` or torchrun (python -m workflows.train.standalone)")


def stage_tune(rt: Runtime, data: ProcessedDataset, resume: bool = False):
    from workflows.tune.search import run_tune, with_task_metric

    registering_task_only(rt.cfg, "tuning")
    rt.cfg = with_task_metric(rt.cfg)
    t = rt.cfg.tune
    how = "ASHA" if t.scheduler == "asha" else "every trial to its end (fifo)"
    say(f"tune: {t.num_samples} trial(s), {how} on {t.metric} ({t.mode}), up to {t.max_epochs} epoch(s) each")
    if t.num_workers == 1 and rt.cfg.train.checkpoint_every_steps:
        warn("tune: train.checkpoint_every_steps applies to Ray Train trials (tune.num_workers > 1); a one-worker "
             "trial restarts from its last epoch")
    with tracking.tracked(rt, "tune") as run:
        with rt.cache_counts() as cache:
            outcome = run_tune(rt.cfg, rt.storage, data, resume=resume, tracking=run.spec())
        rt.persist()
        _report_tune(rt, outcome, cache, run)
    return outcome


def _report_tune(rt: Runtime, outcome, cache: dict, run) -> None:
    from workflows.tune.report import plot_trials, trials_table

    t = rt.cfg.tune
    assert t.metric is not None  # set by with_task_metric in stage_tune
    for trial in outcome.trials:
        say(
            f"tune:   {trial.params} -> {t.metric}={trial.value} after {trial.epochs} epoch(s)"
            f"{' (stopped early)' if trial.stopped_early else ''}"
            f"{' ERROR ' + trial.error if trial.error else ''}"
        )
    say(f"tune: best {outcome.best_params} ({t.metric}={outcome.best_metric:.4f}) in {outcome.seconds:.0f}s")
    ordered = sorted(
        outcome.trials,
        key=lambda r: (r.value is None, -(r.value or 0) if t.mode == "max" else (r.value or 0)),
    )
    table = trials_table(ordered, t.metric, t.max_epochs)
    show(table)
    summary = rt.write_summary("tune", {**asdict(outcome), "shard_cache": cache})
    (summary.parent / "tune_trials.md").write_text(table + "\n")
    plot = plot_trials(outcome.trials, t.metric, summary.parent / "tune_trials.png")
    say(f"tune: trials table {summary.parent / 'tune_trials.md'}, plot {plot}")
    tracking.log_tune(run, outcome, rt.cfg, [summary.parent / "tune_trials.md", plot])


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


def export_artifact(cfg: WorkflowConfig, ctx: StorageContext, data: ProcessedDataset, checkpoint_uri: str,
                    out_dir: str, lineage: dict) -> dict:
    """The checkpoint's consolidated weights, written by the config's task as its serving artifact
    (safetensors weights, what its predictor needs, workflows.json) into `out_dir`."""
    from workflows.train.checkpoint import consolidated_model_state
    from workflows.train.export import download_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        state = consolidated_model_state(download_checkpoint(checkpoint_uri, ctx, tmp))
    lineage = {"dataset_version": data.version, "dataset_uri": data.uri, "source": data.source,
               "checkpoint": checkpoint_uri, **lineage}
    return get_task(cfg).export(state, data, out_dir, lineage)


def stage_train(rt: Runtime, data: ProcessedDataset, resume: bool = False, register: bool = True):
    with tracking.tracked(rt, "train") as run:
        return _train(rt, data, resume, register, run)


def _train(rt: Runtime, data: ProcessedDataset, resume: bool, register: bool, run):
    from workflows.progress import EpochProgress
    from workflows.train.loop import epoch_line
    from workflows.train.report import plot_losses
    from workflows.train.trainer import fit

    tc = rt.cfg.train
    say(f"train: {tc.num_workers} worker(s) x {tc.cpus_per_worker:g} CPU, {tc.strategy}, {tc.epochs} epoch(s), "
        f"lr={tc.lr:.2e}, batch {tc.batch_size}/worker on {data.counts['train']} rows")
    with rt.cache_counts() as cache:
        outcome = fit(rt.cfg, rt.storage, data, resume=resume,
                      callbacks=[EpochProgress(tc.epochs, get_task(rt.cfg).score[0])],
                      tracking=run.spec())
    rt.persist()
    for h in outcome.history:
        say(f"train:   {epoch_line(h)}")
    summary: dict[str, Any] = {"train": asdict(outcome), "shard_cache": cache}
    curve = plot_losses(outcome.history, Path(rt.cfg.output_dir) / rt.cfg.name / "train_loss.png",
                        title=outcome.run_uri.rsplit("/", 1)[-1])
    if curve is not None:
        summary["loss_curve"] = str(curve)
        say(f"train: loss curve {curve}")
    tracking.log_train(run, outcome, curve)
    ref = None
    t_register = time.time()
    if register and not get_task(rt.cfg).registers:
        say(f"train: a {rt.cfg.model.task} run registers no model; its checkpoints stay at {outcome.run_uri}")
    elif register:
        with tempfile.TemporaryDirectory() as tmp:
            meta = export_artifact(rt.cfg, rt.storage, data, outcome.best_checkpoint_uri, tmp,
                                   {"run": outcome.run_uri, "train_config": rt.cfg.train.model_dump(mode="json")})
            if counts := data.label_counts.get("train"):  # a classifier's evaluation baseline
                meta["majority_label"] = max(counts, key=counts.__getitem__)
            meta["val_metrics"] = val_metrics(outcome.best_metrics)
            link = tracking.registry_link(run, rt.tracking.uri if rt.tracking else "")
            if link is not None:  # the MLflow run that trained this version
                meta["mlflow"] = link
            ref = registry.register(rt.cfg, rt.storage, tmp, rt.cfg.registry.name, meta)
        rt.persist()
        tracking.log_registered(run, ref)
        say(f"train: registered {ref.name}:v{ref.version} at {ref.uri}")
        summary["registered"] = asdict(ref)
        summary["register_seconds"] = round(time.time() - t_register, 2)  # export + upload to the registry
    rt.write_summary("train", summary)
    return outcome, ref


def val_metrics(metrics: dict) -> dict:
    """The validation metrics of the registered epoch (every val_* number the task reports) for its card."""
    return {**{k: v for k, v in metrics.items() if k.startswith("val_") and k != "val_seconds"},
            "epoch": metrics.get("epoch")}


def stage_evaluate(rt: Runtime, model_spec: str, ds=None, label_column: str | None = None,
                   write_back: bool = False, card=None) -> dict:
    """Evaluate a registered model on a Ray Dataset of raw rows (the held-out split by default).
    `card`: the model's, when the caller has read it already (its version is then the one evaluated)."""
    from workflows.evaluate import evaluate_dataset, plot_confusion
    from workflows.tasks import task_for_card

    with tracking.tracked(rt, "evaluate") as run:
        if card is None:
            card = registry.model_card(rt.cfg, rt.storage, model_spec)
        elif card.name and card.version:
            model_spec = f"{card.name}:{card.version}"  # the version read, not whichever is latest now
        say(f"evaluate: {card.name}:v{card.version}")
        metrics = evaluate_dataset(rt.cfg, model_spec, card, ds, label_column)
        say(f"evaluate: {metrics['rows']} rows")
        show(task_for_card(rt.cfg, card).format_report(metrics))
        png = None
        if "confusion_matrix" in metrics:
            png = plot_confusion(metrics, Path(rt.cfg.output_dir) / rt.cfg.name / "confusion_matrix.png")
            say(f"evaluate: confusion matrix {png}")
        if write_back:
            registry.write_evaluation(rt.cfg, rt.storage, registry.resolve(rt.cfg, rt.storage, model_spec), metrics)
            rt.persist()
        tracking.log_evaluation(run, f"{card.name}:v{card.version}", metrics,
                                Path(rt.cfg.output_dir) / rt.cfg.name / "evaluation", png)
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
    spec = f"{card.name}:v{card.version}"
    uri = (card.lineage or {}).get("dataset_uri")
    if not uri:
        raise UserError(f"model {spec} records no processed dataset in its lineage; evaluate it with --data URI")
    try:
        data = ProcessedDataset.load(uri, storage)
    except FileNotFoundError:
        raise UserError(f"model {spec} was trained on the processed dataset {uri}, which is gone "
                        "(no manifest.json there); evaluate it with --data URI") from None
    return card, f"{uri}/split={split}/", data


def stage_serve(rt: Runtime, model_spec: str, demo_rows: list[dict] | None = None, route_prefix: str = "/",
                app_name: str | None = None) -> dict:
    from workflows.serve import ingress
    from workflows.serve.app import bearer_token, deploy
    from workflows.tasks import task_for_card

    ref = registry.resolve(rt.cfg, rt.storage, model_spec)
    spec = f"{ref.name}:{ref.version}"
    card = registry.model_card(rt.cfg, rt.storage, spec)
    task = task_for_card(rt.cfg, card)
    contract = task.http_contract(card, rt.cfg.serve.max_instances)
    say(f"serve: deploying {spec} with Ray Serve")
    t0 = time.time()
    url = deploy(rt.cfg, spec, name=app_name, route_prefix=route_prefix)
    deploy_seconds = time.time() - t0
    front = ingress.describe(rt.cfg)
    first = "/predict" if contract.predict_route else "/v1/chat/completions"
    say(f"serve: {url}{first} is up behind {front} (docs at {url}/docs)")
    token = bearer_token(rt.cfg.serve)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    sent = []
    for row in demo_rows or []:
        route, pred = contract.demo(url, row, headers)
        shown = f"{pred['label']} ({pred['score']:.2f})" if "label" in pred else json.dumps(pred)[:60]
        say(f"serve:   {route} {task.describe(row)!r} -> {shown}")
        sent.append({"instance": row, "prediction": pred})
    return {"url": url, "model": spec, "ingress": front, "requests": sent, "deploy_seconds": round(deploy_seconds, 2)}


def demo_rows(data: ProcessedDataset, rt: Runtime, n: int) -> list[dict]:
    """The first `n` held-out rows as request instances (the task reads them)."""
    return get_task(rt.cfg).demo_instances(data, rt.storage, n)


def run_pipeline(rt: Runtime) -> dict:
    registering_task_only(rt.cfg, "the pipeline (train -> evaluate -> register -> serve)")
    with tracking.pipeline_run(rt) as run:
        summary = _pipeline(rt)
        headline = summary["evaluate"]["headline"]
        run.log_metrics({headline["name"].replace(" ", "_").lower(): headline["value"],
                         **{f"seconds_{k}": v for k, v in summary["seconds"].items()}})
        run.set_tags({"registered_model.name": summary["model"]["name"],
                      "registered_model.version": summary["model"]["version"]})
    return summary


def _pipeline(rt: Runtime) -> dict:
    cfg = rt.cfg
    t0 = time.time()
    timings: dict[str, float] = {}
    summary: dict[str, Any] = {}

    def timed(name, fn, *a, **kw):
        s = time.time()
        out = fn(*a, **kw)
        timings[name] = round(time.time() - s, 2)
        return out

    data = timed("preprocess", stage_preprocess, rt)
    summary["dataset"] = {"version": data.version, "uri": data.uri, "counts": data.counts, "reused": data.reused}
    if cfg.tune.enabled:
        tuned = timed("tune", stage_tune, rt, data)
        rt.cfg = cfg = apply_params(cfg, tuned.best_params)
        summary["tune"] = {
            "best_params": tuned.best_params,
            "best_metric": tuned.best_metric,
            "trials": len(tuned.trials),
        }
    outcome, ref = timed("train", stage_train, rt, data)
    summary["train"] = {"run": outcome.run_uri, "best_metrics": outcome.best_metrics}
    spec = f"{ref.name}:{ref.version}"
    # Serve deploys while the evaluation runs: both wait mostly on process start and model load,
    # and the replica and the evaluation's actor each hold one CPU, so neither waits for the other.
    with ThreadPoolExecutor(1, thread_name_prefix="serve") as pool:
        serving = pool.submit(timed, "serve", stage_serve, rt, spec, demo_rows(data, rt, cfg.serve.demo_requests)) \
            if cfg.serve.enabled else None
        metrics = timed("evaluate", stage_evaluate, rt, spec, data.read("test", rt.storage, cache=rt.cfg.cache),
                        write_back=True)
        name, value, against = get_task(cfg).headline(metrics)
        summary["evaluate"] = {
            **{k: metrics[k] for k in ("weighted", "baseline") if k in metrics},
            "rows": metrics["rows"],
            "headline": {"name": name, "value": value, "against": against},
        }
        summary["model"] = {"name": ref.name, "version": ref.version, "uri": ref.uri}
        if serving is not None:
            summary["serve"] = serving.result()
    timings["total"] = round(time.time() - t0, 2)
    summary["seconds"] = timings
    rt.write_summary("pipeline", summary)
    say(f"pipeline: done in {timings['total']:.0f}s: {ref.name}:v{ref.version} {name} {value:.4f} ({against})")
    return summary

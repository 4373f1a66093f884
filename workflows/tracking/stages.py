"""What each stage logs from the driver: its summary numbers, tags and artifacts (the numbers of
training epochs and tune trials are logged where they are produced: train/ray_worker.py, tune/trial.py)."""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from workflows.storage.atomic import atomic_write
from workflows.tracking.client import Tracker
from workflows.tracking.model_registry import ensure_version
from workflows.tracking.session import Run, ray_job_id
from workflows.tracking.store import redact_uri


def tracked(rt, name: str):
    """rt.tracking.stage(name) with the runtime's current config, or an inert run."""
    if getattr(rt, "tracking", None) is None:
        return nullcontext(Run(None, None))
    return rt.tracking.stage(name, cfg=rt.cfg)


@contextmanager
def pipeline_run(rt):
    """The `pipeline` parent run: every stage run of the command becomes its child."""
    t = getattr(rt, "tracking", None)
    if t is None:
        yield Run(None, None)
        return
    with t.stage("pipeline", cfg=rt.cfg) as run:
        t.parent = run
        yield run


def log_preprocess(rt, run: Run, data) -> None:
    if getattr(rt, "tracking", None) is not None:
        rt.tracking.set_dataset(data.version)
    run.set_tags({"dataset.version": data.version, "dataset.uri": data.uri, "dataset.reused": data.reused})
    run.log_metrics({f"rows_{split}": n for split, n in data.counts.items()})


def log_tune(run: Run, outcome, cfg, files: list[Path]) -> None:
    """The search's best result and its trials table and plot; each trial run is marked with how it
    ended (ASHA's early stop included): a stopped trial's own process may not get to say so."""
    run.log_metrics({f"best_{cfg.tune.metric}": outcome.best_metric, "trials": len(outcome.trials),
                     "seconds": outcome.seconds})
    run.log_params({f"best.{k}": v for k, v in outcome.best_params.items()})
    run.log_files(files)
    trials = {t.trial_id: t for t in outcome.trials if getattr(t, "trial_id", None)}

    def mark(client, info):
        found = client.search_runs([info.experiment_id], f"tags.mlflow.parentRunId = '{info.run_id}'",
                                   max_results=1000)
        # a search that `tune --resume` continued: the trials that finished before the interruption
        # did not run again, their runs are still under the first tune run (and may not have been
        # ended, where the interruption came first); they join this one
        missing = set(trials) - {r.data.tags.get("ray.trial_id") for r in found}
        for trial_id in sorted(missing):
            earlier = client.search_runs([info.experiment_id], f"tags.`ray.trial_id` = '{trial_id}'", max_results=1)
            for r in earlier:
                client.set_tag(r.info.run_id, "mlflow.parentRunId", info.run_id)
            found += earlier
        for r in found:
            t = trials.get(r.data.tags.get("ray.trial_id"))
            if t is None:
                continue
            status = "FAILED" if t.error else "KILLED" if t.stopped_early else "FINISHED"
            client.set_tag(r.info.run_id, "tune.stopped_early", str(t.stopped_early).lower())
            if t.stopped_early:
                client.set_tag(r.info.run_id, "tune.stopped_by", cfg.tune.scheduler.upper())
            client.set_tag(r.info.run_id, "tune.epochs", str(t.epochs))
            client.set_terminated(r.info.run_id, status, r.info.end_time or None)
    run.call(mark)


def log_train(run: Run, outcome, curve: Path | None) -> None:
    best = {f"best_{k}": v for k, v in outcome.best_metrics.items()  # every val_* metric the task reports
            if k in ("epoch", "train_loss") or (k.startswith("val_") and k != "val_seconds")}
    run.log_metrics({**best, "fit_seconds": outcome.seconds,
                     **{f"seconds_{k}": v for k, v in outcome.breakdown.items()}})
    run.set_tags({"train.run_uri": outcome.run_uri, "train.best_checkpoint": outcome.best_checkpoint_uri})
    run.log_files([curve] if curve is not None else [])


def registry_link(run: Run, uri: str) -> dict[str, Any] | None:
    """What a registered version records of the run that trained it (None when tracking is off)."""
    info = run.info(timeout=60)  # registering waits for the run's creation, at most this long
    if info is None:
        return None
    return {"run_id": info.run_id, "experiment_id": info.experiment_id, "tracking_uri": redact_uri(uri)}


def log_registered(run: Run, ref, card: dict) -> None:
    """The training run's tags of the version it registered, the dataset it trained on as the run's
    input (MLflow's datasets: the card's `lineage.data`), and the version's twin in MLflow's model
    registry (workflows.tracking.model_registry)."""
    lineage = card.get("lineage") or {}
    run.set_tags({"registered_model.name": ref.name, "registered_model.version": ref.version,
                  "registered_model.uri": ref.uri, "workflows.config_digest": lineage.get("config_digest"),
                  "dataset.digest": (lineage.get("data") or {}).get("digest")})
    if lineage.get("data"):
        log_dataset(run, lineage["data"], "training")
    run.call(lambda client, info: ensure_version(
        client, ref.name, ref.version, ref.uri, info.run_id,
        tags={"dataset.digest": (lineage.get("data") or {}).get("digest"),
              "workflows.config_digest": lineage.get("config_digest"), "code_commit": lineage.get("code_commit")}))


def log_dataset(run: Run, data: dict, context: str) -> None:
    """`data` (workflows.lineage.dataset_lineage) as an MLflow dataset input of the run: its name the
    dataset version, its digest the content digest, its source the raw and processed URIs, its
    profile the rows per split (what `mlflow.log_input` logs, through the fail-soft client)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = Dataset(name=f"processed-{data['version']}", digest=str(data["digest"]),
                      source_type="s3" if str(data["uri"]).startswith("s3") else "local",
                      source=json.dumps({"uri": data["uri"], "raw": data["source"]}),
                      profile=json.dumps({"num_rows": sum(data["rows"].values()), "rows": data["rows"]}))
    entry = DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])
    run.call(lambda client, info: client.log_inputs(info.run_id, datasets=[entry]))


def log_promotion(run: Run, ref, decision: dict) -> None:
    """The gate's decision on its run: both scores per set of rows, the verdict as tags (the alias's
    move is mirrored into MLflow's model registry by registry.move_alias)."""
    scores = {f"{name}_{who}": value for name, s in decision["scores"].items()
              for who, value in s.items() if who in ("candidate", "holder")}
    run.log_metrics({**scores, **{f"{name}_rows": s["rows"] for name, s in decision["scores"].items()}})
    run.set_tags({"promotion.alias": decision["alias"], "promotion.metric": decision["metric"],
                  "promotion.promoted": str(decision["promoted"]).lower(), "promotion.reason": decision["reason"],
                  "promotion.candidate": ref.version, "promotion.holder": decision["holder"],
                  "registered_model.name": ref.name, "registered_model.version": ref.version})


def session_tracker(rt) -> Tracker | None:
    """The tracker of the command's tracking session, where it has one that is on: a move of an alias
    mirrored on it queues behind the session's own calls (registry.move_alias)."""
    t = getattr(rt, "tracking", None)
    return t.tracker if t is not None and not t.tracker.off else None


def performed_by(rt, command: str) -> str:
    """Who moves an alias, for its history: the command, the config, the pipeline's MLflow run (when
    tracked) and the Ray job."""
    parts = [f"config {rt.cfg.name}"]
    parent = rt.tracking.parent if session_tracker(rt) is not None else None
    info = parent.info(timeout=60) if parent is not None else None
    if info is not None:
        parts.append(f"MLflow run {info.run_id}")
    if (job := ray_job_id()) is not None:
        parts.append(f"Ray job {job}")
    return f"{command} ({', '.join(parts)})"


def log_evaluation(run: Run, model_spec: str, metrics: dict, out: Path, confusion_png: Path | None = None) -> None:
    """Weighted and per-class scores as metrics; the report (per-class P/R/F1) and the confusion
    matrix as JSON and PNG (`confusion_png`: the one evaluate wrote) artifacts."""
    flat = {**{k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)},
            **{f"weighted_{k}": v for k, v in metrics.get("weighted", {}).items()},
            **{f"baseline_{k}": v for k, v in metrics.get("baseline", {}).items() if k != "majority_label"}}
    for label, m in metrics.get("per_class", {}).items():
        flat[f"f1.{label}"] = m["f1"]
    run.log_metrics(flat)
    run.set_tags({"evaluate.model": model_spec})
    if not run.active:  # nothing to log the files into
        return
    out.mkdir(parents=True, exist_ok=True)
    report = atomic_write(out / "evaluation.json", json.dumps(metrics, indent=2, default=str))
    files: list[Path | None] = [report]
    if metrics.get("confusion_matrix", {}).get("matrix"):  # evaluate's own matrix and PNG of it
        files += [atomic_write(out / "confusion_matrix.json", json.dumps(metrics["confusion_matrix"], indent=2)),
                  confusion_png]
    run.log_files(files, "evaluation")

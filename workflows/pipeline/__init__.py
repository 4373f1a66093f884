"""The pipeline: preprocess -> tune -> train -> register -> evaluate (-> the promotion gate, when
`registry.promote` is set), with serve beside it. Each stage
(workflows.pipeline.stages, one CLI command each) takes what the ones before it produced as values:
the processed dataset, the search's best parameters, the registered model."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workflows.dataset import SplitRows
from workflows.pipeline.promote import stage_promote
from workflows.pipeline.stages import (
    demo_rows,
    registering_task_only,
    stage_evaluate,
    stage_preprocess,
    stage_register,
    stage_serve,
    stage_train,
    stage_tune,
)
from workflows.runtime import Runtime, say
from workflows.tasks import get_task
from workflows.tracking import stages as tracking


def run_pipeline(rt: Runtime) -> dict:
    """Every stage in order, under one `pipeline` tracking run; pipeline.json holds what each produced
    and how long it took."""
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
    seconds: dict[str, float] = {}
    summary: dict[str, Any] = {}

    def timed(name, fn, *a, **kw):
        s = time.time()
        out = fn(*a, **kw)
        seconds[name] = round(seconds.get(name, 0.0) + time.time() - s, 2)
        return out

    data = timed("preprocess", stage_preprocess, rt)
    summary["dataset"] = {"version": data.version, "uri": data.uri, "counts": data.counts, "reused": data.reused}
    params: dict[str, Any] = {}
    if cfg.tune.enabled:
        tuned = timed("tune", stage_tune, rt, data)
        params = tuned.best_params
        summary["tune"] = {"best_params": params, "best_metric": tuned.best_metric, "trials": len(tuned.trials)}
    trained = timed("train", stage_train, rt, data, params)
    # the "train" seconds include registering (train.json's register_seconds is its share)
    ref = timed("train", stage_register, rt, data, trained)
    assert ref is not None  # registering_task_only: the task registers its model
    outcome = trained.outcome
    summary["train"] = {"run": outcome.run_uri, "best_metrics": outcome.best_metrics}
    summary["model"] = {"name": ref.name, "version": ref.version, "uri": ref.uri}
    spec = f"{ref.name}:{ref.version}"
    # Serve deploys while the evaluation runs: both wait mostly on process start and model load,
    # and the replica and the evaluation's actor each hold one CPU, so neither waits for the other.
    with ThreadPoolExecutor(1, thread_name_prefix="serve") as pool:
        serving = pool.submit(timed, "serve", stage_serve, rt, spec, demo_rows(data, rt, cfg.serve.demo_requests)) \
            if cfg.serve.enabled else None
        test_ds = SplitRows(data, "test", rt.storage, cfg.cache)
        metrics = timed("evaluate", stage_evaluate, rt, spec, test_ds, write_back=True)
        name, value, against = get_task(cfg).evaluation.headline(metrics)
        summary["evaluate"] = {
            **{k: metrics[k] for k in ("weighted", "baseline") if k in metrics},
            "rows": metrics["rows"],
            "headline": {"name": name, "value": value, "against": against},
        }
        if cfg.registry.promote is not None:  # the gate: the new version against the alias's holder
            summary["promotion"] = timed("promote", stage_promote, rt, ref, test_ds, metrics,
                                         tracking.performed_by(rt, "workflows pipeline"))
        if serving is not None:
            summary["serve"] = serving.result()
    seconds["total"] = round(time.time() - t0, 2)
    summary["seconds"] = seconds
    rt.write_summary("pipeline", summary)
    say(f"pipeline: done in {seconds['total']:.0f}s: {ref.name}:v{ref.version} {name} {value:.4f} ({against})")
    return summary

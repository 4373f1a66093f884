"""Quickstart: `workflows pipeline` on the quickstart config from an empty object store, beside its work.

The pipeline runs as the real command in a fresh process (Ray start-up, dataset build, tune, train,
evaluate, serve, all included) against a fresh embedded store. Then the same computations run in
this process with plain PyTorch and no Ray or object store (bench/work.py): `wall_vs_work_ratio` is
the pipeline's wall time over the work's, for the whole run and per stage, and the rest of each
stage's time is broken down (Ray, worker groups, data, checkpoints, registry, Serve).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from benchmarks.pipeline_run import fresh_overrides, run_pipeline_in

GOALS = {"pipeline": 1.5, "tune": 2.0, "train": 2.0}  # wall_vs_work_ratio at most
F1_GOAL = 0.90
STAGES = ["preprocess", "tune", "train", "evaluate", "serve"]


FIGURES = ("wall_seconds", "wall_vs_work_ratio", "weighted_f1")  # headline figures (workflows.bench.superseded)

def run(config: str | None, overrides: list[str]) -> dict:
    return {**measure_pipeline(config or "quickstart", overrides),
            "goals": {"wall_vs_work_ratio": GOALS, "weighted_f1": F1_GOAL}}


def measure_pipeline(config: str, overrides: list[str]) -> dict:
    """The pipeline of `config` from an empty store, then its work in one plain-PyTorch process:
    wall, work and their ratio for the whole run and per stage, where the rest went, the held-out
    figures (bench quickstart, bench digits)."""
    from benchmarks import work
    from workflows.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        wall, summary = run_pipeline_in(tmp, config, overrides)
        cfg = load_config(config, [*fresh_overrides(tmp), *overrides])
        run_dir = Path(tmp, "runs", cfg.name)
        stage_summaries = {s: json.loads((run_dir / f"{s}.json").read_text()) for s in ("preprocess", "tune", "train")
                           if (run_dir / f"{s}.json").exists()}
        measured = work.measure(cfg, run_dir, Path(tmp, "work"))
    seconds = summary["seconds"]
    ev = summary["evaluate"]
    stages = {}
    for s in STAGES:
        if s not in seconds or s not in measured:
            continue
        w = measured[s]["seconds"]
        stages[s] = {"wall_seconds": seconds[s], "work_seconds": round(w, 2), "fixed_seconds": round(seconds[s] - w, 2),
                     "wall_vs_work_ratio": round(seconds[s] / max(w, 1e-9), 2)}
    work_total = sum(measured[s]["seconds"] for s in STAGES if s in measured)
    registered = measured.pop("registered_metrics", {})
    return {
        "wall_seconds": round(wall, 1),
        "work_seconds": round(work_total, 1),
        "fixed_seconds": round(wall - work_total, 1),
        "wall_vs_work_ratio": round(wall / work_total, 2),
        "stages": stages,
        "outside_stages_seconds": round(wall - seconds["total"], 1),
        "breakdown": breakdown(summary, stage_summaries),
        "work": measured,
        "weighted_f1": ev["weighted"]["f1"],
        "accuracy": registered.get("accuracy"),
        "majority_baseline_f1": ev["baseline"]["f1"],
        "test_rows": ev["rows"],
        "served_predictions": len(summary.get("serve", {}).get("requests", [])),
    }


def breakdown(summary: dict, stages: dict) -> dict:
    """Where each stage's time went, from what the stages measured of themselves."""
    out: dict = {}
    pre = stages.get("preprocess", {})
    if pre:
        out["preprocess"] = {"raw_data_build": pre.get("raw_data", {}).get("seconds"),
                             "ray_data": pre.get("seconds")}
    tune = stages.get("tune")
    if tune:
        per_trial: dict[str, float] = {}
        for trial in tune["trials"]:
            for k, v in trial.get("seconds", {}).items():
                per_trial[k] = round(per_trial.get(k, 0.0) + v, 2)
        # trials run side by side: their seconds add up to more than the stage's wall time
        out["tune"] = {"concurrency": tune.get("concurrency"), "trials_sum": per_trial, "stage": tune.get("seconds")}
    train = stages.get("train")
    if train:
        out["train"] = {**train["train"].get("breakdown", {}), "registry": train.get("register_seconds")}
    if "serve" in summary:
        out["serve"] = {"serve_start": summary["serve"].get("deploy_seconds")}
    return out


def load(r: dict) -> str:
    """The machine's load around the run (stored since run_benchmark records it): the seconds on a
    shared machine stretch with it, the wall/work ratios much less (the work runs on the same cores)."""
    la = r["machine"].get("load_average")
    return f", load average {la['before']} before, {la['after_15min']} over the last 15 min" if la else ""


def _goal(value: float, goal: float, at_most: bool = True) -> str:
    met = value <= goal if at_most else value >= goal
    return f"{'<=' if at_most else '>='} {goal} ({'met' if met else 'not met'})"


def threads(w: dict, unit: str) -> str:
    """The threads a piece of work ran on: results from before work.fastest name one count."""
    if "threads_used" not in w:
        return f"{w.get('threads', 0)} {unit}"
    used = w["threads_used"]
    used = ", ".join(map(str, used)) if isinstance(used, list) else used
    return f"the faster of 1 and {w['threads']} threads (used: {used})"


def where_rows(b: dict, ray_data: str) -> list[str]:
    """The rows of the "where the rest goes" table from a run's breakdown; `ray_data` names what
    preprocessing's Ray Data job does."""
    where = []
    if "preprocess" in b:
        where.append(f"| preprocess | building the raw dataset {b['preprocess']['raw_data_build'] or 0:.1f} s, "
                     f"{ray_data} {b['preprocess']['ray_data'] or 0:.1f} s |")
    if "tune" in b:
        t = b["tune"]["trials_sum"]
        where.append(f"| tune ({b['tune']['concurrency']} trials at once; seconds summed over trials) | "
                     + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in t.items()) + " |")
    if "train" in b:
        train = sorted(b["train"].items(), key=lambda kv: kv[0] == "registry")  # the worker's parts, then registry
        where.append("| train | " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in train if v is not None)
                     + " |")
    if "serve" in b:
        where.append(f"| serve | Serve start and deploy {b['serve']['serve_start'] or 0:.1f} s |")
    return where


def markdown(r: dict) -> str:
    g = r["goals"]["wall_vs_work_ratio"]
    rows = [
        f"| **pipeline** | {r['wall_seconds']:.0f} | {r['work_seconds']:.0f} "
        f"| {r['wall_seconds'] - r['work_seconds']:.0f} "
        f"| **{r['wall_vs_work_ratio']}x** | {_goal(r['wall_vs_work_ratio'], g['pipeline'])} |"
    ]
    for s in (s for s in STAGES if s in r["stages"]):  # pipeline order (the results JSON is key-sorted)
        v = r["stages"][s]
        goal = _goal(v["wall_vs_work_ratio"], g[s]) if s in g else "fixed cost: cut"
        rows.append(f"| {s} | {v['wall_seconds']:.1f} | {v['work_seconds']:.1f} | {v['fixed_seconds']:.1f} "
                    f"| {v['wall_vs_work_ratio']}x | {goal} |")
    rows.append(
        f"| outside the stages (process, object store, Ray start and stop) | {r['outside_stages_seconds']:.1f} | 0 "
        f"| {r['outside_stages_seconds']:.1f} | | |"
    )
    where = where_rows(r["breakdown"], "Ray Data read/tokenize/write")
    w = r["work"]
    return f"""## Quickstart: the pipeline beside its work

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs{load(r)}, torch {r["machine"]["torch"]})

`workflows pipeline --config configs/quickstart.yaml` in a fresh process from an empty store, then the
same computations in one plain-PyTorch process without Ray or an object store (`benchmarks/work.py`:
tokenizing {w["preprocess"]["rows"]} rows; {w.get("tune", {}).get("trials", 0)} trials, {w.get("tune", {}).get("epochs", 0)} trial-epochs
on {threads(w.get("tune", {}), "thread(s)")}; the final {w["train"]["epochs"]} epoch(s) on {threads(w["train"], "threads")};
evaluating {w["evaluate"]["rows"]} rows; {w["serve"]["requests"]} single-row predictions).

| stage | wall s | work s | rest s | wall / work | goal |
| --- | --- | --- | --- | --- | --- |
{chr(10).join(rows)}

Serve deploys while the evaluation runs, so their wall seconds overlap; the pipeline's total counts them once.

Where the rest goes (as each stage measured itself):

| stage | seconds |
| --- | --- |
{chr(10).join(where)}

| measure | value | goal |
| --- | --- | --- |
| held-out weighted F1 | {r["weighted_f1"]:.4f} ({r["test_rows"]} rows) | {_goal(r["weighted_f1"], r["goals"]["weighted_f1"], at_most=False)} |
| the same model's F1 in the work's process | {w["evaluate"]["weighted_f1"]:.4f} | equal |
| majority-class baseline F1, same rows | {r["majority_baseline_f1"]:.4f} | |
| predictions served over HTTP | {r["served_predictions"]} | |
"""  # noqa: E501 (markdown table rows: one line each)


if __name__ == "__main__":
    from benchmarks.record import main

    main("quickstart")

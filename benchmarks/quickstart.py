"""Quickstart: `workflows pipeline` on the quickstart config from an empty object store, beside its work.

The pipeline runs as the real command in a fresh process (Ray start-up, dataset build, tune, train,
evaluate, serve, all included) against a fresh embedded store. Then the same computations run in
this process with plain PyTorch and no Ray or object store (bench/work.py): `wall_vs_work_ratio` is
the pipeline's wall time over the work's, for the whole run and per stage, and the rest of each
stage's time is broken down (Ray, worker groups, data, checkpoints, registry, Serve).

The pipeline and its work alternate REPEATS times, each pair from its own empty store; each run starts
once the machine's 1-minute load is under its cores (waited for up to SETTLE_S), and the load is
sampled while it runs. The figures are the medians of the repeats; a goal is judged only when every run
started under the cores (else the result says it cannot judge), and the held-out F1 of every repeat is
kept: the same command must score the same to 4 decimals.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.load import LoadSampler
from benchmarks.pipeline_run import fresh_overrides, run_pipeline_in

GOALS = {"pipeline": 1.5, "tune": 2.0, "train": 1.3}  # wall_vs_work_ratio at most
F1_GOAL = 0.90
STAGES = ["preprocess", "tune", "train", "evaluate", "serve"]
REPEATS = 2
SETTLE_S = 180  # the longest wait for the load to fall under the cores before a run


FIGURES = ("wall_seconds", "wall_vs_work_ratio", "weighted_f1")  # headline figures (workflows.bench.superseded)

def run(config: str | None, overrides: list[str]) -> dict:
    return {**measure_pipeline(config or "quickstart", overrides),
            "goals": {"wall_vs_work_ratio": GOALS, "weighted_f1": F1_GOAL}}


def settle(cores: int) -> float:
    """The 1-minute load once it is under `cores` (or SETTLE_S passed): what a run starts at."""
    deadline = time.time() + SETTLE_S
    while os.getloadavg()[0] >= cores and time.time() < deadline:
        time.sleep(5)
    return round(os.getloadavg()[0], 2)


def measure_pipeline(config: str, overrides: list[str], repeats: int = REPEATS) -> dict:
    """The pipeline of `config` from an empty store, then its work in one plain-PyTorch process, `repeats`
    times alternating: the medians of wall, work and their ratio for the whole run and per stage, where the
    rest went, the held-out figures of each run, and the load each run started at and ran under (bench
    quickstart, bench digits)."""
    cores = os.cpu_count() or 1
    runs: list[dict] = []
    loads: list[dict] = []
    for _ in range(repeats):
        runs.append(_one(config, overrides, cores, loads))
    return {**_medians(runs), "repeats": [_brief(r) for r in runs], "load": _judged(loads, cores),
            "same_f1": len({round(r["weighted_f1"], 4) for r in runs}) == 1}


def _one(config: str, overrides: list[str], cores: int, loads: list[dict]) -> dict:
    from benchmarks import work
    from workflows.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        start = settle(cores)
        with LoadSampler() as sampled:
            wall, summary = run_pipeline_in(tmp, config, overrides)
        loads.append({"run": "pipeline", "start": start, **sampled.summary()})
        cfg = load_config(config, [*fresh_overrides(tmp), *overrides])
        run_dir = Path(tmp, "runs", cfg.name)
        stage_summaries = {s: json.loads((run_dir / f"{s}.json").read_text()) for s in ("preprocess", "tune", "train")
                           if (run_dir / f"{s}.json").exists()}
        start = settle(cores)
        with LoadSampler() as sampled:
            measured = work.measure(cfg, run_dir, Path(tmp, "work"))
        loads.append({"run": "work", "start": start, **sampled.summary()})
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
        "train_layout": stage_summaries.get("train", {}).get("layout"),
    }


def _medians(runs: list[dict]) -> dict:
    """The repeats' medians of wall, work and rest (the whole run's and each stage's), their ratios from
    those medians; the rest (breakdown, work, held-out figures) from the repeat whose wall is the median."""
    def med(values):
        return round(statistics.median(values), 2)

    middle = sorted(runs, key=lambda r: r["wall_seconds"])[(len(runs) - 1) // 2]
    out = dict(middle)
    for key in ("wall_seconds", "work_seconds", "fixed_seconds", "outside_stages_seconds"):
        out[key] = med([r[key] for r in runs])
    out["wall_vs_work_ratio"] = round(out["wall_seconds"] / out["work_seconds"], 2)
    stages = {}
    for s in middle["stages"]:
        wall = med([r["stages"][s]["wall_seconds"] for r in runs if s in r["stages"]])
        w = med([r["stages"][s]["work_seconds"] for r in runs if s in r["stages"]])
        stages[s] = {"wall_seconds": wall, "work_seconds": w, "fixed_seconds": round(wall - w, 2),
                     "wall_vs_work_ratio": round(wall / max(w, 1e-9), 2)}
    out["stages"] = stages
    return out


def _brief(r: dict) -> dict:
    return {"wall_seconds": r["wall_seconds"], "work_seconds": r["work_seconds"],
            "wall_vs_work_ratio": r["wall_vs_work_ratio"], "weighted_f1": r["weighted_f1"],
            "stages_wall_vs_work": {s: v["wall_vs_work_ratio"] for s, v in r["stages"].items()}}


def _judged(loads: list[dict], cores: int) -> dict:
    """Whether the goals can be judged from these runs: each started with the machine's load under its cores."""
    worst = max(load["start"] for load in loads)
    return {"cores": cores, "runs": loads, "judged": worst < cores,
            "why": (f"every run started with the 1-minute load under {cores} (at most {worst})" if worst < cores else
                    f"a run started at load {worst} on {cores} cores: other work shared the machine")}


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


def _goal(value: float, goal: float, at_most: bool = True, judged: bool = True) -> str:
    if not judged:
        return f"{'<=' if at_most else '>='} {goal} (cannot judge: load)"
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


def judging(r: dict) -> tuple[bool, str]:
    """(whether the run's load lets it judge its goals, the lines that say how it ran); results from before
    the repeats were one run, unjudged by load."""
    if "load" not in r:
        return True, ""
    j, reps = r["load"], r["repeats"]
    f1s = ", ".join(f"{x['weighted_f1']:.4f}" for x in reps)
    runs = "; ".join(f"{x['run']} started at {x['start']}, mean {x['mean']}, max {x['max']}" for x in j["runs"])
    layout = r.get("train_layout") or {}
    return j["judged"], (f"{len(reps)} repeats, pipeline and work alternating, each from an empty store; figures are "
                         f"medians (pipeline walls {', '.join(str(x['wall_seconds']) for x in reps)} s). Load: "
                         f"{runs}. **{'Judged' if j['judged'] else 'Cannot judge'}**: {j['why']}. Held-out F1 of "
                         f"each repeat: {f1s} ({'the same' if r['same_f1'] else '**not the same**'} to 4 decimals)."
                         + (f" Training layout: {layout.get('num_workers')} worker(s) x "
                            f"{layout.get('cpus', layout.get('cpus_per_worker'))} CPU "
                            f"({'num_workers auto' if layout.get('why') else 'as configured'})."
                            if layout else "") + "\n")


def markdown(r: dict) -> str:
    g = r["goals"]["wall_vs_work_ratio"]
    judged, how = judging(r)
    rows = [
        f"| **pipeline** | {r['wall_seconds']:.0f} | {r['work_seconds']:.0f} "
        f"| {r['wall_seconds'] - r['work_seconds']:.0f} "
        f"| **{r['wall_vs_work_ratio']}x** | {_goal(r['wall_vs_work_ratio'], g['pipeline'], judged=judged)} |"
    ]
    for s in (s for s in STAGES if s in r["stages"]):  # pipeline order (the results JSON is key-sorted)
        v = r["stages"][s]
        goal = _goal(v["wall_vs_work_ratio"], g[s], judged=judged) if s in g else "fixed cost: cut"
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
{how}
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

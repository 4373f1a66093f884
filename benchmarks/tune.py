"""`workflows bench tune` on the quickstart for docs/BENCHMARKS.md's tuning section
(`python -m benchmarks.tune`)."""

from __future__ import annotations

from workflows.bench.tune import GOAL_GAP, GOAL_RATIO
from workflows.bench.tune import run as run


def _model(r: dict) -> str:
    m = r.get("asha_ratio_model")
    if not m:
        return "not computed in this run"
    return f"{m['mean']} ({m['p10']}–{m['p90']}), {100 * m['p_meets_goal']:.0f}%"


def markdown(r: dict) -> str:
    met = r["goals_met"]
    s, a, f = r["search"], r["asha"], r["full_budget"]

    def mark(k: str) -> str:
        return "met" if met[k] else "**not met**"

    return f"""## Tuning: ASHA against the full budget

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs). Quickstart data, the config's
search space {s["space"]}, {s["num_samples"]} trials (random search, seed {s["seed"]}, the same configs in
both searches), up to {s["max_epochs"]} epochs each on {s["train_rows"]} training rows, {s["workers_per_trial"]}
Ray Train worker(s) per trial; ASHA grace period {s["grace_period"]}, reduction factor {s["reduction_factor"]}.

| search | epochs trained | trials stopped early | best val F1 (any epoch) | best trial | time |
| --- | --- | --- | --- | --- | --- |
| ASHA | {a["epochs"]} | {a["stopped_early"]} | {a["best"]:.4f} | {a["best_params"]} | {a["seconds"]:.0f} s |
| every trial to {s["max_epochs"]} epochs | {f["epochs"]} | {f["stopped_early"]} | {f["best"]:.4f} | {f["best_params"]} | {f["seconds"]:.0f} s |

| measure | value | goal |
| --- | --- | --- |
| `asha_epochs_ratio` | {r["asha_epochs_ratio"]} | <= {GOAL_RATIO} ({mark("asha_epochs_ratio")}) |
| expected from Ray's async rule for this ladder (`asha_ratio_model`: mean, 10–90th percentile, chance of meeting the goal) | {_model(r)} | |
| `best_f1_gap` (full − ASHA) | {r["best_f1_gap"]} | <= {GOAL_GAP} ({mark("best_f1_gap")}) |
"""  # noqa: E501 (markdown table rows: one line each)

if __name__ == "__main__":
    from benchmarks.record import main

    main("tune")

"""Digits: `workflows pipeline` on the digits config (image classification) from an empty object
store, beside its work, and the quickstart (text) measured the same way in the same run.

Each pipeline runs as the real command in a fresh process (Ray start-up, the raw dataset built,
decoding on Ray Data, tune, FSDP2 training on 2 workers, evaluate, register, serve, all included)
against a fresh embedded store; then the same computations run in this process in plain PyTorch
with no Ray or object store (bench/work.py, through the task seam: the raw PNGs decoded and resized
by the same `decode_image`, the trials' and the final training's epochs, the evaluation, the served
requests' bodies parsed and predicted). `fixed_seconds` is wall − work: what the platform adds.

The goal compares that fixed cost with the quickstart's on the same machine, so the quickstart's
pipeline and work run too, after the digits' (each pipeline serves on a free port; `--set`
overrides apply to the digits pipeline only).
"""

from __future__ import annotations

from benchmarks.load import LoadSampler
from benchmarks.quickstart import STAGES, load, threads, where_rows

# fixed cost (wall − work) of the digits pipeline at most the quickstart's, measured in the same run
GOALS = {"fixed_seconds_vs_quickstart": 0.0}


FIGURES = ("wall_seconds", "wall_vs_work_ratio", "weighted_f1")  # headline figures (workflows.bench.superseded)

def _port_override() -> str:
    from workflows.net import free_port

    return f"serve.port={free_port()}"


def run(config: str | None, overrides: list[str]) -> dict:
    from benchmarks.quickstart import measure_pipeline

    port = [] if any(o.startswith("serve.port=") for o in overrides) else [_port_override()]
    with LoadSampler() as digits_load:
        digits = measure_pipeline(config or "digits", [*port, *overrides], repeats=1)
    with LoadSampler() as quickstart_load:
        quickstart = measure_pipeline("quickstart", [_port_override()], repeats=1)
    load = {"digits": digits_load.summary(), "quickstart": quickstart_load.summary()}
    return {**digits, **compare(digits, quickstart), "quickstart": quickstart, "load_average": load, "goals": GOALS}


def compare(digits: dict, quickstart: dict) -> dict:
    """The digits run's fixed cost against the quickstart's (same run), overall and per stage."""
    gap = round(digits["fixed_seconds"] - quickstart["fixed_seconds"], 1)
    stages = {s: round(digits["stages"][s]["fixed_seconds"] - quickstart["stages"][s]["fixed_seconds"], 2)
              for s in STAGES if s in digits["stages"] and s in quickstart["stages"]}
    return {"fixed_vs_quickstart_seconds": gap, "stage_fixed_vs_quickstart_seconds": stages,
            "goals_met": {"fixed_seconds_vs_quickstart": gap <= GOALS["fixed_seconds_vs_quickstart"]}}


def _stage_row(name: str, d: dict | None, q: dict | None) -> str:
    def cells(v: dict | None) -> list[str]:
        if not v:
            return ["", "", "", ""]
        return [f"{v['wall_seconds']:.1f}", f"{v['work_seconds']:.1f}", f"{v['fixed_seconds']:.1f}",
                f"{v['wall_vs_work_ratio']}x"]

    return "| " + " | ".join([name, *cells(d), *cells(q)]) + " |"


def markdown(r: dict) -> str:
    q, w = r["quickstart"], r["work"]
    met = "met" if r["goals_met"]["fixed_seconds_vs_quickstart"] else "**not met**"
    rows = [f"| **pipeline** | {r['wall_seconds']:.0f} | {r['work_seconds']:.0f} | **{r['fixed_seconds']:.0f}** "
            f"| **{r['wall_vs_work_ratio']}x** | {q['wall_seconds']:.0f} | {q['work_seconds']:.0f} "
            f"| **{q['fixed_seconds']:.0f}** | {q['wall_vs_work_ratio']}x |"]
    rows += [_stage_row(s, r["stages"].get(s), q["stages"].get(s)) for s in STAGES
             if s in r["stages"] or s in q["stages"]]
    rows.append(f"| outside the stages (process, object store, Ray start and stop) | {r['outside_stages_seconds']:.1f} "
                f"| 0 | {r['outside_stages_seconds']:.1f} | | {q['outside_stages_seconds']:.1f} | 0 "
                f"| {q['outside_stages_seconds']:.1f} | |")
    gaps = ", ".join(f"{s} {v:+.1f} s" for s, v in r["stage_fixed_vs_quickstart_seconds"].items())
    where = where_rows(r["breakdown"], "Ray Data read/decode/write")
    tune = w.get("tune", {})
    ev = w["evaluate"]
    # results stored before the load was sampled during the runs carry only the load before each pipeline
    before = r.get("load_before_pipeline", {})
    unsampled = {k: {"mean": f"not sampled (before: {before.get(k, 'n/a')})", "max": "n/a"}
                 for k in ("digits", "quickstart")}
    d_load, q_load = r.get("load_average", unsampled)["digits"], r.get("load_average", unsampled)["quickstart"]
    acc = f"{r['accuracy']:.4f}" if r.get("accuracy") is not None else "n/a"
    work_acc = f"{ev['accuracy']:.4f} / " if ev.get("accuracy") is not None else ""
    return f"""## Digits: the image pipeline beside its work

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs{load(r)}, torch {r["machine"]["torch"]})

`workflows pipeline --config configs/digits.yaml` in a fresh process from an empty store, then the
same computations in one plain-PyTorch process without Ray or an object store (`benchmarks/work.py`,
through the task seam: reading the tar shards and decoding + resizing {w["preprocess"]["rows"]} PNGs to
32x32 with `decode_image`; {tune.get("trials", 0)} trials, {tune.get("epochs", 0)} trial-epochs on {threads(tune, "thread(s)")};
the final {w["train"]["epochs"]} epoch(s) on {threads(w["train"], "threads")}; evaluating {ev["rows"]} held-out images;
{w["serve"]["requests"]} single-image requests, JSON base64 PNGs parsed, decoded and predicted).
The quickstart's pipeline and work then ran the same way in the same run (`bench digits` runs both), for
its fixed cost on the same machine at about the same time. The machine's 1-minute load average (2 CPUs; other work
shares them) while each ran, pipeline and work: digits mean {d_load["mean"]} (max {d_load["max"]}), quickstart mean
{q_load["mean"]} (max {q_load["max"]}); a higher load lengthens wall and work, and the fixed cost with them.

| stage | digits wall s | work s | fixed s | wall / work | quickstart wall s | work s | fixed s | wall / work |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
{chr(10).join(rows)}

Serve deploys while the evaluation runs, so their wall seconds overlap; each pipeline's total counts them once.

| measure | value | goal |
| --- | --- | --- |
| fixed cost (wall − work), digits − quickstart, same run | {r["fixed_vs_quickstart_seconds"]:+.1f} s ({r["fixed_seconds"]:.1f} vs {q["fixed_seconds"]:.1f} s) | <= 0 ({met}) |
| the same, stage by stage | {gaps} | |
| digits wall ÷ work | {r["wall_vs_work_ratio"]}x ({r["wall_seconds"]:.1f} vs {r["work_seconds"]:.1f} s) | |
| held-out accuracy / weighted F1 | {acc} / {r["weighted_f1"]:.4f} ({r["test_rows"]} images) | |
| the same model in the work's process: accuracy / weighted F1 | {work_acc}{ev["weighted_f1"]:.4f} | equal |
| majority-class baseline F1, same images | {r["majority_baseline_f1"]:.4f} | |
| predictions served over HTTP | {r["served_predictions"]} | |

Where the digits pipeline's rest goes (as each stage measured itself):

| stage | seconds |
| --- | --- |
{chr(10).join(where)}
"""  # noqa: E501 (markdown table rows: one line each)


if __name__ == "__main__":
    from benchmarks.record import main

    main("digits")

"""Chat: the demo, `workflows pipeline --config chat`, from an empty store and an empty model cache.

The pipeline runs as the real command in a fresh process, as a user's first run does: Ray start-up,
the synthetic instruction set built, SmolLM2-135M-Instruct converted from the packaged GGUF into the
model cache, LoRA fine-tuning on 2 workers, evaluation of the fine-tuned and the base model on the
held-out split, registration, then Serve with the demo's streamed requests. The goals are the chat
issue's: the whole command within 15 minutes on 2 cores, and held-out exact match at least 30 points
over the base model's.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from benchmarks.load import LoadSampler
from benchmarks.pipeline_run import run_pipeline_in

GOALS = {"wall_seconds": 900.0, "exact_match_gain": 0.30}  # at most; at least
EPOCH_KEYS = ("epoch", "train_loss", "val_loss", "val_exact_match")
FIGURES = ("wall_seconds", "exact_match", "exact_match_gain")  # headline figures (benchmarks.record.superseded)


def run(config: str | None, overrides: list[str]) -> dict:
    from workflows.net import free_port

    port = [] if any(o.startswith("serve.port=") for o in overrides) else [f"serve.port={free_port()}"]
    with tempfile.TemporaryDirectory() as tmp, LoadSampler() as load:
        wall, summary = run_pipeline_in(tmp, config or "chat", [*port, *overrides])
        run_dir = next(Path(tmp, "runs").glob("*/pipeline.json")).parent
        train = json.loads((run_dir / "train.json").read_text())["train"]
        held_out = json.loads((run_dir / "evaluation" / "evaluation.json").read_text())
    ev = summary["evaluate"]
    em, base = ev["headline"]["value"], ev["baseline"]["exact_match"]
    history = train.get("history") or []
    return {
        "wall_seconds": round(wall, 1),
        "stage_seconds": {k: round(v, 1) for k, v in summary["seconds"].items()},
        "exact_match": round(em, 4),
        "base_exact_match": round(base, 4),
        "exact_match_gain": round(em - base, 4),
        "loss": round(held_out["loss"], 4),
        "base_loss": round(ev["baseline"]["loss"], 4),
        "test_rows": ev["rows"],
        "train_rows": history[0]["samples"] if history else None,
        "epochs": [{k: h[k] for k in EPOCH_KEYS if k in h} for h in history],
        "served": [{"prompt": r["instance"]["messages"][-1]["content"], **r["prediction"]}
                   for r in summary.get("serve", {}).get("requests", [])],
        "model": summary["model"]["name"] + ":v" + str(summary["model"]["version"]),
        "cpus": os.cpu_count(),
        "load_average": load.summary(),
        "goals": GOALS,
        "goals_met": {"wall_seconds": wall <= GOALS["wall_seconds"],
                      "exact_match_gain": em - base >= GOALS["exact_match_gain"]},
    }


def markdown(r: dict) -> str:
    def met(key: str) -> str:
        return "met" if r["goals_met"][key] else "**not met**"

    la = r["load_average"]
    epochs = "\n".join("| " + " | ".join(f"{h[k]:.4f}" if k != "epoch" else str(h[k]) for k in EPOCH_KEYS) + " |"
                       for h in r["epochs"])
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in r["stage_seconds"].items() if k != "total")
    served = "; ".join(f"{s['prompt']!r} -> {s['text']!r} ({s['finish_reason']})" for s in r["served"])
    return f"""## Chat: the demo pipeline, LoRA on SmolLM2-135M-Instruct

`{r["command"]}` ({r["measured_at"]}, {r["cpus"]} CPUs, load average {la["before"]} before, {la["mean"]} mean and
{la["max"]} at most during the run): `workflows pipeline
--config chat` in a fresh process from an empty store and an empty model cache (the GGUF conversion
included), {r["train_rows"]} training conversations, {r["test_rows"]} held out. Stages: {stages}.

| figure | measured | goal |
| --- | --- | --- |
| the whole command | {r["wall_seconds"]:.0f} s | <= {r["goals"]["wall_seconds"]:.0f} s: {met("wall_seconds")} |
| held-out exact match, fine-tuned ({r["model"]}) | {r["exact_match"]:.4f} | |
| held-out exact match, base model | {r["base_exact_match"]:.4f} | |
| gain | **{100 * r["exact_match_gain"]:+.1f} points** | >= {100 * r["goals"]["exact_match_gain"]:.0f}: {met("exact_match_gain")} |
| held-out loss, fine-tuned / base | {r["loss"]} / {r["base_loss"]} | |

| epoch | train loss | val loss | val exact match |
| --- | --- | --- | --- |
{epochs}

Served after registration, streamed: {served}.
"""  # noqa: E501 (markdown table rows: one line each)


if __name__ == "__main__":
    from benchmarks.record import main

    main("chat")

"""Chat: the demo, `workflows pipeline --config chat`, from an empty store and an empty model cache.

The pipeline runs as the real command in a fresh process, as a user's first run does: Ray start-up,
the synthetic instruction set built, SmolLM2-135M-Instruct converted from the packaged GGUF into the
model cache, LoRA fine-tuning on 2 workers, evaluation of the fine-tuned and the base model on the
held-out split, registration, then Serve with the demo's streamed requests. The goals are the chat
issue's: the whole command within 15 minutes on 2 cores, and held-out exact match at least 30 points
over the base model's.

Then the registered model serves the held-out conversations through its serving engine in each
`serve.precision` (fp32, bf16), greedy, the precisions interleaved and repeated: the exact match of the
served answers and the engine's tokens/s in each, so that bf16 is offered only with the score it keeps.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.load import LoadSampler
from benchmarks.pipeline_run import fresh_overrides, run_pipeline_in

GOALS = {"wall_seconds": 900.0, "exact_match_gain": 0.30}  # at most; at least
PRECISIONS = ("fp32", "bf16")
REPEATS = 3
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
        model = f'{summary["model"]["name"]}:{summary["model"]["version"]}'
        served = served_precisions(tmp, config or "chat", [*port, *overrides], model)
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
        "served_precisions": served,
        "cpus": os.cpu_count(),
        "load_average": load.summary(),
        "goals": GOALS,
        "goals_met": {"wall_seconds": wall <= GOALS["wall_seconds"],
                      "exact_match_gain": em - base >= GOALS["exact_match_gain"]},
    }


def held_out_conversations(cfg, system_prompt: str | None) -> list[tuple[list[dict], str]]:
    """The built-in set's held-out conversations, split as preprocessing splits them: (the messages the
    assistant answers, the reference answer)."""
    from workflows.dataset import split_of
    from workflows.preprocess import chat_data
    from workflows.tasks.chat.training.data import to_messages

    d, out = cfg.data, []
    for row in chat_data.build(d.builtin_rows_per_class):
        messages = to_messages(row, system_prompt)
        if messages is None:  # the built-in rows all end with an answer; preprocessing drops one that does not
            continue
        key = json.dumps(messages, sort_keys=True)
        if split_of(key, d.split_seed, d.val_fraction, d.test_fraction) == "test":
            out.append((messages[:-1], messages[-1]["content"]))
    return out


def served_runs(tmp: str, config: str, overrides: list[str], model: str,
                variants: dict[str, tuple[list[str], str]], repeats: int) -> tuple[dict, list[str], int]:
    """The registered `model`'s held-out answers through its serving engine (ChatPredictor.predict, as the
    serve stage and batch prediction reach it) in each variant ({name: (config overrides, serve.precision)}),
    greedy, up to the evaluation's max_new_tokens, the variants interleaved and repeated: ({name: [{"exact_match",
    "tokens_per_s", "texts"} per repeat]}, the reference answers, max_tokens)."""
    import time

    import ray

    from workflows import registry
    from workflows.config import load_config
    from workflows.runtime import runtime
    from workflows.tasks import task_for_card
    from workflows.tasks.chat.training.scoring import exact_match

    sets = [*fresh_overrides(tmp), *overrides]
    cfg = load_config(config, sets)
    with runtime(cfg, ray_needed=False) as rt:
        model_dir, card = registry.fetch(rt.cfg, rt.storage, model)
    new_tokens = task_for_card(cfg, card).options.max_new_tokens  # the serving engine's cap, as evaluated
    sets = [*sets, f"serve.generate.max_tokens={new_tokens}"]
    held_out = held_out_conversations(cfg, task_for_card(load_config(config, sets), card).options.system_prompt)
    instances = [{"messages": messages} for messages, _ in held_out]
    answers = [answer for _, answer in held_out]
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (extra, precision) in variants.items():
            task = task_for_card(load_config(config, [*sets, *extra]), card)
            if task.cfg.serve.generate.engine != "builtin" and not ray.is_initialized():  # its engine is an actor
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
            predictor: Any = task.serving.predictor(model_dir, card, threads=os.cpu_count(), precision=precision)
            engine = predictor.engine  # loaded before the clock starts
            predictor.predict(instances[:2])  # warm-up
            t0 = time.perf_counter()
            out = predictor.predict(instances)
            seconds = time.perf_counter() - t0
            engine.close()
            tokens = sum(o["completion_tokens"] for o in out)
            runs[name].append({"exact_match": round(exact_match(answers, [o["text"] for o in out]), 4),
                               "tokens_per_s": round(tokens / seconds, 2), "texts": [o["text"] for o in out]})
    return runs, answers, new_tokens


def figures_of(runs: dict[str, list[dict]]) -> dict:
    """Each variant's exact match (its first run's; every run's beside) and median tokens/s."""
    out = {}
    for name, done in runs.items():
        speeds = sorted(r["tokens_per_s"] for r in done)
        out[name] = {"exact_match": done[0]["exact_match"], "exact_match_runs": [r["exact_match"] for r in done],
                     "tokens_per_s": speeds[len(speeds) // 2], "tokens_per_s_runs": speeds}
    return out


def served_precisions(tmp: str, config: str, overrides: list[str], model: str, repeats: int = REPEATS) -> dict:
    """Exact match and tokens/s of the served answers in each serve.precision (served_runs)."""
    runs, answers, new_tokens = served_runs(tmp, config, overrides, model, {p: ([], p) for p in PRECISIONS},
                                            repeats)
    figures = figures_of(runs)
    fp32, bf16 = runs["fp32"][0]["texts"], runs["bf16"][0]["texts"]
    return {"rows": len(answers), "max_tokens": new_tokens, "repeats": repeats, **figures,
            "bf16_same_answers": sum(a == b for a, b in zip(fp32, bf16)),
            "bf16_vs_fp32_tokens_per_s": round(figures["bf16"]["tokens_per_s"] / figures["fp32"]["tokens_per_s"], 3),
            "bf16_exact_match_change": round(figures["bf16"]["exact_match"] - figures["fp32"]["exact_match"], 4)}


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
{precisions(r)}"""  # noqa: E501 (markdown table rows: one line each)


def precisions(r: dict) -> str:
    p = r.get("served_precisions")
    if not p:
        return ""
    rows = "\n".join(f"| {name} | {p[name]['exact_match']:.4f} | {p[name]['tokens_per_s']:.1f} "
                     f"({', '.join(f'{x:.1f}' for x in p[name]['tokens_per_s_runs'])}) |" for name in PRECISIONS)
    return f"""
The held-out conversations ({p["rows"]}) through the registered model's serving engine in each
`serve.precision`, greedy, up to {p["max_tokens"]} tokens, {p["repeats"]} runs each, interleaved (tokens/s: the
median, then each run):

| serve.precision | exact match | tokens/s |
| --- | --- | --- |
{rows}

bf16 against fp32: {p["bf16_vs_fp32_tokens_per_s"]:.2f}x the tokens/s, exact match
{100 * p["bf16_exact_match_change"]:+.1f} points, {p["bf16_same_answers"]} of {p["rows"]} answers the same text.
"""


if __name__ == "__main__":
    from benchmarks.record import main

    main("chat")

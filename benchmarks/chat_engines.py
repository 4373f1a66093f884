"""Chat on either engine: the demo's registered model (`workflows pipeline --config chat`, from an empty store)
answering its held-out conversations through ChatPredictor.predict with serve.generate.engine builtin and
vllm (vLLM's engine, `make vllm`), greedy, the engines interleaved and repeated: the exact match of each
engine's answers, how many answers are the same text, and each engine's tokens/s (batch prediction: the
rows submitted as the engine's queue takes them).

The goal is #72's: vLLM's exact match within 0.02 of the builtin engine's, on the same registered adapter.

    python -m benchmarks.chat_engines   # make bench-chat-engines; about 30 minutes on 2 cores
"""

from __future__ import annotations

import os
import tempfile

from benchmarks.chat import figures_of, served_runs
from benchmarks.load import LoadSampler
from benchmarks.pipeline_run import run_pipeline_in

ENGINES = ("builtin", "vllm")
REPEATS = 2
GOALS = {"vllm_exact_match_change": 0.02}  # at most, either way


def run(config: str | None, overrides: list[str]) -> dict:
    from workflows.config import load_config
    from workflows.net import free_port

    port = [] if any(o.startswith("serve.port=") for o in overrides) else [f"serve.port={free_port()}"]
    with tempfile.TemporaryDirectory() as tmp, LoadSampler() as load:
        _, summary = run_pipeline_in(tmp, config or "chat", [*port, "serve.enabled=false", *overrides])
        model = f'{summary["model"]["name"]}:{summary["model"]["version"]}'
        variants = {e: ([f"serve.generate.engine={e}"], "fp32") for e in ENGINES}
        runs, answers, new_tokens = served_runs(tmp, config or "chat", [*port, *overrides], model, variants, REPEATS)
    figures = figures_of(runs)
    change = round(figures["vllm"]["exact_match"] - figures["builtin"]["exact_match"], 4)
    rank = load_config(config or "chat", overrides).serve.generate.max_lora_rank
    return {"model": model, "max_lora_rank": rank, "rows": len(answers), "max_tokens": new_tokens,
            "repeats": REPEATS, **figures,
            "vllm_same_answers": sum(a == b for a, b in zip(runs["builtin"][0]["texts"], runs["vllm"][0]["texts"])),
            "vllm_exact_match_change": change,
            "vllm_vs_builtin_tokens_per_s": round(figures["vllm"]["tokens_per_s"]
                                                  / figures["builtin"]["tokens_per_s"], 3),
            "cpus": os.cpu_count(),  # each engine's threads: the predictor gets every CPU
            "load_average": load.summary(), "goals": GOALS,
            "goals_met": {"vllm_exact_match_change": abs(change) <= GOALS["vllm_exact_match_change"]}}


def markdown(r: dict) -> str:
    b, v, la = r["builtin"], r["vllm"], r["load_average"]
    return f"""## Chat on either engine: the demo's adapter through the builtin engine and vLLM's

`{r["command"]}` ({r["measured_at"]}, {r["cpus"]} CPUs, load average {la["before"]} before, {la["mean"]} mean and
{la["max"]} at most during the run). The chat demo's registered
model ({r["model"]}: a LoRA adapter of SmolLM2-135M-Instruct) answers its {r["rows"]} held-out conversations
through `ChatPredictor.predict` (what `workflows predict` and the serve stage reach), greedy, at most
{r["max_tokens"]} new tokens, with `serve.generate.engine` builtin and vllm (vLLM's CPU build in its own venv,
the adapter through its LoRA at `serve.generate.max_lora_rank` {r["max_lora_rank"]}), the engines interleaved,
{r["repeats"]} repeats.

| engine | CPU threads | exact match (each run) | tokens/s (median; runs) |
| --- | --- | --- | --- |
| builtin | {r["cpus"]} | {b["exact_match"]:.4f} ({", ".join(f"{x:.4f}" for x in b["exact_match_runs"])}) | {b["tokens_per_s"]:.1f} ({", ".join(f"{x:.1f}" for x in b["tokens_per_s_runs"])}) |
| vllm | {r["cpus"]} | {v["exact_match"]:.4f} ({", ".join(f"{x:.4f}" for x in v["exact_match_runs"])}) | {v["tokens_per_s"]:.1f} ({", ".join(f"{x:.1f}" for x in v["tokens_per_s_runs"])}) |

The same answer text from both engines: {r["vllm_same_answers"]} of {r["rows"]}. Exact match change, vllm less
builtin: {r["vllm_exact_match_change"]:+.4f} (goal: within {r["goals"]["vllm_exact_match_change"]}:
{"met" if r["goals_met"]["vllm_exact_match_change"] else "**not met**"}); vLLM's tokens/s over the builtin
engine's: {r["vllm_vs_builtin_tokens_per_s"]:.2f}x (batch prediction, LoRA on: vLLM's CPU build runs without its
compile then).
"""  # noqa: E501 (markdown table rows: one line each)


if __name__ == "__main__":
    from benchmarks.record import main

    main("chat-engines")

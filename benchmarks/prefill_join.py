"""A long prompt joining running streams: what it does to their token gaps, with the prefill budget in
time (serve.generate.mixed_step_ratio) against budgets in tokens.

The chat config's base model (SmolLM2-135M-Instruct, fp32, its forward and linears as served), the engine
called directly on these cores, built as a replica builds it from serve.generate but for the budget each
row names. Each join: 8 streams decoding (256 tokens each, eos ignored), then a 1,500-token prompt
joins them; the streams' token gaps while it is prefilled (from its arrival to its first token) against
their other gaps (their median), and its time to first token. Before its joins an engine runs its first
mixed steps (prompts of many lengths joining 4 streams): the time budget learns its costs from them, as
a replica from its first requests. One engine at a time, as a replica has one (each closed before the
next is built); rows interleaved, REPEATS joins each.
"""

from __future__ import annotations

import statistics
import time

REPEATS = 2
STREAMS, LONG, STREAM_TOKENS = 8, 1500, 256
FIGURES = ("time_p50_ratio", "time_p90_ratio", "tokens24_p50_ratio")
CONFIG = "the config's"  # a row's mixed_step_ratio: serve.generate's (its default unless overridden)
ROWS: dict[str, tuple[str, float | str | None, int]] = {  # row -> (label, mixed_step_ratio, prefill_chunk)
    "time": ("time: mixed_step_ratio {ratio} (the config's)", CONFIG, 24),
    "time17": ("time: mixed_step_ratio 1.7 (a sooner first token, wider gaps)", 1.7, 24),
    "tokens24": ("tokens: prefill_chunk 24, no time budget", None, 24),
    "tokens256": ("tokens: prefill_chunk 256 (a budget sized for a faster step), no time budget", None, 256),
}


def _engine(model, tokenizer, gen, ratio, chunk):
    from workflows.tasks.chat.engine import Engine

    return Engine(model, tokenizer, max_batch=STREAMS + 1, max_queue=gen.max_queue, max_context=LONG + 300,
                  prefill_chunk=chunk, max_prefill_tokens=max(gen.max_prefill_tokens, chunk),
                  mixed_step_ratio=ratio, prepack=gen.prepack_weights, forward=gen.forward)


def wait_for(predicate, seconds: float) -> None:
    """Poll `predicate` every 20 ms (seldom taking the GIL from the engine's thread) until true."""
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError("the engine did not get there in time")
        time.sleep(0.02)


def _first_steps(engine, prompt: list[int]) -> None:
    """A replica's first mixed steps: prompts of many lengths joining 4 streams."""
    from workflows.tasks.chat.engine import SamplingParams

    streams = [engine.submit(prompt[i:i + 8], SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True),
                             deadline=False) for i in range(4)]
    wait_for(lambda: all(len(r.tokens) >= 3 for r in streams), 120)
    for n in (40, 700, 120, 300, 1200, 80, 450):
        engine.submit(prompt[:n], SamplingParams(max_tokens=2, temperature=0), deadline=False).result(600)
    for r in streams:
        r.cancel()
    wait_for(lambda: not engine._rows, 120)


def _join(engine, prompt: list[int], shift: int) -> dict:
    from workflows.tasks.chat.engine import SamplingParams
    from workflows.tasks.chat.engine.measure import gaps_while_prefilled

    rows = [engine.submit(prompt[shift + 9 * i:shift + 9 * i + 16], SamplingParams(
        max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True), deadline=False) for i in range(STREAMS)]
    wait_for(lambda: all(len(r.tokens) >= 16 for r in rows), 300)
    long = engine.submit(prompt[shift:] + prompt[:shift], SamplingParams(max_tokens=4, temperature=0), deadline=False)
    long.result(600)
    for r in rows:
        r.result(600)
    during, outside = gaps_while_prefilled(rows, long)
    during.sort()
    usual = statistics.median(outside)
    return {"usual_ms": 1e3 * usual, "p50": statistics.median(during) / usual,
            "p90": statistics.quantiles(during, n=10)[-1] / usual, "max": during[-1] / usual,
            "ttft_s": long.times["first_token"] - long.times["submitted"], "steps": len(during) // STREAMS}


def run(config: str | None, overrides: list[str]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workflows.config import load_config
    from workflows.tasks.chat.training.smollm2 import smollm2_dir

    cfg = load_config(config or "chat", overrides)
    base = smollm2_dir(cfg.cache.resolved_dir())
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    text = " ".join(f"Question {i}: what does a scheduler owe the streams it already runs?" for i in range(200))
    prompt = tokenizer(text)["input_ids"][:LONG]
    gen = cfg.serve.generate
    joins: dict[str, list[dict]] = {name: [] for name in ROWS}
    for repeat in range(REPEATS):  # interleaved: every row sees the same machine
        for name, (_, ratio, chunk) in ROWS.items():
            # an engine at a time, as a replica has one: its first steps, a join, closed (its threads gone)
            engine = _engine(model, tokenizer, gen, gen.mixed_step_ratio if ratio == CONFIG else ratio, chunk)
            try:
                _first_steps(engine, prompt)
                joins[name].append(_join(engine, prompt, shift=300 * repeat))
            finally:
                engine.close()
    rows = []
    for name, (label, _, _) in ROWS.items():
        js = joins[name]
        rows.append({"row": name, "label": label.format(ratio=gen.mixed_step_ratio), "joins": js,
                     **{k: round(statistics.median(j[k] for j in js), 2) for k in ("p50", "p90", "max", "ttft_s")},
                     "usual_ms": round(statistics.median(j["usual_ms"] for j in js), 1)})
    by = {r["row"]: r for r in rows}
    return {"rows": rows, "repeats": REPEATS, "threads": torch.get_num_threads(),
            "time_p50_ratio": by["time"]["p50"], "time_p90_ratio": by["time"]["p90"],
            "tokens24_p50_ratio": by["tokens24"]["p50"]}


def markdown(r: dict) -> str:
    from benchmarks.quickstart import load

    rows = "\n".join(f"| {x['label']} | {x['usual_ms']:.0f} | {x['p50']:.2f}x | {x['p90']:.2f}x | {x['max']:.2f}x | "
                     f"{x['ttft_s']:.1f} |" for x in r["rows"])
    return f"""## A long prompt joining running streams: their token gaps, the prefill budget in time against tokens

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs{load(r)})

SmolLM2-135M fp32 (linears packed, as served), the engine called directly with {r["threads"]} threads: 8
streams decoding, then a 1,500-token prompt joins them; the streams' token gaps while it is prefilled,
over their median gap outside it (the medians of {r["repeats"]} joins per row, rows interleaved), and the
long prompt's time to first token. Each engine first ran its own first mixed steps (prompts of many
lengths joining 4 streams), as a replica does with its first requests: the time budget learns from them.

| budget | gap outside (ms) | gap while prefilling, p50 | p90 | max | its TTFT (s) |
| --- | --- | --- | --- | --- | --- |
{rows}

Goal (#71): a step beside decoding rows within about 1.7x a decode-only step: the time budget's p50
{r["time_p50_ratio"]:.2f}x and p90 {r["time_p90_ratio"]:.2f}x.
"""  # noqa: E501 (markdown table rows: one line each)


if __name__ == "__main__":
    from benchmarks.record import main

    main("prefill-join")

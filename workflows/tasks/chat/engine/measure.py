"""Open-loop generation runs, for a quick look without the benchmark: the serving engine
(workflows.tasks.chat.engine, continuous batching) with requests arriving at given times, against static
batching with plain `generate` (left-padded batches), on the same prompts, greedy, with EOS ignored so
that both produce exactly `max_tokens` per prompt. `workflows bench generate` (workflows.bench.generate)
is the benchmark: closed-loop clients at fixed concurrencies, per-token timings, and a peer over HTTP.

Each run returns plain numbers (tokens/s; for the engine also time to first token and latency
percentiles, and the mean batch it decoded), ready for benchmarks/results/*.json. Nothing here times
itself on import or in tests: the tests check the accounting on a tiny model, not the speed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from workflows.tasks.chat.engine import Engine
from workflows.tasks.chat.engine.params import SamplingParams


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def gaps_while_prefilled(rows: Sequence, joined) -> tuple[list[float], list[float]]:
    """The token gaps of `rows` (Generations) split by when each ends: (while `joined`, a request that
    joined them, was prefilled: from its submission to its first token; the others)."""
    start, end = joined.times["submitted"], joined.times["first_token"]
    gaps = [(b, b - a) for r in rows for a, b in zip(r.token_times, r.token_times[1:])]
    return [g for t, g in gaps if start <= t <= end], [g for t, g in gaps if not start <= t <= end]


def engine_run(engine: Engine, prompts: list[list[int]], max_tokens: int,
               arrivals_s: Sequence[float] | None = None) -> dict:
    """Every prompt through `engine`, each submitted at its arrival time (seconds from the start; default:
    all at once), greedy, EOS ignored (`ignore_eos`)."""
    before = dict(engine.stats)
    t0 = time.perf_counter()
    gens = []
    for i, p in enumerate(prompts):
        if arrivals_s is not None:
            time.sleep(max(0.0, t0 + arrivals_s[i] - time.perf_counter()))
        gens.append(engine.submit(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)))
    for g in gens:
        g.result(timeout=3600)
    seconds = time.perf_counter() - t0
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    tokens = sum(g.completion_tokens for g in gens)
    ttft = [g.times["first_token"] - g.times["submitted"] for g in gens]
    latency = [g.times["finished"] - g.times["submitted"] for g in gens]
    return {"path": "engine (continuous batching)", "requests": len(gens), "tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "ttft_s_p50": round(percentile(ttft, 0.5), 4), "ttft_s_p90": round(percentile(ttft, 0.9), 4),
            "latency_s_p50": round(percentile(latency, 0.5), 4), "latency_s_p90": round(percentile(latency, 0.9), 4),
            "mean_batch": round((engine.stats["row_steps"] - before["row_steps"]) / max(steps, 1), 2),
            "max_batch": engine.max_batch}


def static_run(model, tokenizer, prompts: list[list[int]], max_tokens: int, batch_size: int) -> dict:
    """The same prompts with `model.generate`, `batch_size` at a time, left-padded, greedy, EOS ignored."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, use_cache=True,
                                 pad_token_id=pad)
        tokens += (out.shape[1] - width) * len(batch)
    seconds = time.perf_counter() - t0
    return {"path": f"static batching (generate, {batch_size} a batch)", "requests": len(prompts), "tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}

"""The engine's decode attention with its kernel against torch's operators (workflows.tasks.chat.engine.kernels):
the attention of a decode step of ROWS rows, every layer of SmolLM2-135M's shape (30 layers, 9 query heads over 3
key/value heads of 64), through the engine's own `attend` on plans of its own `SlotCache` (the cache's writes
included, as a step runs it), one cache with the kernel and one with torch's operators, the same keys, values and
queries in both. Rows of different lengths, as a closed loop's are (spread evenly from 0.6x to 1.4x the mean
context); a 256 MB buffer is written before each step, as a step's weights stream through the caches and evict the
cache between its layers' reads. The two kinds alternate step by step, STEPS each per context; the medians.
"""

from __future__ import annotations

import statistics
import time

ROWS, STEPS = 32, 21
CONTEXTS = (88, 600)  # the generation bench's mean context at 32 rows (87.5), and a longer conversation's
FIGURES = tuple(f"kernel_speedup_ctx{c}" for c in CONTEXTS)


def _caches(config, kinds: tuple[str, ...], capacity: int, seed: int):
    import torch

    from workflows.tasks.chat.engine.cache import SlotCache

    caches = {k: SlotCache(config, ROWS, capacity, torch.device("cpu"), torch.float32, attention_kernel=k)
              for k in kinds}
    g = torch.Generator().manual_seed(seed)
    first = caches[kinds[0]]
    first.reserve(capacity)
    for store in (first.keys, first.values):
        for t in store:
            t.copy_(torch.randn(t.shape, generator=g))
    for other in kinds[1:]:
        caches[other].reserve(capacity)
        for mine, theirs in ((caches[other].keys, first.keys), (caches[other].values, first.values)):
            for a, b in zip(mine, theirs):
                a.copy_(b)
    return caches


def measure(context: int, threads: int) -> dict:
    import torch
    from transformers import AutoConfig

    from workflows.config import load_config
    from workflows.tasks.chat.engine.cache import attend, attention_shape
    from workflows.tasks.chat.training.smollm2 import smollm2_dir

    torch.set_num_threads(threads)
    config = AutoConfig.from_pretrained(smollm2_dir(load_config("chat", []).cache.resolved_dir(), say=lambda *_: None))
    layers, heads, kv_heads, dim = attention_shape(config)
    lengths = [round(context * (0.6 + 0.8 * i / (ROWS - 1))) for i in range(ROWS)]
    order = list(range(ROWS))
    order = order[::2] + order[1::2]  # slots not in length order
    positions = [lengths[i] - 1 for i in order]
    caches = _caches(config, ("kernel", "torch"), max(lengths) + 8, seed=context)
    g = torch.Generator().manual_seed(1)
    query = [torch.randn(ROWS, heads, 1, dim, generator=g) for _ in range(layers)]
    key = [torch.randn(ROWS, kv_heads, 1, dim, generator=g) for _ in range(layers)]
    value = [torch.randn(ROWS, kv_heads, 1, dim, generator=g) for _ in range(layers)]
    flush = torch.zeros(64 << 20)
    seconds: dict[str, list[float]] = {"kernel": [], "torch": []}
    outputs = {}
    with torch.inference_mode():
        for step in range(STEPS + 1):
            for kind in ("kernel", "torch") if step % 2 else ("torch", "kernel"):
                cache = caches[kind]
                plan = cache.plan(list(range(ROWS)), positions, list(range(ROWS)), [])
                flush.add_(1.0)
                started = time.perf_counter()
                out = [attend(plan, layer, query[layer], key[layer], value[layer], None) for layer in range(layers)]
                if step:  # the first of each: warm-up
                    seconds[kind].append(time.perf_counter() - started)
                outputs[kind] = out[-1]
    read = 2 * layers * kv_heads * dim * 4 * sum(lengths)  # the keys and values each row attends to, once
    ms = {k: round(1e3 * statistics.median(v), 2) for k, v in seconds.items()}
    return {"context": context, "mean_context": statistics.mean(lengths), "layers": layers, "ms": ms,
            "ms_runs": {k: [round(1e3 * s, 2) for s in v] for k, v in seconds.items()},
            "kernel_gb_per_s": round(read / (ms["kernel"] / 1e3) / 1e9, 1),
            "max_abs_diff": float((outputs["kernel"] - outputs["torch"]).abs().max()),
            "speedup": round(ms["torch"] / ms["kernel"], 2)}


def run(config: str | None, overrides: list[str]) -> dict:
    import os

    import torch

    threads = torch.get_num_threads() or os.cpu_count() or 1
    rows = [measure(c, threads) for c in CONTEXTS]
    return {"rows_decoding": ROWS, "steps": STEPS, "threads": threads, "contexts": rows,
            **{f"kernel_speedup_ctx{r['context']}": r["speedup"] for r in rows}}


def markdown(r: dict) -> str:
    from benchmarks.quickstart import load

    lines = "\n".join(f"| {c['context']} | {c['ms']['torch']:.2f} | {c['ms']['kernel']:.2f} | "
                      f"{c['speedup']:.2f}x | {c['kernel_gb_per_s']} | "
                      f"{c['max_abs_diff']:.1e} |" for c in r["contexts"])
    return f"""## The engine's decode attention: its kernel against torch's operators

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs{load(r)})

A decode step's attention, every layer of SmolLM2-135M's shape ({r["contexts"][0]["layers"]} layers, 9 query heads
over 3 key/value heads of 64), {r["rows_decoding"]} rows decoding, through the engine's own `attend` (its cache
writes included) on plans of its own cache, {r["threads"]} threads: `serve.generate.attention_kernel: kernel`
(workflows.tasks.chat.engine.kernels: each row read to its own length, once, its query heads together) against
`torch` (two batched matmuls and a softmax, every row read to the longest row's length, masked). The rows' lengths
spread evenly from 0.6x to 1.4x the mean context; a 256 MB buffer is written before each step, as the weights
evict the cache in a real step. The two alternate step by step; medians of {r["steps"]} steps each.

| mean context | torch's operators, ms a step | kernel, ms a step | speedup | kernel reads, GB/s | max abs difference |
| --- | --- | --- | --- | --- | --- |
{lines}
"""


if __name__ == "__main__":
    from benchmarks.record import main

    main("decode-attention")

"""Where a step of the engine's forward goes: torch.profiler over its steps, SmolLM2-135M fp32 as served.

The chat config's base model, its linears packed as a replica packs them, the engine built from
serve.generate and called directly on these cores, first with its forward eager (transformers' modules),
then compiled (workflows.tasks.chat.engine.compiled), one engine at a time on the same weights. Kinds of
step, each profiled over STEPS steps in the engine's own thread (started and stopped there between two
steps, `Engine.call`): decode-only at 1 row (eager: on the packed weights, the default, and on the weights themselves;
compiled: on its one-token graph, the default for this model, and on the dynamic graph) and at 16 rows
(every row decoding, nothing joining), and mixed (a 1,500-token prompt prefilled beside 16 decoding rows,
chunked by the time budget). Per kind: the step's wall time, the operators it runs
(their count and self CPU time per step, grouped: matmuls, attention, elementwise and norms, cache and
indexing, sampling, the compiled graph's fused loops and torch.compile's runtime, the rest), and what
the operators do not account for (Python, dispatch, allocation): before and after the compile.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.prefill_join import wait_for

STEPS, REPEATS = 24, 3
KINDS = ("decode_1_unpacked", "decode_1", "decode_16", "mixed_16", "decode_1_compiled_dynamic", "decode_1_compiled",
         "decode_16_compiled", "mixed_16_compiled")
LABELS = {"decode_1_unpacked": "decode at 1, weights unpacked (MKL)", "decode_1": "decode at 1",
          "decode_16": "decode at 16",
          "mixed_16": "mixed at 16", "decode_1_compiled": "compiled, one-token graph: decode at 1",
          "decode_1_compiled_dynamic": "compiled, no one-token graph: decode at 1",
          "decode_16_compiled": "compiled: decode at 16", "mixed_16_compiled": "compiled: mixed at 16"}
FIGURES = ("one_row_unpacked_over_packed", "decode_16_ms", "decode_16_ops", "decode_16_outside_ops_share",
           "decode_16_compiled_ms", "compiled_speedup_decode_1", "compiled_speedup_decode_16",
           "compiled_speedup_mixed_16", "one_token_speedup_decode_1")
# the compiled graph's own ranges (no "::" in their names): its fused loops run inside the graph's call; the rest
# is torch.compile's runtime (the guards' check, its wrappers)
COMPILED = {"## Call CompiledFxGraph": "inductor's fused loops (norms, rotary, SiLU, residuals: the graph's call)",
            "TorchDynamo Cache Lookup": "torch.compile's runtime (guards, wrappers)",
            "Torch-Compiled Region": "torch.compile's runtime (guards, wrappers)",
            "Pregraph bytecode": "torch.compile's runtime (guards, wrappers)",
            "AOTDispatcher Runtime Wrapper Prologue": "torch.compile's runtime (guards, wrappers)"}
GROUPS = {  # operator name (without "aten::") -> group; what is not here is "other"
    "matmul (linear, mm, addmm, bmm, oneDNN packed)": ("linear", "mm", "addmm", "bmm", "matmul",
                                                       "mkldnn_linear", "_mkl_linear", "_linear_pointwise"),
    "attention (scaled_dot_product_attention)": (
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu", "decode_attention",
        "_scaled_dot_product_attention_math", "softmax", "_softmax", "slot_attention"),
    "elementwise and norms (mul, add, silu, rsqrt, pow, mean, neg, cat)": (
        "mul", "add", "silu", "rsqrt", "pow", "mean", "neg", "cat", "sub", "div", "mul_", "add_", "silu_",
        "to", "_to_copy", "embedding", "cos", "sin"),
    "cache and indexing (index_select, index_copy, copy, views)": (
        "index_select", "index_copy_", "index_put_", "_index_put_impl_", "copy_", "index", "slice", "select",
        "view", "reshape",
        "transpose", "expand", "unsqueeze", "contiguous", "as_strided", "narrow", "repeat", "clone",
        "_unsafe_view", "t", "permute", "squeeze", "empty", "zeros", "fill_", "new_zeros", "arange",
        "masked_fill_", "le", "lt", "ge", "where", "empty_like", "detach", "alias", "_reshape_alias",
        "lift_fresh",
        "resolve_conj", "resolve_neg", "split", "chunk", "stack", "full", "scalar_tensor", "item",
        "_local_scalar_dense", "tensor"),
    "sampling (argmax, topk, gather, multinomial)": ("argmax", "topk", "gather", "multinomial", "sort", "cumsum",
                                                     "max", "log_softmax", "exponential_", "isfinite", "all", "any"),
}


def _group(name: str) -> str | None:
    """The group of a profiled event; None for the profiler's own ranges (ProfilerStep, record_function)."""
    compiled = next((g for prefix, g in COMPILED.items() if name.startswith(prefix)), None)
    if compiled or "::" not in name:
        return compiled
    op = name.split("::", 1)[-1]
    return next((g for g, ops in GROUPS.items() if op in ops), "other")


def _steps_ms(engine, steps: int) -> tuple[int, float]:
    """The next `steps` steps of `engine`: (steps run, wall ms a step), from the engine's count."""
    first, t0 = engine.stats["steps"], time.perf_counter()
    while engine.stats["steps"] < first + steps:
        time.sleep(0.02)  # a poll that seldom takes the GIL from the engine
    ran = engine.stats["steps"] - first
    return ran, 1e3 * (time.perf_counter() - t0) / ran


def _profile(engine, steps: int) -> dict:
    """Profile the next `steps` steps of `engine` in its own thread: wall ms a step, and per group the
    operators' count and self CPU ms a step."""
    from torch.profiler import ProfilerActivity, profile

    _, plain_ms = _steps_ms(engine, steps)  # the same steps unprofiled: the profiler's cost inflates the wall
    prof = profile(activities=[ProfilerActivity.CPU])
    engine.call(prof.__enter__).result(120)
    ran, profiled_ms = _steps_ms(engine, steps)
    engine.call(lambda: prof.__exit__(None, None, None)).result(120)
    groups: dict[str, list[float]] = {}
    top: list[tuple[str, int, float]] = []
    for event in prof.key_averages():
        if (group := _group(event.key)) is None:
            continue
        g = groups.setdefault(group, [0, 0.0])
        g[0] += event.count
        g[1] += event.self_cpu_time_total / 1e3
        top.append((event.key, event.count, event.self_cpu_time_total / 1e3))
    per = {g: {"ops": round(c / ran, 1), "ms": round(ms / ran, 2)} for g, (c, ms) in groups.items()}
    op_ms = sum(v["ms"] for v in per.values())
    top.sort(key=lambda t: -t[2])
    return {"steps": ran, "step_ms": round(plain_ms, 1), "profiled_step_ms": round(profiled_ms, 1),
            "ops": round(sum(c for c, _ in groups.values()) / ran), "groups": per,
            "top": [{"op": k, "calls": round(c / ran, 1), "ms": round(ms / ran, 2)} for k, c, ms in top[:15]],
            "outside_ops_ms": round(max(plain_ms - op_ms, 0.0), 1),
            "outside_ops_share": round(max(1 - op_ms / plain_ms, 0.0), 2)}


def _packed_or_not(engine, kinds: dict) -> dict[str, list[float]]:
    """Decode steps of one row computing with the packed weights and with the weights themselves
    (linear.UNPACKED_ROWS 0, the default, against 2: MKL's matrix-vector path), REPEATS times interleaved,
    then the unpacked one profiled: wall ms a step of each."""
    from workflows.tasks.chat.engine import linear

    default = linear.UNPACKED_ROWS
    walls: dict[str, list[float]] = {"packed": [], "unpacked": []}
    try:
        for _ in range(REPEATS):
            for name, rows in (("packed", 0), ("unpacked", 2)):
                linear.UNPACKED_ROWS = rows
                walls[name].append(round(_steps_ms(engine, STEPS)[1], 1))
        linear.UNPACKED_ROWS = 2
        kinds["decode_1_unpacked"] = _profile(engine, STEPS)
    finally:
        linear.UNPACKED_ROWS = default
    return walls


def _one_token_or_not(engine, kinds: dict) -> dict[str, list[float]]:
    """A compiled engine's decode steps of one row on its one-token graph and on the dynamic graph
    (CompiledForward.one_token switched between steps), REPEATS times interleaved, the order alternating, then
    the dynamic graph's profiled: wall ms a step of each."""
    compiled = engine.compiled
    walls: dict[str, list[float]] = {"one_token": [], "dynamic": []}
    try:
        for repeat in range(REPEATS):
            for name in ("one_token", "dynamic")[::1 if repeat % 2 == 0 else -1]:
                engine.call(lambda: setattr(compiled, "one_token", name == "one_token")).result(120)
                walls[name].append(round(_steps_ms(engine, STEPS)[1], 1))
        engine.call(lambda: setattr(compiled, "one_token", False)).result(120)
        kinds["decode_1_compiled_dynamic"] = _profile(engine, STEPS)
    finally:
        engine.call(lambda: setattr(compiled, "one_token", True)).result(120)
    return walls


def _profile_kinds(engine, prompt: list[int], kinds: dict, suffix: str = "") -> dict[str, list[float]]:
    """Profile `engine`'s decode steps at 1 and 16 rows and its mixed steps into kinds[<kind><suffix>]; for
    the eager forward (no suffix) also a lone stream's steps on packed and unpacked weights, for the compiled
    one on its one-token graph and on the dynamic graph (their walls)."""
    from workflows.tasks.chat.engine import SamplingParams
    from workflows.tasks.chat.engine.costs import RECENT

    long_run = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    walls: dict[str, list[float]] = {}
    # the cache grows (by doubling, every layer's keys and values zeroed and copied) the first time a
    # request reaches a length: once per replica, not a step's cost, so out of the profiled steps
    engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0), deadline=False).result(600)
    for rows in (1, 16):
        gens = [engine.submit(prompt[7 * i:7 * i + 16], long_run, deadline=False) for i in range(rows)]
        wait_for(lambda: all(len(g.tokens) >= 8 for g in gens), 300)
        if rows == 1 and not suffix:  # a lone stream's linears: packed (the default) or the weights themselves
            walls = _packed_or_not(engine, kinds)
        elif rows == 1 and engine.compiled is not None and engine.compiled.one_token:
            walls = _one_token_or_not(engine, kinds)
        kinds[f"decode_{rows}{suffix}"] = _profile(engine, STEPS)
        if rows == 16:  # the 16 keep decoding: a long prompt joins them
            # first unprofiled decode steps again: the budget prices prompt tokens over the recent decode-only
            # steps, and the profiler's own cost would make every prompt token look free
            _steps_ms(engine, RECENT)
            long = engine.submit(prompt, SamplingParams(max_tokens=2, temperature=0), deadline=False)
            costs = engine.scheduler.costs  # its first mixed steps are on the token budget: past them
            wait_for(lambda: costs is None or costs.ready, 300)
            kinds[f"mixed_16{suffix}"] = _profile(engine, min(STEPS, 8))
            long.result(600)
        for g in gens:
            g.cancel()
        wait_for(lambda: not engine._rows, 120)
    return walls


def run(config: str | None, overrides: list[str]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workflows.config import load_config
    from workflows.tasks.chat.engine import Engine
    from workflows.tasks.chat.training.smollm2 import smollm2_dir

    cfg = load_config(config or "chat", overrides)
    base = smollm2_dir(cfg.cache.resolved_dir())
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    gen = cfg.serve.generate
    text = " ".join(f"Question {i}: what does a scheduler owe the streams it already runs?" for i in range(200))
    prompt = tokenizer(text)["input_ids"][:1500]
    kinds: dict[str, dict] = {}
    walls: dict[str, list[float]] = {}
    compile_s, refused, one_token_s = None, None, None
    for forward, suffix in (("eager", ""), ("compiled", "_compiled")):  # one engine at a time, on the same weights
        started = time.perf_counter()
        engine = Engine(model, tokenizer, max_batch=17, max_context=2048, prefill_chunk=gen.prefill_chunk,
                        max_prefill_tokens=gen.max_prefill_tokens, mixed_step_ratio=gen.mixed_step_ratio,
                        prepack=gen.prepack_weights, forward=forward, one_token_graph=gen.one_token_graph)
        built_s = time.perf_counter() - started
        try:
            walls.update(_profile_kinds(engine, prompt, kinds, suffix))
        finally:
            engine.close()
        if engine.compiled is not None:
            compile_s = round(built_s, 1)
            refused, one_token_s = engine.compiled.refused, round(engine.compiled.one_token_compile_s, 1)
    d16, c16 = kinds["decode_16"], kinds["decode_16_compiled"]
    unpacked = statistics.median(walls["unpacked"]) / statistics.median(walls["packed"])
    one_token = statistics.median(walls["dynamic"]) / statistics.median(walls["one_token"])
    speedups = {f"compiled_speedup_{k}": round(kinds[k]["step_ms"] / kinds[f"{k}_compiled"]["step_ms"], 2)
                for k in ("decode_1", "decode_16", "mixed_16")}
    return {"one_row_walls_ms": walls, "one_row_unpacked_over_packed": round(unpacked, 3), "kinds": kinds,
            "threads": torch.get_num_threads(), "decode_16_ms": d16["step_ms"],
            "decode_16_ops": d16["ops"], "decode_16_outside_ops_share": d16["outside_ops_share"],
            "mixed_over_decode_16": round(kinds["mixed_16"]["step_ms"] / d16["step_ms"], 2),
            "decode_16_compiled_ms": c16["step_ms"], "compile_s": compile_s, "compiled_refused": refused,
            "one_token_compile_s": one_token_s, "one_token_speedup_decode_1": round(one_token, 2),
            **speedups}


def markdown(r: dict) -> str:
    from benchmarks.quickstart import load

    kinds = r["kinds"]
    names = list(GROUPS) + list(dict.fromkeys(COMPILED.values())) + ["other"]
    head = " | ".join(f"{LABELS[k]} (ms, ops)" for k in KINDS)
    rule = " --- |" * (len(KINDS) + 1)
    lines = []
    for g in names:
        cells = [f"{kinds[k]['groups'].get(g, {}).get('ms', 0):.1f}, {kinds[k]['groups'].get(g, {}).get('ops', 0):.0f}"
                 for k in KINDS]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines.append("| not in any operator (Python, dispatch, allocation) | "
                 + " | ".join(f"{kinds[k]['outside_ops_ms']:.1f} ({100 * kinds[k]['outside_ops_share']:.0f}%)"
                              for k in KINDS) + " |")
    lines.append("| **the step (wall)** | " + " | ".join(f"**{kinds[k]['step_ms']:.1f}**, {kinds[k]['ops']}"
                                                      for k in KINDS) + " |")
    table = "\n".join(lines)
    top, top_compiled = ("\n".join(f"| `{t['op']}` | {t['calls']:.0f} | {t['ms']:.2f} |" for t in kinds[k]["top"][:10])
                         for k in ("decode_16", "decode_16_compiled"))
    return f"""## The engine's step, profiled: where a decode step's time goes

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs{load(r)})

SmolLM2-135M fp32, linears packed as served, the engine called directly with {r["threads"]} threads, its forward
eager (transformers' modules) and then compiled (`serve.generate.forward`, workflows.tasks.chat.engine.compiled:
the engine built, its graphs compiled, in {r["compile_s"]} s, its one-token graph's autotuned matmuls in
{r["one_token_compile_s"]} s of them; {r["compiled_refused"]} steps refused a recompile);
torch.profiler in the engine's thread over its steps (decode-only at 1 and 16 rows; mixed: a 1,500-token
prompt prefilled beside 16 decoding rows, chunked by the time budget once it has learned the costs).
In the compiled graph inductor's fused loops are not operators the profiler sees: their time is the graph's call;
on the one-token graph its matmuls too, the output head's included (the C++ template's kernels are loops of the
graph; elsewhere the head runs outside the graphs, on its packed weight).
Per step: each group's self CPU time and operator count (as profiled); what no operator accounts for (Python, dispatch, allocation) is
the wall time of the same kind of steps unprofiled, less the operators' time. The cache was grown to the
long prompt's length first (it grows by doubling, once per replica: not a step's cost).

| per step | {head} |
|{rule}
{table}

Compiled, a step took {1 / r["compiled_speedup_decode_1"]:.2f}x the eager one's time at 1 row,
{1 / r["compiled_speedup_decode_16"]:.2f}x at 16 and {1 / r["compiled_speedup_mixed_16"]:.2f}x mixed (one window each; a mixed
step's prompt tokens are what each engine's learned budget gave it, not the same count).
A mixed step took {r["mixed_over_decode_16"]:.2f}x a decode-only step of the same 16 rows (its costs learned
from the replica's first mixed steps; one window of steps each: the prefill-join section measures that ratio
with repeats). A lone stream's eager decode step computing with the weights themselves
(MKL's matrix-vector path: `linear.UNPACKED_ROWS` 2) took {r["one_row_unpacked_over_packed"]:.2f}x the time of
the same step on the packed copy, the default (the medians of {len(r["one_row_walls_ms"]["packed"])} runs of {r["kinds"]["decode_1"]["steps"]} steps each,
interleaved: {r["one_row_walls_ms"]["unpacked"]} against {r["one_row_walls_ms"]["packed"]} ms).
Compiled, a lone stream's decode step on the one-token graph (static, its matmuls autotuned between inductor's
C++ GEMM template and ATen's, the output head in it: `serve.generate.one_token_graph`) took {1 / r["one_token_speedup_decode_1"]:.2f}x
the time of the same step on the dynamic graph (oneDNN's packed matmuls; the medians of
{len(r["one_row_walls_ms"]["one_token"])} runs of {r["kinds"]["decode_1_compiled"]["steps"]} steps each, interleaved, the
order alternating: {r["one_row_walls_ms"]["one_token"]} against {r["one_row_walls_ms"]["dynamic"]} ms).

The ten costliest operators of a decode step at 16 rows, eager and compiled (self CPU time):

| operator | calls a step | ms a step |
| --- | --- | --- |
{top}

| operator (compiled) | calls a step | ms a step |
| --- | --- | --- |
{top_compiled}
"""  # noqa: E501 (markdown table rows: one line each)


if __name__ == "__main__":
    from benchmarks.record import main

    main("step-profile")

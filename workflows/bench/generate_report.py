"""The generation bench's report (workflows.bench.generate): each row's figures summed over its repeats,
the ratios the issue's goals are stated in, whether each meets its goal, and the run's settings."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from workflows.bench.generate_local import percentile
from workflows.bench.roofline import decode_step, roofline

if TYPE_CHECKING:
    from workflows.bench.generate import Row

# (direction, value): the figure meets its goal when >= (or <=) the value; None: reported, no goal
GOALS: dict[str, tuple[str, float] | None] = {
    "http_vs_static_c16": (">=", 1.0), "http_vs_static_natural_c16": (">=", 1.3),
    "itl_p99_over_p50_c16": ("<=", 2.0), "itl_p99_over_p50_c8": ("<=", 2.0), "itl_p99_over_p50_poisson": ("<=", 2.0),
    "ttft_c16_over_c1": None, "decode_vs_roofline": (">=", 0.7), "sampled_vs_greedy": (">=", 0.9),
    "http_vs_engine_c16": (">=", 0.9), "overload_rejected_within_100ms": (">=", 1.0),
    "overload_itl_p99_vs_poisson": None, "overload_itl_p99_vs_closed_loop": ("<=", 1.2),
    "tokens_per_s_vs_one_at_a_time": (">=", 4.0),
    "ttft_p50_vs_peer": ("<=", 1.2), "json_schema_vs_unconstrained_c1": (">=", 0.85),
    "json_schema_vs_unconstrained_c16": (">=", 0.85), "vs_llama_cpp_c1": None, "vs_llama_cpp_c16": None,
    "http_vs_static_packed_c16": None, "decode_vs_transformers": None, "decode_vs_matmul_floor": None,
    "matmul_floor_vs_roofline": None,
    "vs_vllm_c1": (">=", 1.0), "vs_vllm_c16": (">=", 1.0), "itl_p50_vs_vllm_c1": ("<=", 1.0),
    "vs_vllm_eager_c1": None, "vs_vllm_eager_c16": None, "ttft_c16_vs_best_peer": ("<=", 1.0),
    "lora_vs_base_c16": (">=", 0.8), "mixed_vs_base_c16": None, "lora_vs_vllm_lora_c16": (">=", 1.0),
    "vllm_engine_vs_vllm_server_c1": None, "vllm_engine_vs_vllm_server_c16": (">=", 0.95),
    "itl_p50_vllm_engine_vs_vllm_server_c1": None}
# goals set at one level of the full run (its middle concurrency, 16; its top, 32): a run at other levels
# reports these figures without judging them
GOAL_LEVELS = {"tokens_per_s_vs_one_at_a_time": ("mid", 16), "decode_vs_roofline": ("top", 32)}
# the peers' rows whose time to first token at 16 the best peer's is taken from
TTFT_PEERS = ("vllm", "vllm_eager", "llama_cpp")
SLOWEST = 5  # the overload row's slowest refusals named in the results, with when each was sent


def goals_at(keys, mid: int, top: int) -> dict[str, tuple[str, float] | None]:
    """Each figure's goal in a run whose middle and top concurrencies are `mid` and `top`."""
    levels = {"mid": mid, "top": top}
    return {k: None if k in GOAL_LEVELS and levels[GOAL_LEVELS[k][0]] != GOAL_LEVELS[k][1] else GOALS.get(k)
            for k in keys}


def summary(row: Row) -> dict:
    ttft = [x for r in row.runs for x in r["ttft"]]
    itl = [x for r in row.runs for x in r["itl"]]
    refused = [x for r in row.runs for x in r.get("refused", [])]
    out = {"row": row.key, "path": row.label, **row.settings(),
           "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in row.runs), 2),
           "tokens_per_s_runs": [round(r["tokens_per_s"], 2) for r in row.runs],
           "ttft_s_p50": round(percentile(ttft, 0.5), 4), "ttft_s_p99": round(percentile(ttft, 0.99), 4),
           "itl_s_p50": round(percentile(itl, 0.5), 4), "itl_s_p99": round(percentile(itl, 0.99), 4),
           "tokens": sum(r["tokens"] for r in row.runs), "requests": sum(len(r["ttft"]) for r in row.runs),
           "servers_beside": sorted({name for r in row.runs for name in r.get("beside", [])})}
    if row.rate:
        out["refused"] = len(refused)
        out["refused_answer_s_max"] = round(max((x["answer_s"] for x in refused), default=0.0), 4)
        out["refused_within_100ms"] = sum(x["answer_s"] <= 0.1 for x in refused)
        out["refused_status"] = sorted({x["status"] for x in refused})
        out["refused_slowest"] = slowest_refusals(row.runs)
    steps = [x for r in row.runs for x in r.get("decode_steps_s", [])]
    if steps:  # the engine's own decode steps with every row decoding and no prompt tokens
        out["decode_step_s_p50"], out["decode_steps"] = round(percentile(steps, 0.5), 4), len(steps)
    prompt = [x for r in row.runs for x in r.get("prompt_tokens", [])]
    if prompt:
        out["prompt_tokens_mean"] = round(sum(prompt) / len(prompt), 1)
    return out


def slowest_refusals(runs: list[dict], n: int = SLOWEST) -> list[dict]:
    """The `n` slowest refusals of a row's runs: which repeat (0-based), when each was sent (seconds from its
    run's start, and that run's length) and how long its answer took, so a slow one can be placed in the run
    (the burst's first seconds, or a steady stretch)."""
    timed = [(x, i, r["seconds"]) for i, r in enumerate(runs) for x in r.get("refused", [])]
    slowest = sorted(timed, key=lambda t: -t[0]["answer_s"])[:n]
    return [{"repeat": i, "sent_s": round(x["sent_s"], 3), "run_s": round(length, 2),
             "answer_s": round(x["answer_s"], 4)} for x, i, length in slowest]


def prompt_mean(prompts: list[list[int]], opts: dict) -> float:
    """The mean length, in tokens, of the prompts the rows send."""
    return sum(map(len, prompts[:opts["requests"]])) / opts["requests"]


def mean_context(prompts: list[list[int]], opts: dict) -> float:
    """The cached tokens of a row in a decode step, on average over a generation: the bench's prompts'
    mean length plus half of max_tokens (where the roofline and the reference step are taken)."""
    return prompt_mean(prompts, opts) + opts["max_tokens"] / 2


def meets_goal(value: float | None, goal: tuple[str, float] | None) -> bool | None:
    """None without a goal; False when the figure is missing (its row did not run or measured nothing)."""
    if goal is None:
        return None
    return value is not None and (value >= goal[1] if goal[0] == ">=" else value <= goal[1])


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def peer_keys(get, mid: int, top: int) -> dict[str, float | None]:
    """The ratios to vLLM (compiled, eager, with the LoRA adapter), to the best peer's first token, and of
    the adapter's rows to the base's."""
    best_ttft = min((t for t in (get(f"{p}_c{mid}", "ttft_s_p50") for p in TTFT_PEERS) if t), default=None)
    return {
        "vs_vllm_c1": ratio(get("http_c1", "tokens_per_s"), get("vllm_c1", "tokens_per_s")),
        f"vs_vllm_c{mid}": ratio(get(f"http_c{mid}", "tokens_per_s"), get(f"vllm_c{mid}", "tokens_per_s")),
        "itl_p50_vs_vllm_c1": ratio(get("http_c1", "itl_s_p50"), get("vllm_c1", "itl_s_p50")),
        "vs_vllm_eager_c1": ratio(get("http_c1", "tokens_per_s"), get("vllm_eager_c1", "tokens_per_s")),
        f"vs_vllm_eager_c{mid}": ratio(get(f"http_c{mid}", "tokens_per_s"), get(f"vllm_eager_c{mid}", "tokens_per_s")),
        f"ttft_c{mid}_vs_best_peer": ratio(get(f"http_c{mid}", "ttft_s_p50"), best_ttft),
        f"lora_vs_base_c{mid}": ratio(get(f"http_lora_c{mid}", "tokens_per_s"), get(f"http_c{mid}", "tokens_per_s")),
        f"mixed_vs_base_c{mid}": ratio(get(f"http_mixed_c{mid}", "tokens_per_s"), get(f"http_c{mid}", "tokens_per_s")),
        f"lora_vs_vllm_lora_c{mid}": ratio(get(f"http_lora_c{mid}", "tokens_per_s"),
                                           get(f"vllm_lora_c{mid}", "tokens_per_s")),
        "overload_itl_p99_vs_closed_loop": ratio(get("http_overload", "itl_s_p99"), get(f"http_c{top}", "itl_s_p99")),
    }


def served_attention(cfg) -> str:
    """The attention the served model computes with: the builtin engine always runs its slot attention,
    whatever this process loaded (a run without in-process paths loads the plain transformers model)."""
    if cfg.serve.generate.engine == "builtin":
        from workflows.tasks.chat.engine.cache import ATTENTION

        return ATTENTION
    return f"{cfg.serve.generate.engine}'s own"


def report(rows: list[Row], opts: dict, levels: list[int], model, prompts, spec: str, cfg, threads: int,
           flops: list[float], bandwidth: list[float], reference: list[float], commands: dict,
           floors: list[dict]) -> dict:
    table = [summary(r) for r in rows if r.runs]
    by = {r["row"]: r for r in table}
    mid, top, max_tokens = (16 if 16 in levels else max(levels)), max(levels), opts["max_tokens"]

    def get(key: str, figure: str) -> float | None:
        return by[key][figure] if key in by else None

    step = decode_step(model, top, mean_context(prompts, opts))
    best_flops, best_bw = max(flops, default=0.0), max(bandwidth, default=0.0)
    limit = roofline(step, best_flops, best_bw) if best_flops and best_bw else None
    # a decode step as the roofline counts it: the engine's steps of `top` rows decoding and no prompt
    # tokens (a token gap also holds the steps that prefill joining requests), else the gap's median
    measured_from = "decode_step_s_p50" if "decode_step_s_p50" in by.get(f"engine_c{top}", {}) else "itl_s_p50"
    measured_step = get(f"engine_c{top}", measured_from)
    transformers_s = round(min(reference), 5) if reference else None  # its best reading, as the roofline's
    floor = min((f for f in floors if f.get("floor_s")), key=lambda f: f["floor_s"], default=None)  # its best
    floor_s = round(floor["floor_s"], 7) if floor else None  # (a tiny model's are some µs)
    overload = by.get("http_overload")
    keys: dict[str, float | None] = {
        f"http_vs_static_c{mid}": ratio(get(f"http_c{mid}", "tokens_per_s"), get("static", "tokens_per_s")),
        f"http_vs_static_natural_c{mid}": ratio(get(f"http_natural_c{mid}", "tokens_per_s"),
                                                get("static_natural", "tokens_per_s")),
        f"http_vs_static_packed_c{mid}": ratio(get(f"http_c{mid}", "tokens_per_s"),
                                               get("static_packed", "tokens_per_s")),
        f"itl_p99_over_p50_c{mid}": ratio(get(f"http_c{mid}", "itl_s_p99"), get(f"http_c{mid}", "itl_s_p50")),
        "itl_p99_over_p50_c8": ratio(get("http_c8", "itl_s_p99"), get("http_c8", "itl_s_p50")),
        "itl_p99_over_p50_poisson": ratio(get("http_poisson", "itl_s_p99"), get("http_poisson", "itl_s_p50")),
        f"ttft_c{mid}_over_c1": ratio(get(f"http_c{mid}", "ttft_s_p50"), get("http_c1", "ttft_s_p50")),
        "decode_vs_roofline": ratio(limit["step_s"], measured_step) if limit and measured_step else None,
        "decode_vs_transformers": ratio(transformers_s, measured_step),
        "decode_vs_matmul_floor": ratio(floor_s, measured_step),
        "matmul_floor_vs_roofline": ratio(limit["step_s"], floor_s) if limit else None,
        "sampled_vs_greedy": ratio(get(f"http_sampled_c{mid}", "tokens_per_s"), get(f"http_c{mid}", "tokens_per_s")),
        f"http_vs_engine_c{mid}": ratio(get(f"http_c{mid}", "tokens_per_s"), get(f"engine_c{mid}", "tokens_per_s")),
        "overload_rejected_within_100ms": (round(overload["refused_within_100ms"] / overload["refused"], 3)
                                           if overload and overload["refused"] else None),
        "overload_itl_p99_vs_poisson": ratio(get("http_overload", "itl_s_p99"), get("http_poisson", "itl_s_p99")),
        "tokens_per_s_vs_one_at_a_time": ratio(get(f"http_c{mid}", "tokens_per_s"), get("peer", "tokens_per_s")),
        "ttft_p50_vs_peer": ratio(get("http_c1", "ttft_s_p50"), get("peer", "ttft_s_p50")),
        "json_schema_vs_unconstrained_c1": ratio(get("http_json_c1", "tokens_per_s"), get("http_c1", "tokens_per_s")),
        f"json_schema_vs_unconstrained_c{mid}": ratio(get(f"http_json_c{mid}", "tokens_per_s"),
                                                      get(f"http_c{mid}", "tokens_per_s")),
        "vs_llama_cpp_c1": ratio(get("http_c1", "tokens_per_s"), get("llama_cpp_c1", "tokens_per_s")),
        f"vs_llama_cpp_c{mid}": ratio(get(f"http_c{mid}", "tokens_per_s"), get(f"llama_cpp_c{mid}", "tokens_per_s")),
        **peer_keys(get, mid, top),
    }
    if mid == 1:  # a run at 1 alone: nothing to divide by its own level
        del keys["ttft_c1_over_c1"]
    if cfg.serve.generate.engine == "vllm":  # ours is vLLM's engine here: its ratios to vLLM's server are our layer's
        for old, new in (("vs_vllm_c1", "vllm_engine_vs_vllm_server_c1"),
                         (f"vs_vllm_c{mid}", f"vllm_engine_vs_vllm_server_c{mid}"),
                         ("itl_p50_vs_vllm_c1", "itl_p50_vllm_engine_vs_vllm_server_c1")):
            keys[new] = keys.pop(old)
    goals = goals_at(keys, mid, top)
    meets = {k: meets_goal(v, goals[k]) for k, v in keys.items()}
    return {"model": spec, "base": cfg.model.name_or_path, "params": sum(p.numel() for p in model.parameters()),
            "threads": threads, "precision": cfg.serve.precision, "engine": cfg.serve.generate.engine,
            "attn_implementation": served_attention(cfg),
            "requests": opts["requests"], "serial_requests": opts["serial_requests"], "max_tokens": max_tokens,
            "repeats": opts["repeats"], "static_batch": opts["static_batch"], "load": float(opts["load"]),
            "overload": float(opts["overload"]), "overload_requests": opts["overload_requests"],
            "max_batch": cfg.serve.generate.max_batch, "max_queue": cfg.serve.generate.max_queue, "mid": mid,
            "prompt_tokens_mean": round(prompt_mean(prompts, opts), 1),
            "matmul_flops_per_s": round(best_flops), "matmul_flops_per_s_runs": [round(f) for f in flops],
            "matmul_dtype": str(model.dtype).removeprefix("torch."),
            "memory_bytes_per_s": round(best_bw), "memory_bytes_per_s_runs": [round(b) for b in bandwidth],
            "decode_step": {**step, **({k: (round(v, 5) if isinstance(v, float) else v) for k, v in limit.items()}
                                       if limit else {}), "measured_s": measured_step,
                            "measured_from": f"engine_c{top} {measured_from}",
                            "itl_s_p50": get(f"engine_c{top}", "itl_s_p50"),
                            "transformers_step_s": transformers_s,
                            "transformers_step_s_runs": [round(r, 5) for r in reference],
                            **({"matmul_floor_s": floor_s, "matmul_floor_kernel": floor["kernel"],
                                "matmul_floor_flops_per_s": round(floor["flops_per_s"]),
                                "matmul_floor_s_runs": [round(f["floor_s"], 7) for f in floors if f]}
                               if floor else {})},
            "servers": {k: " ".join(v) for k, v in commands.items()},
            "rows": table, **keys, "goals": {k: (f"{g[0]} {g[1]}" if g else None) for k, g in goals.items()},
            "meets_goals": meets}

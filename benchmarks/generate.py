"""`workflows bench generate` with the project's peers, for docs/BENCHMARKS.md's generation section
(`python -m benchmarks.generate`, `make bench-generate`).

The user command (workflows.bench.generate) measures what a user's install has: ours through `workflows
serve`, the engine called directly, static batching and the one-at-a-time peer. The peers that need a
build of their own live here, in the project's harness, as the image peers do: llama.cpp's batching
server and vLLM's CPU build (benchmarks/generate_peers.py), built and cached by `make bench-peers-generate`
outside the gate; a peer that is not built is left out of the run, and the section says so.
"""

from __future__ import annotations

import re

from benchmarks.generate_peers import available_peers
from workflows.bench import generate

FIGURES = ("http_vs_static_c16", "http_vs_static_natural_c16", "itl_p99_over_p50_c16", "ttft_c16_over_c1",
           "decode_vs_roofline", "sampled_vs_greedy", "http_vs_engine_c16", "json_schema_vs_unconstrained_c1",
           "json_schema_vs_unconstrained_c16", "vs_llama_cpp_c1", "vs_llama_cpp_c16", "vs_vllm_c1", "vs_vllm_c16",
           "itl_p50_vs_vllm_c1", "ttft_c16_vs_best_peer", "lora_vs_base_c16", "lora_vs_vllm_lora_c16",
           "vllm_engine_vs_vllm_server_c1", "vllm_engine_vs_vllm_server_c16")
TEXT = {
    "http_vs_static_c16": "output tokens/s at 16 over HTTP against static batching, fixed lengths",
    "http_vs_static_natural_c16": "the same with natural stopping (eos honoured)",
    "http_vs_static_packed_c16": "the same fixed lengths against static batching on the engine's packed weights",
    "itl_p99_over_p50_c16": "inter-token latency p99 over p50 at 16, over HTTP",
    "itl_p99_over_p50_c8": "inter-token latency p99 over p50 at 8, over HTTP",
    "itl_p99_over_p50_poisson": "inter-token latency p99 over p50, Poisson arrivals near capacity",
    "ttft_c16_over_c1": "time to first token p50 at 16 over that at 1, over HTTP",
    "decode_vs_roofline": "a decode step at the top concurrency against its roofline",
    "decode_vs_transformers": "a decode step at the top concurrency against transformers' own on the same weights",
    "decode_vs_matmul_floor": "a decode step at the top concurrency against its matmuls alone (each weight once, "
                              "nothing else)",
    "matmul_floor_vs_roofline": "those matmuls alone against the roofline: at most what decode_vs_roofline can read "
                                "on this machine's matmul kernels",
    "sampled_vs_greedy": "tokens/s sampled (temperature 0.7, top_p 0.9) over greedy at 16, over HTTP",
    "http_vs_engine_c16": "tokens/s at 16 over HTTP with SSE against the engine called directly",
    "json_schema_vs_unconstrained_c1": "tokens/s at 1 with a json_schema response_format against unconstrained",
    "json_schema_vs_unconstrained_c16": "the same at 16",
    "overload_rejected_within_100ms": "overload row: refused requests answered within 100 ms (share)",
    "overload_itl_p99_vs_poisson": "overload row: the admitted ones' inter-token p99 against near capacity",
    "tokens_per_s_vs_one_at_a_time": "tokens/s at 16 over HTTP against the one-at-a-time peer",
    "ttft_p50_vs_peer": "time to first token p50 at 1 over HTTP against the one-at-a-time peer",
    "vs_llama_cpp_c1": "tokens/s at 1 over HTTP against llama.cpp's server",
    "vs_llama_cpp_c16": "tokens/s at 16 over HTTP against llama.cpp's server",
    "vs_vllm_c1": "tokens/s at 1 over HTTP against vLLM's CPU build (compiled, as it runs by default)",
    "vs_vllm_c16": "the same at 16",
    "itl_p50_vs_vllm_c1": "inter-token latency p50 at 1 against vLLM's",
    "vs_vllm_eager_c1": "tokens/s at 1 against vLLM with --enforce-eager (its kernels without its compile)",
    "vs_vllm_eager_c16": "the same at 16",
    "ttft_c16_vs_best_peer": "time to first token p50 at 16 against the best peer's in this run",
    "lora_vs_base_c16": "tokens/s at 16 of requests naming a LoRA adapter of the base against the base's",
    "mixed_vs_base_c16": "the same with the adapter's and the base's requests in turn (one batch)",
    "lora_vs_vllm_lora_c16": "the adapter's tokens/s at 16 against vLLM's with --enable-lora, the same adapter",
    "overload_itl_p99_vs_closed_loop": "overload row: the admitted ones' inter-token p99 against the closed loop "
                                       "at the batch size",
    "vllm_engine_vs_vllm_server_c1": "serve.generate.engine=vllm: tokens/s at 1 over our API against vLLM's own "
                                     "server, the same weights",
    "vllm_engine_vs_vllm_server_c16": "the same at 16",
    "itl_p50_vllm_engine_vs_vllm_server_c1": "serve.generate.engine=vllm: inter-token latency p50 at 1 against "
                                             "vLLM's own server's",
}


def alone(r: dict) -> str:
    """How the servers were kept off each other's rows: a result without `http_starts` kept `workflows serve`
    up throughout, beside every row."""
    if not r.get("http_starts"):
        return ""
    return (f" No row ran beside another server: the peers sat paused (SIGSTOP) outside their rows, and `workflows "
            "serve` was up for the HTTP rows alone, started for them and stopped before any other row "
            f"({r['http_starts']} starts, each warmed as the first)." + mirrored(r))


def mirrored(r: dict) -> str:
    """Whether every second repeat ran the rows in the mirrored order (other rows reversed, then HTTP)."""
    order = r.get("order") or []
    if len(order) < 2 or order[1] == order[0]:
        return ""
    return (" Every second repeat ran the rows mirrored, the other rows first in reverse and then the HTTP rows, so "
            "that each row's mean time in the run is about its middle: a slow drift of the machine's speed does not "
            "tilt a ratio of rows run minutes apart.")


AT_MID = ("sampled_vs_greedy", "tokens_per_s_vs_one_at_a_time")  # measured at the run's middle concurrency


def describe(key: str, mid: int) -> str:
    """A figure's words, at the concurrency the run measured it (`mid`, 16 unless a variant's levels
    leave it out): a key of another level is its 16's words at that level."""
    level = re.fullmatch(r"(.+?)_c(\d+)(_.+)?", key)
    if key not in TEXT and level and (at16 := f"{level[1]}_c16{level[3] or ''}") in TEXT:
        return TEXT[at16].replace("at 16", f"at {level[2]}")
    text = TEXT.get(key, key)
    return text.replace("at 16", f"at {mid}") if key in AT_MID else text


ENGINE_WORDS = {"builtin": "our engine", "vllm": "vLLM's engine behind our API (serve.generate.engine=vllm)"}


def measured_from(step: dict) -> str:
    """What the engine's step time was read from: its decode-only steps, or (older runs) the token gaps."""
    rows, gap = step["rows"], step.get("itl_s_p50")
    if "decode_step_s_p50" in step.get("measured_from", ""):
        also = f"; inter-token p50 {1000 * gap:.0f} ms, with the steps that prefill joining requests" if gap else ""
        return f"the median of its steps with {rows} rows decoding and no prompt tokens{also}"
    return f"inter-token p50 at {rows}"


def run(config: str | None, overrides: list[str]) -> dict:
    import os

    from benchmarks.generate_peers import gguf_file

    peers, missing = available_peers(overrides)
    result = generate.run(config, [o for o in overrides if not o.startswith("peers=")], peers=peers)
    return {**result, "peers_missing": missing, "llama_cpp_gguf_bytes": os.path.getsize(gguf_file())}


def llama_gap(r: dict) -> str:
    """What the bytes read per token say of the gap to llama.cpp, from the stored run."""
    c1, c16, gguf = r.get("vs_llama_cpp_c1"), r.get("vs_llama_cpp_c16"), r.get("llama_cpp_gguf_bytes")
    if not (c1 and gguf):
        return ""
    weights, precision = r["decode_step"]["weight_bytes"], r.get("precision", "fp32")
    at16 = f" and {1 / c16:.2f}x ours at 16" if c16 else ""
    return (f"\n\nBeside llama.cpp: its server gives {1 / c1:.2f}x our tokens/s at concurrency 1{at16}. At 1, a "
            f"step decodes one token and reads every weight once: ours {weights / 1e6:.0f} MB in {precision}, "
            f"llama.cpp {gguf / 1e6:.0f} MB of Q4_1 (4-bit weights with a scale and a minimum per block of 32, about "
            f"5 bits a weight; the GGUF file's size), {weights / gguf:.1f}x fewer bytes per token, read by kernels "
            f"that multiply the 4-bit blocks as they are. At 16 the weights are read once for 16 tokens, so bytes "
            f"matter less and the arithmetic more: its quantized dot products against our {precision} matmuls.")


def markdown(r: dict) -> str:
    def ms(v: float) -> str:
        return f"{1000 * v:.0f}"

    def rate(x: dict) -> str:
        return x["arrivals"].replace("poisson x", "Poisson, ").replace(" capacity", "x capacity")

    def sent(x: dict) -> str:  # when the slowest refusal was sent in its repeat (none in results without it)
        if not x.get("refused_slowest"):
            return ""
        slowest = x["refused_slowest"][0]
        return f", sent {slowest['sent_s']:.1f} s into repeat {slowest['repeat'] + 1}'s {slowest['run_s']:.0f} s"

    rows = "\n".join(
        f"| {x['row'].split('_c')[0].split('_')[0]} | {x['path']} | {rate(x)}, {x['concurrency']} | "
        f"{x['sampling'].split(',')[0]} | {x['lengths'].split(' ')[0]} | {x['tokens_per_s']:.1f} | "
        f"{ms(x['ttft_s_p50'])} / {ms(x['ttft_s_p99'])} | {ms(x['itl_s_p50'])} / {ms(x['itl_s_p99'])} |"
        + (f" {x['refused']} refused, slowest answer {ms(x['refused_answer_s_max'])} ms{sent(x)} |"
           if "refused" in x else " |")
        for x in r["rows"])

    def goal(key: str) -> str:
        v, g, met = r.get(key), r["goals"].get(key), r["meets_goals"].get(key)
        shown = "n/a" if v is None else f"**{v:.2f}**"
        verdict = "reported" if g is None else ("met" if met else "**not met**")
        return f"| {key} | {describe(key, r.get('mid', 16))} | {shown} | {g or ''} | {verdict} |"

    keys = [*FIGURES, *sorted(set(r["goals"]) - set(FIGURES))]
    goals = "\n".join(goal(k) for k in keys if r.get(k) is not None)
    absent = [k for k in keys if r.get(k) is None]
    if absent:  # a partial run (a `--tag` variant) leaves out the rows these need
        goals += f"\n\nNot measured in this run (their rows were left out): {', '.join(absent)}."
    step = r["decode_step"]
    missing = "".join(f"\n- {name}: {why}" for name, why in (r.get("peers_missing") or {}).items())
    servers = "\n".join(f"- {name}: `{cmd}`" for name, cmd in r["servers"].items())
    took = "n/a" if step.get("measured_s") is None else f"{1000 * step['measured_s']:.0f} ms"
    matmul = {"float32": "fp32", "bfloat16": "bf16"}.get(r["matmul_dtype"], r["matmul_dtype"])  # the served one's
    roof = (f"A decode step of {step['rows']} rows at a mean context of {step['context']} tokens does "
            f"{step['flops'] / 1e9:.1f} GFLOP and reads {step['bytes'] / 1e6:.0f} MB ({step['weight_bytes'] / 1e6:.0f} "
            f"MB of weights, {step['cache_bytes'] / 1e6:.0f} MB of KV cache); at {r['matmul_flops_per_s'] / 1e9:.1f} "
            f"GFLOP/s ({matmul} matmul, 1024^3) and {r['memory_bytes_per_s'] / 1e9:.1f} GB/s (reads), both measured "
            f"after each repeat's rows, it takes at least {1000 * step['step_s']:.0f} ms ({step['bound']}-bound: "
            f"compute {1000 * step['compute_s']:.0f} ms, memory {1000 * step['memory_s']:.0f} ms), "
            f"{step['tokens_per_s']:.0f} tokens/s; the engine's step took {took} ({measured_from(step)}).") \
        if "step_s" in step else ""
    if step.get("transformers_step_s"):
        roof += (" Transformers' own decode step of as many rows on the engine's weights (a `StaticCache` forward, "
                 "as `generate` runs it, in the engine's thread; the median of 12, the best of the repeats) took "
                 f"{1000 * step['transformers_step_s']:.0f} ms.")
    if step.get("matmul_floor_s") and r.get("matmul_floor_vs_roofline"):
        kernel = {"onednn": "oneDNN's on the weights packed, faster than MKL's here",
                  "mkl": "MKL's, faster than oneDNN's on the weights packed here"}[step["matmul_floor_kernel"]]
        roof += (" The step's matmuls alone (each layer's fused q/k/v, its o, its fused gate/up and its down "
                 f"projection, then the output head, each weight once in the step's order, {step['rows']} rows, "
                 f"{kernel}; the median of 7, the best of the repeats) took {1000 * step['matmul_floor_s']:.0f} ms, "
                 f"{step['matmul_floor_flops_per_s'] / 1e9:.0f} GFLOP/s: a step of nothing else would reach "
                 f"{r['matmul_floor_vs_roofline']:.2f} of the roofline.")
    # a result without `warm_ups` warmed the first row of each path alone
    warmed = f"the first row of each kind ({', '.join(r['warm_ups'])}), so of each" if r.get("warm_ups") else "each"
    return f"""## Generation: ours over HTTP beside the engine, static batching and peers

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs, {r["threads"]} threads per path, load
{r["machine"]["load_average"]["before"]}). {r["model"]} ({r["base"]}, {r["params"] / 1e6:.1f}M params, {r["precision"]},
attention {r["attn_implementation"]}), served by {ENGINE_WORDS[r.get("engine", "builtin")]} with a batch of {r["max_batch"]}
and a queue of {r["max_queue"]};
{r["requests"]} chat questions (mean {r["prompt_tokens_mean"]} prompt tokens; {r["serial_requests"]} in rows at
concurrency 1), at most {r["max_tokens"]} new tokens each: exactly that many with fixed lengths (`ignore_eos`),
the answers' own lengths with natural stopping. Rows interleaved, {r["repeats"]} repeats after a warm-up of {warmed}
path; tokens/s is the median over repeats, latencies the percentiles over every request. Over HTTP, the
official `openai` client streams (SSE) from a process of its own and times each token's chunk as it arrives; the
in-process paths time tokens as they are sampled. Poisson rows send requests at a multiple of the capacity
measured in the same repeat (requests/s at the top concurrency over HTTP).{alone(r)}

| path | what runs | arrivals, concurrency | sampling | lengths | output tokens/s | TTFT p50 / p99 (ms) | inter-token p50 / p99 (ms) | refused |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
{rows}

| key | figure | measured | goal | |
| --- | --- | --- | --- | --- |
{goals}

{roof}

Servers, each a process of its own (llama.cpp's `llama-server` and vLLM from `make bench-peers-generate`, in
.peers-gen/, pinned by benchmarks/generate-peers-constraints.txt; llama.cpp runs the GGUF file the base model
is converted from, 4-bit weights, and caches no prompt, `cache_prompt: false`, nor does vLLM, prefix caching off):
{servers}
{("Peers not in this run:" + missing) if missing else ""}{llama_gap(r)}
"""  # noqa: E501 (markdown table rows: one line each)


if __name__ == "__main__":
    from benchmarks.record import main

    main("generate")

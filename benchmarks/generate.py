"""`workflows bench generate` for docs/BENCHMARKS.md's generation section (`python -m benchmarks.generate`)."""

from __future__ import annotations

from workflows.bench.generate import run as run


def markdown(r: dict) -> str:
    def ms(v: float) -> str:
        return f"{1000 * v:.1f}"

    lines = "\n".join(f"| {x['path']} | {x['concurrency']} | {x['tokens_per_s']:.1f} | {ms(x['ttft_s_p50'])} / "
                      f"{ms(x['ttft_s_p99'])} | {ms(x['itl_s_p50'])} / {ms(x['itl_s_p99'])} |" for x in r["rows"])

    def goal(key: str, text: str) -> str:
        v = r[key]
        shown = "n/a" if v is None else f"**{v:.2f}x**"
        return f"| {text} | {shown} | {'met' if r['meets_goals'][key] else '**not met**'} |"

    return f"""## Generation: continuous batching against one request at a time

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs, {r["threads"]} torch threads, load
{r["machine"]["load_average"]["before"]}). {r["model"]} ({r["params"] / 1e6:.1f}M params, {r["precision"]},
attention {r["attn_implementation"]}); {r["requests"]} chat-templated prompts (mean {r["prompt_tokens_mean"]} tokens),
{r["max_tokens"]} greedy tokens each (EOS ignored), the same model object for every row; rows interleaved, {r["repeats"]}
repeats after a warm-up. Ours is the engine called directly (no HTTP); the peer is reached over HTTP on 127.0.0.1.

| path | concurrency | output tokens/s | TTFT p50 / p99 (ms) | inter-token p50 / p99 (ms) |
| --- | --- | --- | --- | --- |
{lines}

| figure | measured | goal |
| --- | --- | --- |
{goal("tokens_per_s_vs_one_at_a_time", f"tokens/s, ours at 16 against the peer (goal >= {r['goals']['tokens_per_s_vs_one_at_a_time']}x)")}
{goal("ttft_p50_vs_peer", f"TTFT p50, ours at 1 against the peer (goal <= {r['goals']['ttft_p50_vs_peer']}x)")}
{goal("decode_vs_flop_limit", f"tokens/s at 32 against the FLOP limit, {r['flop_limit_tokens_per_s']:.0f} tokens/s (goal >= {r['goals']['decode_vs_flop_limit']}x)")}

The FLOP limit is {r["matmul_flops_per_s"] / 1e9:.1f} GFLOP/s (fp32 matmuls at the decode shape, {r["rows"][-1]["concurrency"]}
rows, measured after each repeat's rows; the best of {", ".join(f"{f / 1e9:.1f}" for f in r.get("matmul_flops_per_s_runs", []))})
over 2 x params FLOPs per token.{where_the_limit_goes(r)}
"""  # noqa: E501 (markdown table rows: one line each)

if __name__ == "__main__":
    from benchmarks.record import main

    main("generate")


def where_the_limit_goes(r: dict) -> str:
    """What the FLOP-limit ratio is made of at the top concurrency, from the stored rows: the decode
    steps alone (rows / inter-token p50), the prompts' prefill that the output-token figure also pays,
    and static batching's ratio measured the same way."""
    top = max((x for x in r["rows"] if x["row"].startswith("ours_c")), key=lambda x: x["concurrency"])
    static = next((x for x in r["rows"] if x["row"] == "static"), None)
    limit = r["flop_limit_tokens_per_s"]
    if not limit or not top["itl_s_p50"]:
        return ""
    step = top["concurrency"] / top["itl_s_p50"]
    processed = top["tokens_per_s"] * (r["prompt_tokens_mean"] + r["max_tokens"]) / r["max_tokens"]
    static_text = (f" Static batching ({static['concurrency']} a batch) reaches "
                   f"{static['tokens_per_s'] / limit:.2f}x the limit counted the same way." if static else "")
    return (f"\n\nWhere the limit goes at concurrency {top['concurrency']}: a decode step of {top['concurrency']} rows "
            f"takes {1000 * top['itl_s_p50']:.0f} ms (inter-token p50), {step:.0f} tokens/s or {step / limit:.2f}x the "
            f"limit; the output-token figure also pays each prompt's prefill ({r['prompt_tokens_mean']} prompt tokens "
            f"for {r['max_tokens']} output tokens): counting every token the model processes, "
            f"{processed:.0f} tokens/s, {processed / limit:.2f}x.{static_text}")


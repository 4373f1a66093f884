"""`workflows bench lm` for docs/BENCHMARKS.md's causal-LM pretraining section (`python -m benchmarks.lm`)."""

from __future__ import annotations

from workflows.bench.lm import run as run


def markdown(r: dict) -> str:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    head = (
        f"Measured on {r['world_size']} x {r['device']}."
        if r["gpu_available"]
        else "**No GPU was available for this run**: it ran on the CPU at a small size to show the path works; "
        "its tokens/s say nothing about GPUs and MFU is not computed (no GPU peak). Run "
        "`python -m benchmarks.lm` on a GPU machine to fill this section with the GPT-2 124M, seq 1024, bf16 figures."
    )
    return f"""## Causal-LM pretraining: tokens/s and MFU (FSDP2, no Ray)

`{r["command"]}` ({r["measured_at"]}; it runs `{r["torchrun_command"]}`). {head}

| model | params | seq x micro-batch x devices | precision | tokens/s | TFLOP/s per device | MFU | goal | peak memory |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| {r["size"]} ({r["shape"]["n_layer"]} x {r["shape"]["n_embd"]}) | {r["params"] / 1e6:.1f}M | {r["seq_len"]} x {r["micro_batch"]} x {r["world_size"]} | {r["precision"]} | {r["tokens_per_s"]:.0f} | {r["achieved_tflops_per_device"]:.2f} | {mfu} | >= {r["goal_mfu"]:.0%} ({"met" if r["meets_goal"] else "**not met**" if r["gpu_available"] else "not measured"}) | {f"{r['peak_memory_gib']} GiB" if r["peak_memory_gib"] is not None else "n/a"} |

{r["steps"]} measured steps after {r["warmup_steps"]} warm-up steps; loss {r["first_loss"]:.3f} -> {r["last_loss"]:.3f}
on random tokens (it should stay near ln(vocab): the data is noise, only the speed is measured).
flops/token = 6N + 12·L·h·s = {r["flops_per_token"] / 1e9:.3f} GFLOP.
"""  # noqa: E501 (markdown table rows: one line each)

if __name__ == "__main__":
    from benchmarks.record import main

    main("lm")

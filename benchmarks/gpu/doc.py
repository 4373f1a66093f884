"""docs/BENCHMARKS.md's GPU section, rendered from benchmarks/results/gpu-*.json (what
`python -m benchmarks.gpu.measure` wrote under $OUT on a GPU machine, copied here), or, while there are
none, the statement that no GPU has been lent yet and how to run the measurement."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.record import write_doc_section
from workflows.errors import UserError

HEADING = ("## GPU: the product path through Ray, GPT-2 124M MFU, ResNet-50 images/s, bf16 classification, chat "
           "generation and chat fine-tuning (one device)")
ORDER = ("pipeline", "lm", "resnet", "classify", "chat", "generate")  # benchmarks/gpu/measure.py's STEPS
HOW = ("Prepared as one call (`benchmarks/gpu/README.md`): `make bench-gpu-prepare` here (the quickstart's raw "
       "shards and processed split, MiniLM in bf16, SmolLM2's tokenizer, the chat config's processed split and the "
       "CPU figures into `.gpu-prep/`, Ray and the packages the device's Python lacks into `.gpu-ray/`, both into "
       "`.gpu-carry/`, under the 64 MiB a call carries), then `OUT=$OUT bash benchmarks/gpu/run.sh` (or `make "
       "bench-gpu`) on a CUDA machine with `.gpu-carry` carried (the device tool: a `run`, `carry` "
       "`[\".gpu-carry\"]`, `timeout_s` 600; the default steps' limits add up to 570 s), every step in its own "
       "process under its own time limit, each result written as `$OUT/gpu-STEP.json` as it completes; copy them to "
       "`benchmarks/results/` and run `python -m benchmarks.record --render gpu`. `make bench-gpu SMOKE=1` runs "
       "every step at toy size on the CPU (tests/test_gpu_bench.py does, in the extended tier).")


def load(results_dir: str | Path) -> list[dict]:
    """The stored GPU step results, in step order; a smoke run's file is refused: it measured nothing."""
    results = []
    for path in sorted(Path(results_dir).glob("gpu-*.json")):
        r = json.loads(path.read_text())
        if r.get("benchmark") != "gpu":
            continue
        if r.get("smoke"):
            raise UserError(f"{path}: a smoke run (toy sizes on the CPU), not a measurement; remove it")
        results.append(r)
    return sorted(results, key=lambda r: ORDER.index(r["step"]) if r["step"] in ORDER else len(ORDER))


def _f(value, fmt: str = ",.0f", none: str = "n/a") -> str:
    return none if value is None else format(value, fmt)


def _goal(value, goal, fmt: str) -> str:
    if value is None:
        return f">= {format(goal, fmt)} (not measured)"
    return f">= {format(goal, fmt)} ({'met' if value >= goal else '**not met**'})"


def _status(r: dict) -> str:
    return "" if r["status"] == "ok" else f" **{r['status']}**: {r['error']}."


def lm_rows(r: dict) -> str:
    runs = r.get("runs", {})
    params = _f(r.get("params", 0) / 1e6, ".1f")
    lines = [f"`bench lm` ({r['step']}): {r.get('size')} ({params}M), seq {r.get('seq_len')}"
             f" x micro-batch {r.get('micro_batch')}, torch.compile ({r.get('compile')}) per block, fused AdamW, "
             f"{r['seconds']} s of its {r['limit_s']:g} s limit.{_status(r)}", "",
             "| run | precision | tokens/s | TFLOP/s | MFU | peak memory |", "| --- | --- | --- | --- | --- | --- |"]
    for name in ("plain", "fsdp"):
        if name in runs:
            x = runs[name]
            lines.append(f"| {'FSDP2, one device' if name == 'fsdp' else 'plain (no FSDP)'} | {x['precision']} | "
                         f"{_f(x['tokens_per_s'])} | {_f(x['achieved_tflops_per_device'], '.1f')} | "
                         f"{_f(x['mfu'], '.1%')} | {_f(x['peak_memory_gib'], '.1f')} GiB |")
    plain = "mfu_plain" in r  # the goal is the plain run's (issue #62); older files held the FSDP run's
    mfu = _goal(r.get("mfu_plain" if plain else "mfu"), r.get("goal_mfu", 0.5), ".0%")
    lines += ["", f"MFU{' (plain)' if plain else ''} {mfu} against a dense bf16 peak of "
                  f"{_f(r.get('peak_bf16_tflops'))} TFLOP/s; fsdp_vs_plain {_f(r.get('fsdp_vs_plain'), '.3f')}, "
                  f"goal {_goal(r.get('fsdp_vs_plain'), r.get('goal_fsdp_vs_plain', 0.95), '.2f')}."]
    return "\n".join(lines)


def resnet_rows(r: dict) -> str:
    lines = [f"ResNet-50 training ({r.get('arch')}, {r.get('image_size')} px, batch {r.get('batch')}, "
             f"{r.get('precision')}, channels_last, torch.compile ({r.get('compile')}), loop.train_epoch), "
             f"{r['seconds']} s of its {r['limit_s']:g} s limit.{_status(r)}", "",
             "| input | images/s | goal |", "| --- | --- | --- |",
             f"| synthetic tensors in device memory (compute only) | {_f(r.get('compute_images_per_s'))} | "
             f"{_goal(r.get('compute_images_per_s'), r.get('goal_compute_images_per_s', 3000), ',.0f')} |",
             f"| StreamLoader over {_f(r.get('loader_images'))} images in local tar shards, "
             f"{r.get('loader_workers', 'n/a')} decode processes | {_f(r.get('loader_images_per_s'))} | "
             f"{_goal(r.get('loader_vs_compute'), r.get('goal_loader_vs_compute', 0.9), '.2f')} x compute-only |",
             f"| the loader alone (decode-bound ceiling) | {_f(r.get('decode_images_per_s'))} | |"]
    if r.get("loader_vs_ceiling") is not None:
        lines += ["", f"Loader-fed against min(compute only, the loader alone): {_f(r['loader_vs_ceiling'], '.2f')}x "
                  f"(goal {_goal(r['loader_vs_ceiling'], r.get('goal_loader_vs_ceiling', 0.9), '.2f')}); graphs "
                  f"compiled in the timed phase: {r.get('recompiles_in_timed_phase')} (goal 0)."]
    return "\n".join(lines)


def pipeline_rows(r: dict) -> str:
    """Each config's `workflows pipeline` through Ray Train against the CPU figure and the torchrun path."""
    lines = [f"The product path ({r['step']}): `workflows pipeline` through Ray Train (Ray {r.get('ray')}, one worker "
             f"on the GPU) with a local storage root, no tuning, tracking or serving, the last epoch registered; then "
             f"the torchrun path on the processed data the pipeline made. {r['seconds']} s of its {r['limit_s']:g} s "
             f"limit.{_status(r)}", "",
             "| config | registered val score | held-out | CPU figure (val / held-out) | scores goal | Ray Train "
             "samples/s | torchrun samples/s | Ray / torchrun | pipeline s |", "| --- | --- | --- | --- | --- | --- | "
             "--- | --- | --- |"]
    for name, x in (r.get("runs") or {}).items():
        cpu = x.get("cpu") or {}
        held = x.get("heldout", {})
        lines.append(f"| {name} | {x.get('metric')} {_f(x.get('val_score'), '.4f')} | {held.get('name')} "
                     f"{_f(held.get('value'), '.4f')} | {_f(cpu.get('val_score'), '.4f')} / "
                     f"{_f((cpu.get('heldout') or {}).get('value'), '.4f')} | "
                     f"{'met' if x.get('scores_goal_met') else '**not met**'} | "
                     f"{_f(x['ray_train'].get('samples_per_s_after_first_step'), ',.1f')} | "
                     f"{_f(x['torchrun'].get('samples_per_s_after_first_step'), ',.1f')} | "
                     f"{_f(x.get('ray_vs_torchrun'), '.2f')} (goal >= 0.9) | {x.get('pipeline_seconds')} |")
    pred = ((r.get("runs") or {}).get("quickstart") or {}).get("predictor")
    if pred:
        lines += ["", f"The registered quickstart model's text Predictor over {pred['fp32']['rows']:,} held-out rows: "
                  f"fp32 {_f(pred['fp32']['rows_per_s'])} rows/s, bf16 {_f(pred['bf16']['rows_per_s'])} rows/s, "
                  f"bf16 {_f(pred.get('bf16_vs_fp32'), '.2f')}x fp32 (goal "
                  f"{_goal(pred.get('bf16_vs_fp32'), pred.get('goal_bf16_vs_fp32', 1.0), '.2f')}), F1 delta "
                  f"{_f(pred.get('bf16_f1_delta'), '+.4f')}."]
    lines += ["", "Scores goal: val and held-out within 0.01 of the CPU figure (chat: exact match within 0.05; its "
              "base is a small random Llama with SmolLM2's tokenizer, so its scores show that both devices train the "
              "same, not what SmolLM2 learns). Samples/s: the last epoch's, after its first step."]
    return "\n".join(lines)


def classify_rows(r: dict) -> str:
    pred, inproc = r.get("predictor", {}), r.get("in_process", {})
    delta = r.get("f1_delta_vs_cpu")
    goal = r.get("goal_f1_delta", 0.01)
    met = "not measured" if delta is None else "met" if abs(delta) <= goal else "**not met**"
    lines = [f"Classification ({r.get('model')}), the quickstart's processed split carried from here, "
             f"{r['seconds']} s of its {r['limit_s']:g} s limit.{_status(r)}", "",
             "| run | precision | rows/s | held-out F1 | goal |", "| --- | --- | --- | --- | --- |",
             f"| torchrun path, training | {r.get('precision')} | {_f(r.get('train_samples_per_s'))} | "
             f"{_f(r.get('train_f1'), '.4f')} (CPU {_f(r.get('cpu_f1'), '.4f')}) | |f1 - CPU| <= {goal} ({met}) |"]
    for name in ("fp32", "bf16"):
        if name in pred:
            lines.append(f"| Predictor, {name} | {name} | {_f(pred[name]['rows_per_s'])} | "
                         f"{_f(pred[name]['f1'], '.4f')} | |")
    lines += ["", f"Predictor bf16 F1 - fp32 F1: {_f(r.get('predictor_bf16_f1_delta'), '+.4f')}. In-process "
                  f"`predict()`, batched (32 rows a call) {_f(inproc.get('batched32_rows_per_s'))} rows/s against "
                  f"unbatched {_f(inproc.get('unbatched_rows_per_s'))}: "
                  f"{_goal(inproc.get('batched_vs_unbatched'), r.get('goal_batched_vs_unbatched', 4.0), '.1f')} x. "
                  f"CPU figure: {r.get('cpu_f1_source')}."]
    return "\n".join(lines)


def generate_rows(r: dict) -> str:
    def ms(value) -> str:
        return _f(None if value is None else 1000 * value, ".1f")

    params = _f(r.get("params", 0) / 1e6, ".1f")
    lines = [f"Chat generation: the chat task's continuous-batching engine (`workflows.tasks.chat.engine`, the one "
             f"Serve runs) called directly by closed-loop clients, against static batching ({r.get('static')}), on "
             f"{r.get('model')} ({params}M params; weights: {r.get('weights')}, seed {r.get('seed')}), "
             f"{r.get('precision')}, attention {r.get('attn_implementation')}; every request a "
             f"{r.get('prompt_tokens')}-token prompt and {r.get('max_tokens')} greedy tokens (EOS ignored); "
             f"tokenizer: {r.get('tokenizer')}; measured {r['measured_at']}, {r['seconds']} s of its "
             f"{r['limit_s']:g} s limit.{_status(r)}", "",
             "| path | concurrency | requests | output tokens/s | TTFT p50 / p99 (ms) | inter-token p50 / p99 (ms) "
             "| mean batch |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for x in r.get("rows", []):
        lines.append(f"| {x['path']} | {x['concurrency']} | {x['requests']} | {_f(x['tokens_per_s'])} | "
                     f"{ms(x['ttft_s_p50'])} / {ms(x['ttft_s_p99'])} | {ms(x['itl_s_p50'])} / {ms(x['itl_s_p99'])} | "
                     f"{_f(x.get('mean_batch'), '.1f', '')} |")
    peak = r.get("peak_memory_gib")
    lines += ["", f"Engine at concurrency {r.get('max_batch')} against static batching: "
                  f"**{_f(r.get('engine_vs_static'), '.2f')}x** the output tokens/s; against concurrency 1: "
                  f"{_f(r.get('top_vs_one'), '.1f')}x." + ("" if peak is None else f" Peak GPU memory {peak} GiB.")
              + " The engine runs as Serve runs it on a GPU replica: it makes its inputs on the model's device. Static "
                "batching's TTFT counts every request as waiting from the start, so a later batch's wait is in it."]
    return "\n".join(lines)


def chat_rows(r: dict) -> str:
    runs = r.get("runs", {})
    params = _f(r.get("params", 0) / 1e6, ".1f")
    trainable = _f(r.get("trainable_params", 0) / 1e6, ".2f")
    counts = r.get("data_counts") or {}
    check = r.get("tokenizer_check") or {}
    lines = [f"Chat fine-tuning: the chat config's training (`--config chat`: 2 epochs, batch 8, lr 1e-3; LoRA r 16 "
             f"on every linear layer, {trainable}M of {params}M parameters trained) on {r.get('model')} (weights: "
             f"{r.get('weights')}), the chat config's processed split carried from here ({_f(counts.get('train'))} "
             f"training and {_f(counts.get('val'))} validation conversations, SmolLM2's tokenizer: "
             f"{check.get('identical', 'n/a')}/{check.get('rows', 'n/a')} rows re-encoded identically there); "
             f"attention {r.get('attn_implementation')} ({r.get('sdpa_calls_per_forward', 'n/a')} SDPA calls a "
             f"forward, {r.get('layers', 'n/a')} layers); measured {r['measured_at']}, {r['seconds']} s of its "
             f"{r['limit_s']:g} s limit.{_status(r)}", "",
             "| run | path | precision | train loss by epoch | val loss by epoch | val exact match | tokens/s "
             "| samples/s | train s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("lora_bf16", "lora_fp32", "full_bf16"):
        x = runs.get(name)
        if not x:
            continue
        if "skipped" in x:
            lines.append(f"| {name} | skipped: {x['skipped']} | | | | | | | |")
            continue
        loss = lambda v: " / ".join(_f(y, ".3f") for y in v)  # noqa: E731
        lines.append(f"| {x['finetune']} | {x['path']} | {x['precision']} | {loss(x['train_loss'])} | "
                     f"{loss(x['val_loss'])} | {_f(x['val_exact_match'], '.3f')} | {_f(x['tokens_per_s'])} | "
                     f"{_f(x['samples_per_s'], '.1f')} | {_f(x['train_seconds'], '.1f')} |")
    cmp = r.get("bf16_vs_fp32") or {}
    delta, goal = cmp.get("val_loss_rel_delta"), r.get("goal_val_loss_rel_delta", 0.02)
    met = "not measured" if delta is None else "met" if r.get("goal_met") else "**not met**"
    lines += ["", f"LoRA bf16 against fp32 from the same init, on the same rows in the same order: val loss "
                  f"{_f(delta, '+.2%')} (goal within {goal:.0%}, and the loss falling in both: {met}); last epoch's "
                  f"train loss {_f(cmp.get('train_loss_rel_delta'), '+.2%')}; largest step-loss difference "
                  f"{_f(cmp.get('max_step_loss_abs_delta'), '.3f')}; bf16 {_f(cmp.get('tokens_per_s_ratio'), '.2f')}x "
                  f"fp32's tokens/s. Random weights: the losses show the two precisions agree and training descends, "
                  f"not what SmolLM2 learns (its real weights are too large to carry). Tokens/s and samples/s: the "
                  f"last epoch's."
              + ("" if runs.get("lora_fp32", {}).get("peak_memory_gib") is None
                 else f" Peak GPU memory of the fp32 LoRA run {runs['lora_fp32']['peak_memory_gib']} GiB.")]
    return "\n".join(lines)


def markdown(results: list[dict]) -> str:
    if not results:
        return (f"{HEADING}\n\n**No GPU has been lent to this project yet**: nothing in it has run on a GPU, so this "
                f"section has no figures. {HOW}\n")
    env = results[0]["environment"]
    parts = [HEADING, "", f"Measured on {env['device']} ({env['cpus']} CPUs, torch {env['torch']}, CUDA {env['cuda']}, "
             f"{results[0]['measured_at']}). {HOW}", ""]
    for r in results:
        parts += [{"pipeline": pipeline_rows, "lm": lm_rows, "resnet": resnet_rows, "classify": classify_rows,
                   "generate": generate_rows, "chat": chat_rows}[r["step"]](r), ""]
    return "\n".join(parts)


def render(results_dir: str | Path, doc: Path) -> list[Path]:
    """Write the `gpu` section of `doc`; the result files it read."""
    results = load(results_dir)
    write_doc_section("gpu", markdown(results), doc)
    return [Path(results_dir) / f"gpu-{r['step']}.json" for r in results]

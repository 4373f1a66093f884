"""The generate step of the GPU measurement: the chat task's own continuous-batching engine
(workflows.tasks.chat.engine, the one Serve runs) on one GPU in bf16 with SDPA attention, against static
batching (Hugging Face `generate` on a left-padded batch of 32), in the same process on the same model.

The model has SmolLM2-135M-Instruct's exact architecture (`SMOLLM2_135M`, checked against the packaged
GGUF's own config by `make bench-gpu-prepare`) with random weights under a fixed seed: its weights
(93 MB GGUF, 270 MB in bf16) cannot travel to the device, and speed depends on shapes only. Every request
has the same prompt length and produces the same number of tokens (greedy, EOS ignored), so every row
does the same work per request. The clients, the static baseline and the figures are `workflows bench
generate`'s own (workflows.bench.generate): closed-loop clients, each sending its next request once its
previous one has ended; time to first token and inter-token latency from each token's sampling time.

The engine and the static baseline run the product code as it is: the engine makes its inputs on the
model's device (as a Serve replica with a GPU runs it), and `static_run` its batches there.

    make bench-gpu-prepare    # also writes .gpu-prep/smollm2/: the GGUF's tokenizer and config
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

# SmolLM2-135M(-Instruct)'s config (LlamaForCausalLM), as its GGUF metadata gives it
SMOLLM2_135M: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TINY: dict[str, Any] = dict(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-5,
    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
ARCH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
GENERATE: dict[str, dict[str, Any]] = {
    "full": dict(config=SMOLLM2_135M, prompt_tokens=128, max_tokens=64, concurrency=(1, 8, 16, 32), static_batch=32,
                 min_requests=4),
    "smoke": dict(config=TINY, prompt_tokens=8, max_tokens=4, concurrency=(1, 4), static_batch=4, min_requests=2)}
PREPARED = "smollm2"  # the folder in .gpu-prep: tokenizer files and gguf_config.json
SEED = 0


def differences(gguf: dict, ours: dict) -> dict:
    """ARCH_KEYS whose values differ, as {key: (gguf's, ours)}; floats within float32 rounding are equal
    (the GGUF stores rms_norm_eps as a float32)."""
    def same(a, b) -> bool:
        if isinstance(a, float) or isinstance(b, float):
            return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
        return a == b

    return {k: (gguf.get(k), ours[k]) for k in ARCH_KEYS if not same(gguf.get(k), ours[k])}


def toy_tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` ids ("t0" ...), where no prepared one is carried."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t2")


def prepare(dst: Path) -> dict:
    """SmolLM2-135M-Instruct's tokenizer and config from the packaged GGUF into `dst` (a few MB), for the
    device: its engine detokenizes with the real tokenizer, and the step checks its architecture against it."""
    from transformers import AutoConfig, AutoTokenizer

    from workflows.tasks.chat.training.smollm2 import gguf_path

    folder, name = os.path.split(gguf_path())
    dst.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(dst)
    config = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    (dst / "gguf_config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    mismatched = differences(config, SMOLLM2_135M)
    if mismatched:
        print(f"bench gpu prepare: SmolLM2's GGUF config differs from benchmarks/gpu/generate.py's SMOLLM2_135M "
              f"(gguf, ours): {mismatched}")
    return mismatched


def row_figures(key: str, concurrency: int, measured: dict, extra: dict) -> dict:
    from workflows.bench.generate_local import percentile

    return {"row": key, "concurrency": concurrency, "requests": len(measured["ttft"]), "tokens": measured["tokens"],
            "seconds": round(measured["seconds"], 3), "tokens_per_s": round(measured["tokens_per_s"], 1),
            "ttft_s_p50": round(percentile(measured["ttft"], 0.5), 4),
            "ttft_s_p99": round(percentile(measured["ttft"], 0.99), 4),
            "itl_s_p50": round(percentile(measured["itl"], 0.5), 5),
            "itl_s_p99": round(percentile(measured["itl"], 0.99), 5), **extra}


def step_generate(smoke: bool, emit, data: str | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from workflows.bench.generate_local import engine_run, static_run
    from workflows.tasks.chat.engine import Engine
    from workflows.tasks.chat.training.model import attn_implementation  # the chat task's: SDPA on a GPU, eager on CPU

    p = GENERATE["smoke" if smoke else "full"]
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    prepared = Path(data) / PREPARED if data else None
    arch: dict[str, Any] = dict(p["config"])
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "model": "SmolLM2-135M-Instruct architecture (LlamaForCausalLM)" if not smoke else "tiny Llama (smoke)",
        "weights": "random, SmolLM2-135M architecture" if not smoke else "random, tiny Llama (smoke)",
        "seed": SEED, "architecture": {k: arch[k] for k in ARCH_KEYS},
        "precision": "bf16" if gpu else "fp32", "attn_implementation": attn_implementation(),
        "prompt_tokens": p["prompt_tokens"], "max_tokens": p["max_tokens"], "eos": "ignored (every request "
        "produces max_tokens)", "sampling": "greedy",
        "engine": "workflows.tasks.chat.engine.Engine, called directly (no HTTP), closed-loop clients "
                  "(workflows.bench.generate_local.engine_run); its inputs made on the model's device by the engine "
                  "itself",
        "static": f"Hugging Face generate on a left-padded batch of {p['static_batch']}, "
                  "workflows.bench.generate_local.static_run"}
    if prepared is not None and (prepared / "tokenizer.json").exists():
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            tok = AutoTokenizer.from_pretrained(str(prepared))
        except Exception as e:  # another transformers than the one that saved it: the tokenizer.json alone
            print(f"generate: AutoTokenizer: {e!r}; reading tokenizer.json alone", flush=True)
            tok = PreTrainedTokenizerFast(tokenizer_file=str(prepared / "tokenizer.json"), eos_token="<|im_end|>",
                                          pad_token="<|im_end|>")
        out["tokenizer"] = "SmolLM2-135M-Instruct's (from the packaged GGUF)"
        gguf = json.loads((prepared / "gguf_config.json").read_text())
        out["architecture_vs_gguf"] = differences(gguf, arch) or "identical"
    else:
        tok = toy_tokenizer(arch["vocab_size"])
        out["tokenizer"] = f"word-level toy over {arch['vocab_size']} ids (no prepared SmolLM2 tokenizer)"
    config = LlamaConfig(**arch)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if gpu else torch.float32,
                                             attn_implementation=out["attn_implementation"]).to(device).eval()
    out["params"] = sum(t.numel() for t in model.parameters())
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    levels = list(p["concurrency"])
    requests = {c: max(p["min_requests"], 2 * c) for c in levels}
    n_static = 2 * p["static_batch"]
    g = torch.Generator().manual_seed(SEED)
    low = min(100, arch["vocab_size"] // 2)  # clear of the special tokens
    prompts = torch.randint(low, arch["vocab_size"], (max(n_static, *requests.values()), p["prompt_tokens"]),
                            generator=g).tolist()
    engine = Engine(model, tok, max_batch=max(levels), max_queue=len(prompts))
    out.update(max_batch=max(levels), requests_per_level={str(c): n for c, n in requests.items()},
               static_requests=n_static, rows=[])
    try:
        t0 = time.perf_counter()  # warm-up: the first calls allocate and pick kernels, at the largest batch
        engine_run(engine, prompts[:max(levels)], 4, max(levels))
        static_run(model, pad, prompts[:p["static_batch"]], 4, p["static_batch"])
        out["warmup_s"] = round(time.perf_counter() - t0, 2)
        emit(out)
        for c in levels:
            before = dict(engine.stats)
            measured = engine_run(engine, prompts[:requests[c]], p["max_tokens"], c)
            steps = engine.stats["decode_steps"] - before["decode_steps"]
            mean_batch = (engine.stats["row_steps"] - before["row_steps"]) / max(steps, 1)
            extra = {"path": "engine (continuous batching)", "mean_batch": round(mean_batch, 2)}
            out["rows"].append(row_figures(f"engine_c{c}", c, measured, extra))
            emit(out)
        measured = static_run(model, pad, prompts[:n_static], p["max_tokens"], p["static_batch"])
        out["rows"].append(row_figures(f"static_{p['static_batch']}", p["static_batch"], measured,
                                       {"path": f"static batching (generate, {p['static_batch']} a batch)"}))
    finally:
        engine.close()
    by = {r["row"]: r for r in out["rows"]}
    top, one = by[f"engine_c{max(levels)}"], by[f"engine_c{min(levels)}"]
    out["engine_vs_static"] = round(top["tokens_per_s"] / by[f"static_{p['static_batch']}"]["tokens_per_s"], 3)
    out["top_vs_one"] = round(top["tokens_per_s"] / one["tokens_per_s"], 3)
    out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None
    emit(out)

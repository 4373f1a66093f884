"""The served model and its engine, as serve.generate.engine names it:
- builtin: a registered chat model loaded by the training side's `load_trained` (a whole model, or a LoRA
  adapter on the base its card names, checked by sha256, kept unmerged and served as the peft adapter
  "default"), put on the replica's device in the precision serve.precision names, and the
  continuous-batching engine over it, sized by serve.generate;
- vllm: vLLM's engine (workflows.tasks.chat.vllm_engine) over the same files (the base checked by sha256
  the same way, the adapter served as "default"), sized by the same settings.
"""

from __future__ import annotations

import logging

from workflows.tasks.chat.adapters import is_adapter
from workflows.tasks.chat.engine import Engine
from workflows.tasks.chat.training.model import card_base_dir, load_trained
from workflows.tasks.predictor import serving_model

log = logging.getLogger(__name__)


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX), where serving in bf16 reads
    half the bytes of fp32 at a higher matmul rate; elsewhere oneDNN emulates them."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def load_engine(model_dir: str, card, cfg, precision: str, tokenizer, threads: int | None = None):
    """The engine serve.generate.engine names over the registered model in `model_dir`; `threads`: the CPU
    threads it computes with, if not the replica's (serve.cpus_per_replica)."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"serve.precision={precision}: a chat model is served in fp32 or bf16")
    return ENGINES[cfg.serve.generate.engine](model_dir, card, cfg, precision, tokenizer, threads)


def builtin_engine(model_dir: str, card, cfg, precision: str, tokenizer, threads: int | None = None) -> Engine:
    """The engine over the registered model in `model_dir`: on the replica's GPU when it has one (SDPA
    attention there: load_causal_lm), in bf16 when `precision` says so; the engine makes its inputs
    where the model is."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"serve.precision={precision}: a chat model is served in fp32 or bf16")
    model, device = serving_model(load_trained(model_dir, card, cfg), precision, threads=None)  # the caller's
    if precision == "bf16" and device.type == "cpu" and not native_cpu_bf16():
        log.warning("serve.precision=bf16 on a CPU without AVX512-BF16 or AMX: its bf16 matmuls "
                    "are emulated and slower than fp32 (docs/guides/serve.md)")
    gen = cfg.serve.generate
    return Engine(model, tokenizer, max_batch=gen.max_batch, max_queue=gen.max_queue,
                  retry_after_s=gen.retry_after_s, max_prompt_tokens=gen.max_prompt_tokens,
                  max_context=gen.max_prompt_tokens + gen.max_tokens, prefill_chunk=gen.prefill_chunk,
                  max_prefill_tokens=gen.max_prefill_tokens, mixed_step_ratio=gen.mixed_step_ratio,
                  prefill_wave=gen.prefill_wave, join_wait_s=gen.join_wait_s,
                  timeout_s=gen.timeout_s, prepack=gen.prepack_weights, forward=gen.forward,
                  one_token_graph=gen.one_token_graph, attention_kernel=gen.attention_kernel)


def vllm_engine(model_dir: str, card, cfg, precision: str, tokenizer, threads: int | None = None):
    """vLLM's engine over the registered model: its base's folder (the card's, checked by sha256, for an
    adapter), on serve.gpus_per_replica GPUs (a placement group of its own) when it names some, else beside
    the replica on its CPUs."""
    from transformers import GenerationConfig

    from workflows.tasks.chat.vllm_engine.launch import start_vllm_engine

    base_dir = card_base_dir(card, cfg) if is_adapter(model_dir) else model_dir
    try:
        eos = GenerationConfig.from_pretrained(base_dir).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    eos = eos if eos is not None else tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    return start_vllm_engine(model_dir, base_dir, cfg.serve.generate, precision, eos_ids,
                             threads or cfg.serve.cpus_per_replica, on_gpu=bool(cfg.serve.gpus_per_replica),
                             niceness=cfg.serve.replica_niceness)


ENGINES = {"builtin": builtin_engine, "vllm": vllm_engine}

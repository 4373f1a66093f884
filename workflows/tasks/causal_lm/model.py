"""Causal-LM pretraining: a GPT-style transformers model built from a size preset (random init),
trained on the processed dataset's tokens packed into fixed-length blocks, and its FLOPs/MFU.

The model is transformers' GPT2LMHeadModel (no custom model code); the tokenizer is the one the
dataset was preprocessed with, so `vocab_size` follows it. Packing concatenates the token rows
(each already ends with its tokenizer's separator) and cuts blocks of `seq_len`: no padding, every
position is trained on, as GPT pretraining does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from workflows.tasks.causal_lm.options import shape

if TYPE_CHECKING:  # torch is imported inside the functions: the planner reads a shape without it
    import torch

# Dense bf16 tensor-core peak per device (vendor datasheets, without sparsity), for MFU.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("GH200", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("A10G", 70e12), ("L40S", 362e12), ("L4", 121e12),
]


VOCAB_MULTIPLE = 64  # the embedding and output head padded to a multiple of this many rows


def padded_vocab(vocab_size: int) -> int:
    """The tokenizer's vocabulary rounded up to VOCAB_MULTIPLE (GPT-2's 50,257 -> 50,304, as nanoGPT
    pads it): the output head's matmul then runs on tensor-core-friendly shapes. The extra rows are
    never an input or a label; training pushes their logits down like any wrong token's."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def causal_lm_config(lm_cfg, vocab_size: int, dropout: float | None = None, attn: str | None = None):
    """The transformers GPT2Config of a size preset (the planner reads it without building the model),
    its vocabulary `vocab_size` padded (padded_vocab)."""
    from transformers import GPT2Config

    layers, hidden, heads = shape(lm_cfg)
    p = 0.0 if dropout is None else dropout  # pretraining at scale runs without dropout
    config = GPT2Config(vocab_size=padded_vocab(vocab_size), n_positions=lm_cfg.seq_len, n_embd=hidden, n_layer=layers,
                        n_head=heads, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False,
                        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    if attn is not None:
        config._attn_implementation = attn
    return config


def build_causal_lm(lm_cfg, vocab_size: int, dropout: float | None = None) -> torch.nn.Module:
    """A randomly initialized GPT-2-style model (seeded by the caller)."""
    import torch
    from transformers import GPT2LMHeadModel

    config = causal_lm_config(lm_cfg, vocab_size, dropout)
    # SDPA (flash / memory-efficient kernels on GPU); eager keeps CPU results bit-stable
    attn = "sdpa" if torch.cuda.is_available() else "eager"
    model = GPT2LMHeadModel._from_config(config, attn_implementation=attn)
    model.loss_type = "ForCausalLM"  # transformers derives it from the class name and misses GPT2LMHeadModel
    return model


def pack_blocks(rows: Iterable[np.ndarray], seq_len: int) -> np.ndarray:
    """Concatenate token rows and cut [n, seq_len] blocks; the tail shorter than a block is dropped."""
    parts = [np.asarray(r, dtype=np.int64) for r in rows]
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    n = len(flat) // seq_len
    return flat[: n * seq_len].reshape(n, seq_len)


PACK_ROWS = 1024  # rows concatenated per packing batch (each batch drops its own short tail)


def pack_batch(batch: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """Ray Data map_batches: rows of token ids -> rows of `seq_len`-token blocks."""
    return {"input_ids": pack_blocks(batch["input_ids"], seq_len)}


def lm_collate(blocks: np.ndarray | list) -> dict[str, torch.Tensor]:
    """Blocks -> a causal-LM batch; the model shifts `labels` by one position itself. No attention mask:
    blocks have no padding, and an all-ones mask makes the model ask the device whether it is all ones
    (a host sync every forward)."""
    import torch

    ids = torch.from_numpy(np.stack([np.asarray(b, dtype=np.int64) for b in blocks]))
    return {"input_ids": ids, "labels": ids.clone()}


def flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weights' matmuls (forward 2N + backward 4N) plus the
    attention scores and weighted sum, 12·L·h·s (PaLM's MFU formula, appendix B)."""
    return 6.0 * params + 12.0 * layers * hidden * seq_len


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(bf16 peak FLOP/s of one device, its name); None off GPU or for a device not in the table."""
    import torch

    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    return peak_for_name(name), name


def peak_for_name(name: str) -> float | None:
    """The table's peak for a CUDA device name ('NVIDIA H100 80GB HBM3' -> H100 SXM)."""
    for key, peak in PEAK_BF16_FLOPS:
        if key in name:
            return peak
    return None


def mfu(tokens_per_s: float, params: int, layers: int, hidden: int, seq_len: int, devices: int,
        device: torch.device) -> float | None:
    """Model FLOPs utilization of `devices` devices together; None where the peak is unknown."""
    peak, _ = peak_flops(device)
    if peak is None:
        return None
    return tokens_per_s * flops_per_token(params, layers, hidden, seq_len) / (peak * devices)


def model_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(non-embedding-position parameters, layers, hidden) of a GPT-2 model, for flops_per_token.
    Tied input/output embeddings count once (they are one tensor) and do take part in the matmuls."""
    from workflows.parallel import unwrap

    m = unwrap(model)
    params = sum(p.numel() for n, p in m.named_parameters() if "wpe" not in n)
    return params, m.config.n_layer, m.config.n_embd

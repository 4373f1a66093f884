"""The roofline of a decode step: the larger of its FLOPs over this machine's measured matmul rate and
its bytes over its measured memory bandwidth, both measured in the bench's own run (between its rows).

A decode step of B rows, each with T tokens already in its KV cache, on a Llama-style causal LM:
- FLOPs: 2 x B x the weights every token multiplies (every Linear of the layers and the output head,
  which with tied embeddings is the embedding matrix again), plus attention's 4 x B x layers x T x
  (heads x head_dim) for the scores and the weighted values;
- bytes: each of those weights read once per step (however many rows), plus every row's cache read
  once: B x T x 2 (keys, values) x layers x kv_heads x head_dim, in the model's dtype. The embedding
  lookup reads B rows of the table, nothing next to the rest.

A step's matmuls of B rows run below the square matmul's rate: `matmul_floor` times those matmuls
alone (each layer's fused projections and the output head, on weights of their own, in the step's
order), the least time a step computing with this machine's matmul kernels can take.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def decode_step(model, rows: int, context: float) -> dict:
    """FLOPs and bytes of one decode step of `rows` rows with `context` cached tokens each."""
    import torch

    cfg = model.config
    layers = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    linear = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    head = model.get_output_embeddings()
    if head is not None:
        linear[id(head.weight)] = head.weight  # tied: the embedding matrix, counted once, as the head
    weights = sum(w.numel() for w in linear.values())
    size = next(iter(linear.values())).element_size()
    flops = 2.0 * rows * weights + 4.0 * rows * layers * context * heads * head_dim
    cache = rows * context * 2 * layers * kv_heads * head_dim * size
    return {"rows": rows, "context": round(context, 1), "matmul_weights": weights, "flops": flops,
            "weight_bytes": weights * size, "cache_bytes": cache, "bytes": weights * size + cache}


def matmul_rate(n: int = 1024, seconds: float = 1.0, dtype=None) -> float:
    """FLOP/s of square matmuls (n^3, compute-bound) on this process's torch threads."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or count < 5:
        torch.matmul(a, b)
        count += 1
    return 2.0 * n ** 3 * count / (time.perf_counter() - t0)


def memory_bandwidth(mib: int = 512, seconds: float = 1.0) -> float:
    """Bytes/s read from memory: sums over a buffer far larger than the caches."""
    import torch

    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    x.sum()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or count < 3:
        x.sum()
        count += 1
    return x.numel() * 4.0 * count / (time.perf_counter() - t0)


def step_weights(model) -> list[torch.Tensor]:
    """The weights a compiled decode step multiplies, in its order: each decoder layer's fused q/k/v,
    its o, its fused gate/up and its down projection (workflows.tasks.chat.engine.compiled fuses them
    the same way), then the output head. Copies: they do not share memory with the model's."""
    import torch

    layers = model.get_decoder().layers
    weights = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight,
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]
    weights.append(model.get_output_embeddings().weight)
    return [w.detach().clone().contiguous() for w in weights]


def matmul_floor(model, rows: int, repeats: int = 7) -> dict:
    """Seconds of a decode step's matmuls alone at `rows` rows, on this process's torch threads: every
    weight of `step_weights` once, in order (so they stream from memory as in a step; the model's
    weights far exceed the caches), the whole sequence through MKL's matmul on the plain weights and
    through oneDNN's on the weights packed (`engine.linear`'s kernel), alternating, the median of
    `repeats` each; the faster is kept. Llama-layout models only (q/k/v/o, gate/up/down); an empty dict
    for another."""
    import torch

    from workflows.tasks.chat.engine.linear import packing_available

    try:
        plain = step_weights(model)
    except AttributeError:
        return {}
    x = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in plain}
    kernels = {"mkl": lambda w, a: torch.nn.functional.linear(a, w)}
    packed: list[torch.Tensor] = []
    if packing_available() and plain[0].dtype == torch.float32:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in plain]
        kernels["onednn"] = lambda w, a: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")

    def run(kernel, weights) -> float:
        t0 = time.perf_counter()
        for w, p in zip(plain, weights):
            kernel(p, x[w.shape[1]])
        return time.perf_counter() - t0

    seconds: dict[str, list[float]] = {}
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first of each is a warm-up; the kernels alternate
            for name, kernel in kernels.items():
                seconds.setdefault(name, []).append(run(kernel, packed if name == "onednn" else plain))
    medians = {name: statistics.median(s[1:]) for name, s in seconds.items()}
    best = min(medians, key=lambda k: medians[k])
    flops = 2.0 * rows * sum(w.numel() for w in plain)
    return {"rows": rows, "floor_s": medians[best], "kernel": best, "flops": flops,
            "by_kernel_s": {k: round(v, 5) for k, v in medians.items()},
            "flops_per_s": flops / medians[best]}


def roofline(step: dict, flops_per_s: float, bytes_per_s: float) -> dict:
    """The step's least time, which bound sets it, and tokens/s at that time."""
    compute, memory = step["flops"] / flops_per_s, step["bytes"] / bytes_per_s
    seconds = max(compute, memory)
    return {"step_s": seconds, "compute_s": compute, "memory_s": memory,
            "bound": "memory" if memory >= compute else "compute", "tokens_per_s": step["rows"] / seconds}

"""Per-device training memory for DDP and FSDP2, and the largest micro-batch that fits (the planner's estimate).

    M_total = M_model + M_optimizer + M_gradients + M_activations        (per device, plus buffers)

Inputs. Parameter counts come from the real model class built on the meta device
(`torch.device("meta")`: no weights are read or allocated; a ~1B model takes milliseconds); the
architecture from its Hugging Face config: hidden size h, layers L, heads a, vocabulary V, MLP width
i (`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `vocab_size`, `intermediate_size`, or
GPT-2's `n_embd`/`n_layer`/`n_head`/`n_inner`). P is the parameter count, P_t its trainable part
(the text task's `model.options.freeze_embeddings` freezes the input embeddings, as training does),
d the devices (data-parallel ranks), s the sequence length (`preprocess.max_length`: batches are
padded to their longest row, so this is the worst case), b the micro-batch per device
(`train.batch_size`).

Precision (bytes per parameter)
  fp32  params 4, grads 4, AdamW state 8 (exp_avg + exp_avg_sq): 16 bytes per trainable parameter;
        activations 4 bytes per element. What this project trains on CPU, and with DDP everywhere
        (workflows/parallel.py adds no autocast to DDP).
  bf16  mixed precision: fp32 master params, fp32 grads and fp32 AdamW state as above (still 16
        bytes/param resident), computation and activations in bf16 (2 bytes). FSDP2
        `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` (what parallel.py applies on
        GPU) all-gathers bf16 copies of the parameters; DDP + autocast keeps bf16 copies of the
        weights instead (autocast's cast cache, saved for backward): +2 bytes/param.
  'auto' (the CLI default) follows parallelize(): bf16 for FSDP when `train.use_gpu`, fp32 otherwise.

Strategies
  ddp   everything replicated: params 4P, grads 4P_t, AdamW 8P_t (16 bytes/param when all are
        trainable). With d > 1 DDP's gradient buckets hold a second copy of the gradients
        (`gradient_as_bucket_view=False`, the default): +4P_t for the whole run. d = 1 is the plain
        model.
  fsdp  FSDP2 `fully_shard` per transformer block, then the root (ZeRO-3-like): params, grads and
        AdamW state sharded by d (16 P_t / d), plus unsharded copies at the compute dtype: during
        forward/backward the root group (embeddings, head: the root is not resharded after forward)
        and two blocks (the one computing, the one prefetched), and one block's gradient in flight
        (its unsharded gradient at the compute dtype + the flat fp32 reduce-scatter input); at the
        end of backward the root's parameters and its gradient in flight. Padding is ignored.

Activations (per device; data parallelism does not shard them)
  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
  s b h (34 + 5 a s / h) bytes per layer with 16-bit activations, 1-byte dropout masks, i = 4h.
  Generalised here with e bytes per element (2 bf16, 4 fp32) and m bytes per dropout-mask element
  (1 on CUDA, where dropout is fused and keeps a bool mask; e on CPU, where it keeps a float mask):
      per layer = e (6 s b h + a s^2 b [+ a s^2 b with attention dropout])         inputs of the
                + 2 n s b h                                                         linears, Q/K/V,
                + (g + e) s b i    [gated MLP (SwiGLU): (g + 3e) s b i]             softmax, norms,
                + m (2 s b h + a s^2 b)    [only with dropout]                      MLP, masks
  n and g are the bytes a norm layer and the MLP's activation function keep for backward per input
  element, probed on small real tensors (LayerNorm: e, Llama's RMSNorm: 4 + e, GELU and SiLU: e,
  GPT-2's tanh-GELU composed in Python: 4e); + e when the activation does not keep its output (the
  second linear's input). With e = n = g = 2, m = 1, i = 4h: exactly 34 s b h + 5 a s^2 b.
  Fused attention (SDPA flash/memory-efficient kernels; `attention='fused'`, the default for GPUs
  when the model uses SDPA) keeps the attention output and the log-sum-exp (e s b h + 4 a s b)
  instead of the a s^2 b terms. Outside the blocks: one norm (n s b h), the embeddings' dropout mask,
  the head's input (e s b h when it reads every position: causal LMs, causal-LM classifiers), and
  backward's working set (the gradients of one layer's widest activations: e (s b i + a s^2 b)).
  Causal-LM pretraining adds the vocabulary-wide logits, V = vocab size: transformers' loss upcasts
  them to fp32 and cross_entropy keeps its log-softmax for backward, while the model's output holds
  the logits, so (e + 4) s b V stay until backward reaches the head; there backward's working set is
  the fp32 gradients of the log-softmax's output and input, 8 s b V (+ 2 s b V casting to bf16),
  which replaces the layers' working set when larger (it comes first, before any layer's).
  Activation checkpointing keeps each layer's input (L e s b h) and recomputes one layer at a time.

Temporaries of the optimizer step: foreach AdamW (the CUDA default) allocates sqrt(exp_avg_sq) for all
local trainable parameters (4 P_t, / d under FSDP); the single-tensor AdamW (CPU) two temporaries the
size of the largest parameter.

Peak. Activations and gradients never all coexist (zero_grad(set_to_none=True) frees the gradients
after each step; backward frees a layer's activations as it allocates its gradients), so the peak is
the largest of three phases on top of the resident params + optimizer state (+ DDP buckets):
    forward/backward:   + activations + forward buffers       (+ gradients with accumulation)
    end of backward:    + gradients + the root's buffers
    optimizer step:     + gradients + step temporaries
`upper_bound` is the plain sum of everything. Measured on CPU (tests/test_planner.py: BERT, GPT-2,
Llama shapes, DDP and FSDP2 on 2 ranks, checkpointing, frozen embeddings, a GPT-2 causal LM) the peak estimate is
within ~3% of the measured peak. Not modelled: the CUDA context, NCCL buffers, cuBLAS workspaces,
the caching allocator's fragmentation: the safety margin covers them, usable = device memory x
(1 - 10%) - 1 GiB.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from workflows.errors import UserError
from workflows.tasks.model_spec import ModelSpec

GiB = 1024**3
FRAGMENTATION_MARGIN = 0.10  # of the device memory: allocator fragmentation, framework overhead
RESERVED_BYTES = 1 * GiB  # CUDA context, NCCL/Gloo buffers, kernels' workspaces
STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")
ATTENTIONS = ("eager", "fused")


@dataclass(frozen=True)
class Estimate:
    """Per-device bytes of one training setup, by component and lifetime."""

    strategy: str
    precision: str
    devices: int
    seq_len: int
    micro_batch: int
    checkpointing: bool
    attention: str
    accumulation: bool
    model: int  # resident parameters (fp32; sharded under FSDP)
    gradients: int  # the gradients kept for the optimizer step (sharded under FSDP)
    optimizer: int  # AdamW state
    activations: int  # saved for backward, plus backward's working set
    buffers_persistent: int  # DDP's gradient buckets
    buffers_forward: int  # forward/backward: FSDP's gathered params + one block's in-flight grads; autocast copies
    buffers_backward_end: int  # end of backward: FSDP's gathered root + its in-flight grads
    temporaries: int  # the optimizer step's

    @property
    def buffers(self) -> int:
        return self.buffers_persistent + max(self.buffers_forward, self.buffers_backward_end)

    def phases(self) -> dict[str, int]:
        """Peak bytes of each phase of a step (see the module docstring)."""
        resident = self.model + self.optimizer + self.buffers_persistent
        accumulated = self.gradients if self.accumulation else 0
        return {
            "forward_backward": resident + self.activations + self.buffers_forward + accumulated,
            "backward_end": resident + self.gradients + self.buffers_backward_end,
            "optimizer_step": resident + self.gradients + self.temporaries,
        }

    @property
    def total(self) -> int:
        """The peak: the largest phase."""
        return max(self.phases().values())

    @property
    def upper_bound(self) -> int:
        """Every component at once (the plain sum)."""
        return self.model + self.gradients + self.optimizer + self.activations + self.buffers + self.temporaries

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(buffers=self.buffers, total=self.total, upper_bound=self.upper_bound, phases=self.phases())
        keys = ("model", "gradients", "optimizer", "activations", "buffers", "temporaries", "total", "upper_bound")
        d["gib"] = {k: round(d[k] / GiB, 3) for k in keys}
        return d


def activation_bytes(
    spec: ModelSpec,
    seq_len: int,
    micro_batch: int,
    *,
    precision: str = "fp32",
    device_type: str = "cuda",
    attention: str = "eager",
    checkpointing: bool = False,
    working_set: bool = True,
) -> int:
    """Activations saved for backward on one device, plus (`working_set`) backward's working set."""
    s, b, h, i, a = seq_len, micro_batch, spec.hidden, spec.intermediate, spec.heads
    e = 2 if precision == "bf16" else 4
    m = 1 if device_type == "cuda" else e  # dropout mask: bool when fused (CUDA), else a float tensor
    hd, ad = spec.hidden_dropout > 0, spec.attention_dropout > 0
    sbh, sbi, as2b = s * b * h, s * b * i, a * s * s * b
    norm = spec.norm_bytes[precision]
    # attention input, Q, K, V, output projection input, MLP input; two norms
    per_layer = 6 * e * sbh + 2 * norm * sbh + (2 * m * sbh if hd else 0)
    mlp = spec.act_bytes[precision] + (0 if spec.act_saves_output else e)  # activation + the next linear's input
    per_layer += (mlp + 2 * e if spec.gated_mlp else mlp) * sbi  # gated: + the up projection and the product
    working = e * sbi  # backward: the gradient of the MLP's wide activation ...
    if attention == "eager":
        per_layer += e * as2b * (2 if ad else 1) + (m * as2b if ad else 0)  # softmax (+ dropout output, mask)
        working += e * as2b  # ... and of the attention probabilities
    else:  # fused SDPA: its output and the log-sum-exp, no s x s matrices
        per_layer += e * sbh + 4 * a * s * b
    per_layer = int(per_layer)
    # outside the blocks: one norm (embeddings' or the final one), the embeddings' dropout mask, the head
    outside = norm * sbh + (m * sbh if hd else 0) + (e * sbh if spec.per_token_head else 2 * e * b * h)
    if spec.lm_head:  # the logits (held by the output) and the fp32 log-softmax (kept by cross_entropy)
        sbv = s * b * spec.vocab
        outside += (e + 4) * sbv
        working = max(working, (8 + (2 if e == 2 else 0)) * sbv)  # backward starts at the head
    outside = int(outside + (working if working_set else 0))
    if checkpointing:
        return spec.layers * sbh * e + per_layer + outside
    return spec.layers * per_layer + outside


def estimate(
    spec: ModelSpec,
    strategy: str,
    devices: int,
    seq_len: int,
    micro_batch: int,
    *,
    precision: str = "fp32",
    device_type: str = "cuda",
    attention: str = "eager",
    checkpointing: bool = False,
    accumulation: bool = False,
) -> Estimate:
    """Per-device memory of training `spec` with `strategy` on `devices` ranks (see the docstring).

    accumulation: gradients of earlier micro-batches are kept during forward/backward (gradient
    accumulation), so they coexist with the activations.
    """
    if strategy not in STRATEGIES:
        raise UserError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if attention not in ATTENTIONS:
        raise UserError(f"unknown attention {attention!r}: use one of {', '.join(ATTENTIONS)}")
    if devices < 1 or seq_len < 1 or micro_batch < 0:
        raise UserError("devices and sequence length must be >= 1, micro-batch >= 0")
    P, Pt, d = spec.params, spec.trainable, devices
    compute = 2 if precision == "bf16" else 4  # bytes of a parameter as the forward/backward uses it
    if strategy == "ddp":
        model, gradients, optimizer, local_trainable, largest = 4 * P, 4 * Pt, 8 * Pt, Pt, spec.largest_param
        persistent = 4 * Pt if d > 1 else 0  # DDP's gradient buckets
        forward = 2 * P if precision == "bf16" else 0  # autocast's bf16 weight copies, saved for backward
        backward_end = 0  # ... and freed by it
    else:
        model, gradients = math.ceil(4 * P / d), math.ceil(4 * Pt / d)
        optimizer, local_trainable, largest = (
            math.ceil(8 * Pt / d),
            math.ceil(Pt / d),
            math.ceil(spec.largest_param / d),
        )
        persistent = 0
        grad_bytes = compute + 4  # an unsharded gradient (compute dtype) + its fp32 reduce-scatter input
        if spec.block_params:  # the root group (not resharded after forward) + two blocks gathered
            forward = compute * (spec.root_params + min(2, max(spec.layers, 1)) * spec.block_params)
            forward += grad_bytes * spec.block_trainable
            backward_end = compute * spec.root_params + grad_bytes * spec.root_trainable
        else:  # no blocks found: one FSDP unit, everything gathered at once
            forward = backward_end = compute * P + grad_bytes * Pt
    temporaries = 4 * local_trainable if device_type == "cuda" else 2 * 4 * largest
    acts = (
        activation_bytes(
            spec,
            seq_len,
            micro_batch,
            precision=precision,
            device_type=device_type,
            attention=attention,
            checkpointing=checkpointing,
        )
        if micro_batch
        else 0
    )
    return Estimate(
        strategy,
        precision,
        d,
        seq_len,
        micro_batch,
        checkpointing,
        attention,
        accumulation,
        int(model),
        int(gradients),
        int(optimizer),
        int(acts),
        int(persistent),
        int(forward),
        int(backward_end),
        int(temporaries),
    )


def usable_bytes(device_memory: int) -> int:
    """What the estimate may fill: the device memory less the safety margin."""
    return max(0, int(device_memory * (1 - FRAGMENTATION_MARGIN)) - RESERVED_BYTES)


def max_micro_batch(
    spec: ModelSpec, strategy: str, devices: int, seq_len: int, device_memory: int, limit: int = 1 << 20, **kw
) -> int:
    """The largest micro-batch whose estimate fits in `usable_bytes(device_memory)` (0: none)."""
    budget = usable_bytes(device_memory)
    fits = lambda b: estimate(spec, strategy, devices, seq_len, b, **kw).total <= budget  # noqa: E731
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo



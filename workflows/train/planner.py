"""Memory planner: per-device training memory for DDP and FSDP2, and the largest micro-batch that fits.

    M_total = M_model + M_optimizer + M_gradients + M_activations        (per device, plus buffers)

Inputs. Parameter counts come from the real model class built on the meta device
(`torch.device("meta")`: no weights are read or allocated; a ~1B model takes milliseconds); the
architecture from its Hugging Face config: hidden size h, layers L, heads a, vocabulary V, MLP width
i (`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `vocab_size`, `intermediate_size`, or
GPT-2's `n_embd`/`n_layer`/`n_head`/`n_inner`). P is the parameter count, P_t its trainable part
(`train.freeze_embeddings` freezes the input embeddings, as the trainer does), d the devices
(data-parallel ranks), s the sequence length (`preprocess.max_length`: batches are padded to their
longest row, so this is the worst case), b the micro-batch per device (`train.batch_size`).

Precision (bytes per parameter)
  fp32  params 4, grads 4, AdamW state 8 (exp_avg + exp_avg_sq): 16 bytes per trainable parameter;
        activations 4 bytes per element. What this project trains on CPU, and with DDP everywhere
        (workflows/train/parallel.py adds no autocast to DDP).
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

Recommendation: DDP when it fits (one all-reduce of the gradients per step; FSDP moves ~1.5x those
bytes: two all-gathers of the parameters and a reduce-scatter), FSDP otherwise.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.nn as nn

from workflows.errors import UserError

GiB = 1024**3
FRAGMENTATION_MARGIN = 0.10  # of the device memory: allocator fragmentation, framework overhead
RESERVED_BYTES = 1 * GiB  # CUDA context, NCCL/Gloo buffers, kernels' workspaces
DEFAULT_DEVICE_MEMORY = "80GiB"
STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")
ATTENTIONS = ("eager", "fused")


# ------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelSpec:
    """What the estimate needs to know about a model (counts of parameters, not bytes)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    params: int
    trainable: int
    block_params: int  # the largest transformer block (an FSDP unit)
    block_trainable: int
    root_params: int  # everything outside the blocks (embeddings, final norm, head): the FSDP root
    root_trainable: int
    largest_param: int  # elements of the largest trainable parameter tensor
    gated_mlp: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attn_implementation: str = "eager"
    per_token_head: bool = False  # the head reads every position (causal-LM classifiers' `score`, LM heads)
    lm_head: bool = False  # causal-LM pretraining: vocabulary-wide logits kept for the loss
    # bytes autograd saves per input element, by precision, probed on small real tensors:
    norm_bytes: dict = field(default_factory=lambda: {"fp32": 4.0, "bf16": 2.0})  # one norm layer
    act_bytes: dict = field(default_factory=lambda: {"fp32": 4.0, "bf16": 2.0})  # the MLP's activation
    act_saves_output: bool = False  # its output is among them (ReLU, tanh): the next linear shares it


def _first(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None and v != "":
            return v
    return default


def _build_on_meta(config, causal_lm: bool = False) -> nn.Module:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    with torch.device("meta"):
        if causal_lm:
            return AutoModelForCausalLM.from_config(config)
        try:
            return AutoModelForSequenceClassification.from_config(config)
        except (ValueError, KeyError):  # an architecture without a sequence-classification head
            return AutoModel.from_config(config)


_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def saved_storages(params, forward) -> tuple[dict[int, int], object]:
    """Bytes autograd saves for backward while `forward()` runs, one count per storage (saved-tensor
    hooks; the storages of `params` excluded), and what `forward()` returned."""
    import torch

    own = {t.untyped_storage().data_ptr() for t in params}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return saved, out


def _probe(module: nn.Module | None, width: int, default: float) -> tuple[dict, bool]:
    """Bytes autograd saves per input element when `module` runs (fp32 and bf16), and whether its
    output is among them. Runs a copy of the module on a (2, 3, width) CPU tensor: microseconds."""
    import copy

    import torch

    out_saved, result = False, {}
    for precision, dtype_name in _DTYPES.items():
        dtype = getattr(torch, dtype_name)
        try:
            probe = copy.deepcopy(module).to_empty(device="cpu").to(dtype)
            for prm in probe.parameters():
                prm.data.fill_(1.0)  # to_empty leaves garbage
            x = torch.randn(2, 3, width, dtype=dtype, requires_grad=True)
            saved, y = saved_storages(probe.parameters(), lambda: probe(x))
            result[precision] = sum(saved.values()) / x.numel()
            out_saved = out_saved or y.untyped_storage().data_ptr() in saved
        except Exception:  # noqa: BLE001 - an unusual module: assume it saves its input only
            result[precision] = default * (2 if precision == "bf16" else 4)
    return result, out_saved


def _find(block: nn.Module | None, pred) -> nn.Module | None:
    return next((m for m in block.modules() if pred(m)), None) if block is not None else None


def spec_from_config(config, *, name: str | None = None, freeze_embeddings: bool = False,
                     causal_lm: bool = False) -> ModelSpec:
    """A ModelSpec from a transformers config: the model is built on the meta device (no memory).
    causal_lm: the language model with its LM head (pretraining), not a sequence classifier."""
    from workflows.train.models import transformer_blocks

    model = _build_on_meta(config, causal_lm)
    if freeze_embeddings:
        model.get_input_embeddings().requires_grad_(False)
    params = list(model.parameters())  # shared (tied) parameters once
    blocks = transformer_blocks(model)

    def count(ps, trainable_only=False):
        return sum(p.numel() for p in ps if p.requires_grad or not trainable_only)

    block_counts = [(count(b.parameters()), count(b.parameters(), True)) for b in blocks] or [(0, 0)]
    block_params, block_trainable = max(block_counts)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = [p for p in params if id(p) not in in_blocks]
    hidden = int(_first(config, "hidden_size", "n_embd", "d_model"))
    heads = int(_first(config, "num_attention_heads", "n_head", "n_heads"))
    intermediate = int(_first(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden))
    block = blocks[0] if blocks else None
    names = {n.rsplit(".", 1)[-1] for n, _ in (block.named_modules() if block is not None else [])}
    norm = _find(block, lambda m: "norm" in type(m).__name__.lower() and not list(m.children()))
    act_modules = ("transformers.activations", "torch.nn.modules.activation")
    not_act = (nn.Softmax, nn.MultiheadAttention)
    act = _find(block, lambda m: type(m).__module__ in act_modules and not isinstance(m, not_act))
    norm_bytes, _ = _probe(norm, hidden, 1.0) if norm is not None else ({"fp32": 4.0, "bf16": 2.0}, False)
    act_bytes, act_out = _probe(act, intermediate, 1.0) if act is not None else ({"fp32": 4.0, "bf16": 2.0}, False)
    return ModelSpec(
        name=name or str(_first(config, "name_or_path", "_name_or_path", "model_type", default="model")),
        hidden=hidden,
        layers=int(_first(config, "num_hidden_layers", "n_layer", "n_layers", default=len(blocks))),
        heads=heads,
        kv_heads=int(_first(config, "num_key_value_heads", default=heads)),
        vocab=int(_first(config, "vocab_size", default=0)),
        intermediate=intermediate,
        params=count(params),
        trainable=count(params, True),
        block_params=block_params,
        block_trainable=block_trainable,
        root_params=count(root),
        root_trainable=count(root, True),
        largest_param=max((p.numel() for p in params if p.requires_grad), default=0),
        gated_mlp=bool(names & {"gate_proj", "gate_up_proj", "w3"}),
        hidden_dropout=float(
            _first(config, "hidden_dropout_prob", "resid_pdrop", "hidden_dropout", "dropout", default=0.0)
        ),
        attention_dropout=float(
            _first(config, "attention_probs_dropout_prob", "attn_pdrop", "attention_dropout", default=0.0)
        ),
        attn_implementation=str(getattr(config, "_attn_implementation", None) or "eager"),
        per_token_head=causal_lm or isinstance(getattr(model, "score", None), nn.Linear),
        lm_head=causal_lm,
        norm_bytes=norm_bytes,
        act_bytes=act_bytes,
        act_saves_output=act_out,
    )


def model_spec(
    model_dir: str,
    *,
    num_labels: int = 2,
    dropout: float | None = None,
    freeze_embeddings: bool = False,
    name: str | None = None,
) -> ModelSpec:
    """The spec of the classifier `load_classifier(model_dir, ...)` would build, without its weights."""
    from transformers.utils import logging as hf_logging

    from workflows.train.models import classifier_config

    hf_logging.set_verbosity_error()
    config = classifier_config(model_dir, [f"LABEL_{i}" for i in range(num_labels)], dropout)
    return spec_from_config(config, name=name or model_dir, freeze_embeddings=freeze_embeddings)


# ---------------------------------------------------------------------------------------- estimate
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


# -------------------------------------------------------------------------------------------- plan
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """'80GiB', '80GB' (10^9), '81920MiB', '1.5TiB', or a number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise UserError(f"invalid memory size {text!r}: use e.g. 80GiB, 40GB, 24576MiB or a number of bytes")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"invalid memory size {text!r}: must be positive")
    return value


def detected_device_memory() -> int | None:
    """Total memory of this machine's first CUDA device, if any."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # noqa: BLE001 - no usable CUDA: fall back to the stated assumption
        pass
    return None


@dataclass
class Plan:
    spec: ModelSpec
    device_memory: int
    device_memory_source: str
    devices: int
    seq_len: int
    micro_batch: int
    device_type: str
    attention: str
    checkpointing: bool
    precisions: dict[str, str]
    estimates: dict[str, Estimate]
    max_micro_batch: dict[str, int]
    recommended: str | None
    reason: str
    config_strategy: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def usable(self) -> int:
        return usable_bytes(self.device_memory)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": asdict(self.spec),
            "inputs": {
                "devices": self.devices,
                "seq_len": self.seq_len,
                "micro_batch": self.micro_batch,
                "device_type": self.device_type,
                "attention": self.attention,
                "activation_checkpointing": self.checkpointing,
                "precision": self.precisions,
                "device_memory": self.device_memory,
                "device_memory_source": self.device_memory_source,
            },
            "margin": {
                "fragmentation_fraction": FRAGMENTATION_MARGIN,
                "reserved_bytes": RESERVED_BYTES,
                "usable_bytes": self.usable,
            },
            "estimates": {
                k: {**e.to_dict(), "fits": e.total <= self.usable, "max_micro_batch": self.max_micro_batch[k]}
                for k, e in self.estimates.items()
            },
            "recommended": self.recommended,
            "reason": self.reason,
            "config_strategy": self.config_strategy,
            "notes": self.notes,
        }


def make_plan(
    spec: ModelSpec,
    *,
    devices: int,
    seq_len: int,
    micro_batch: int,
    device_memory: int,
    device_memory_source: str = "given",
    device_type: str = "cuda",
    precision: str = "auto",
    attention: str = "auto",
    checkpointing: bool = False,
    config_strategy: str | None = None,
    accumulation: bool = False,
) -> Plan:
    """Estimates for DDP and FSDP, the largest micro-batch of each, and the recommended strategy.

    precision 'auto' follows parallelize(): bf16 mixed precision for FSDP on CUDA, fp32 otherwise.
    attention 'auto': fused when planning for CUDA and the model uses SDPA/flash attention, else eager.
    """
    if precision not in ("auto", *PRECISIONS):
        raise UserError(f"unknown precision {precision!r}: use auto, {', '.join(PRECISIONS)}")
    if attention not in ("auto", *ATTENTIONS):
        raise UserError(f"unknown attention {attention!r}: use auto, {', '.join(ATTENTIONS)}")
    if precision == "auto":
        precisions = {"ddp": "fp32", "fsdp": "bf16" if device_type == "cuda" else "fp32"}
    else:
        precisions = {k: precision for k in STRATEGIES}
    if attention == "auto":
        attention = "fused" if device_type == "cuda" and spec.attn_implementation != "eager" else "eager"
    common = dict(device_type=device_type, attention=attention, checkpointing=checkpointing, accumulation=accumulation)
    estimates = {
        k: estimate(spec, k, devices, seq_len, micro_batch, precision=precisions[k], **common) for k in STRATEGIES
    }
    best_b = {
        k: max_micro_batch(spec, k, devices, seq_len, device_memory, precision=precisions[k], **common)
        for k in STRATEGIES
    }
    budget = usable_bytes(device_memory)
    gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
    if estimates["ddp"].total <= budget:
        recommended, reason = (
            "ddp",
            (
                f"DDP fits ({gib(estimates['ddp'].total)} of {gib(budget)} usable) and "
                "communicates less than FSDP (one all-reduce of the gradients per step)"
            ),
        )
    elif estimates["fsdp"].total <= budget:
        recommended, reason = (
            "fsdp",
            (
                f"DDP needs {gib(estimates['ddp'].total)} > {gib(budget)} usable; FSDP "
                f"shards the parameters, gradients and optimizer state over {devices} "
                f"device(s): {gib(estimates['fsdp'].total)}"
            ),
        )
    else:
        recommended = None
        tips = []
        if best_b["fsdp"]:
            tips.append(
                f"a micro-batch of {best_b['fsdp']} (train.batch_size; train.grad_accum_steps keeps the global batch)"
            )
        if not checkpointing:
            ck = estimate(
                spec,
                "fsdp",
                devices,
                seq_len,
                micro_batch,
                precision=precisions["fsdp"],
                device_type=device_type,
                attention=attention,
                checkpointing=True,
                accumulation=accumulation,
            )
            if ck.total <= budget:
                tips.append(f"activation checkpointing ({gib(ck.total)})")
        if precisions["fsdp"] == "fp32":
            tips.append("bf16 mixed precision")
        tips.append("more devices")
        reason = (
            f"neither fits at micro-batch {micro_batch}: FSDP needs {gib(estimates['fsdp'].total)} > "
            f"{gib(budget)} usable; try " + ", or ".join(tips)
        )
    notes = []
    if config_strategy and recommended and config_strategy != recommended:
        notes.append(f"the config trains with {config_strategy}; the plan recommends {recommended}")
    return Plan(
        spec,
        device_memory,
        device_memory_source,
        devices,
        seq_len,
        micro_batch,
        device_type,
        attention,
        checkpointing,
        precisions,
        estimates,
        best_b,
        recommended,
        reason,
        config_strategy,
        notes,
    )


def plan_from_config(
    cfg,
    *,
    device_memory: str | int | None = None,
    devices: int | None = None,
    seq_len: int | None = None,
    micro_batch: int | None = None,
    precision: str = "auto",
    attention: str = "auto",
    checkpointing: bool = False,
) -> Plan:
    """A plan for the model and settings of a WorkflowConfig (the arguments override them)."""
    from workflows.preprocess.encoding import resolve_model_dir

    model_cfg, train_cfg = cfg.model, cfg.train
    if getattr(model_cfg, "task", "classification") == "causal_lm":
        from transformers import AutoTokenizer

        from workflows.train.lm import causal_lm_config

        lm = model_cfg.lm
        vocab = len(AutoTokenizer.from_pretrained(resolve_model_dir(cfg.preprocess.tokenizer)))  # as the trainer
        # the trainer uses SDPA on GPUs, eager on CPU
        config = causal_lm_config(
            lm, vocab, getattr(model_cfg, "dropout", None), attn="sdpa" if train_cfg.use_gpu else "eager"
        )
        spec = spec_from_config(config, name=f"causal LM {lm.size} (GPT-2 style)", causal_lm=True)  # never frozen
        seq_len = seq_len or lm.seq_len
    else:
        name = getattr(model_cfg, "name_or_path", "minilm")
        spec = model_spec(
            resolve_model_dir(name),
            dropout=getattr(model_cfg, "dropout", None),
            freeze_embeddings=bool(getattr(train_cfg, "freeze_embeddings", False)),
            name=name,
        )
    if device_memory is None:
        found = detected_device_memory()
        mem, source = (
            (found, "detected (cuda:0)")
            if found
            else (
                parse_bytes(DEFAULT_DEVICE_MEMORY),
                f"assumed {DEFAULT_DEVICE_MEMORY} (no CUDA device here; set --device-memory)",
            )
        )
    else:
        mem, source = parse_bytes(device_memory), "given"
    seq = seq_len or getattr(model_cfg, "max_length", None) or cfg.preprocess.max_length
    return make_plan(
        spec,
        devices=devices or train_cfg.num_workers,
        seq_len=seq,
        micro_batch=micro_batch or train_cfg.batch_size,
        device_memory=mem,
        device_memory_source=source,
        device_type="cuda" if train_cfg.use_gpu else "cpu",
        precision=precision,
        attention=attention,
        config_strategy=train_cfg.strategy,
        checkpointing=checkpointing or bool(getattr(train_cfg, "activation_checkpointing", False)),
        accumulation=getattr(train_cfg, "grad_accum_steps", 1) > 1,
    )


def format_plan(plan: Plan) -> str:
    """The plan as aligned plain text."""
    sp = plan.spec
    g = lambda n: f"{n / GiB:.3f}"  # noqa: E731
    m = lambda n: f"{n / 1e6:.1f}M"  # noqa: E731
    lines = [
        f"model      {sp.name}: {m(sp.params)} params ({m(sp.trainable)} trainable), h={sp.hidden} L={sp.layers} "
        f"a={sp.heads} V={sp.vocab} i={sp.intermediate}; largest block {m(sp.block_params)}, "
        f"outside blocks {m(sp.root_params)}",
        f"setup      {plan.devices} device(s) ({plan.device_type}), seq_len {plan.seq_len}, "
        f"micro-batch {plan.micro_batch} "
        f"per device, attention {plan.attention}, activation checkpointing {'on' if plan.checkpointing else 'off'}, "
        f"gradient accumulation {'on' if plan.estimates['ddp'].accumulation else 'off'}",
        f"memory     {g(plan.device_memory)} GiB per device, {plan.device_memory_source}; usable {g(plan.usable)} GiB "
        f"after the safety margin ({FRAGMENTATION_MARGIN:.0%} fragmentation/overhead "
        f"+ {RESERVED_BYTES / GiB:.0f} GiB reserved)",
        "",
    ]
    header = [
        "GiB/device",
        "precision",
        "model",
        "grads",
        "optimizer",
        "activations",
        "buffers",
        "step temp",
        "peak",
        "sum",
        "fits",
        "max micro-batch",
    ]
    rows = [header]
    for k, e in plan.estimates.items():
        rows.append(
            [
                k,
                e.precision,
                g(e.model),
                g(e.gradients),
                g(e.optimizer),
                g(e.activations),
                g(e.buffers),
                g(e.temporaries),
                g(e.total),
                g(e.upper_bound),
                "yes" if e.total <= plan.usable else "NO",
                str(plan.max_micro_batch[k]),
            ]
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for r in rows:
        lines.append("  ".join(v.ljust(w) if c < 2 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths))).rstrip())
    lines += ["", f"recommended: {plan.recommended or 'none fits'} — {plan.reason}"]
    lines += [f"note: {n}" for n in plan.notes]
    lines.append(
        "peak = params + optimizer state + the largest of (activations + forward buffers | gradients + "
        "step temporaries | gradients + end-of-backward buffers); sum = every column at once. "
        "Formulas and assumptions: workflows/train/planner.py"
    )
    return "\n".join(lines)

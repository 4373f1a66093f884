"""What the memory estimate knows about a model: parameter counts from the real model class built on the
meta device, the architecture from its Hugging Face config, and the bytes its norm and activation layers
save for backward, probed on small real tensors (see workflows/train/memory_estimate.py, the planner's reader of it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from workflows.parallel import transformer_blocks


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
    # what was assumed instead of probed, one line each (a layer not found, a probe that failed)
    estimated: tuple[str, ...] = ()


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


def saved_storages(params, forward) -> tuple[dict[int, int], Any]:
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


_ELEMENT_BYTES = {"fp32": 4, "bf16": 2}  # the assumption where nothing was measured: the layer saves its input


def _assumed(precisions) -> str:
    return "assumed it saves its input only: " + ", ".join(f"{_ELEMENT_BYTES[p]} bytes per element in {p}"
                                                           for p in precisions)


def _probe(module: nn.Module, width: int) -> tuple[dict, bool, dict[str, str]]:
    """Bytes autograd saves per input element when `module` runs (fp32 and bf16), whether its
    output is among them, and the precisions whose probe failed (-> the error; their bytes are
    assumed: the input only). Runs a copy of the module on a (2, 3, width) CPU tensor: microseconds."""
    import copy

    import torch

    out_saved, result, failed = False, {}, {}
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
        except Exception as e:  # noqa: BLE001 - an unusual module: assume it saves its input only
            result[precision] = float(_ELEMENT_BYTES[precision])
            failed[precision] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]
    return result, out_saved, failed


def _measured(module: nn.Module | None, width: int, what: str, estimated: list[str]) -> tuple[dict, bool]:
    """`_probe` of the block's `what` layer; each thing assumed instead of measured goes to `estimated`."""
    if module is None:
        estimated.append(f"{what}: none found in the first transformer block; {_assumed(_DTYPES)}")
        return {p: float(n) for p, n in _ELEMENT_BYTES.items()}, False
    result, out_saved, failed = _probe(module, width)
    if failed:
        errors = set(failed.values())
        why = errors.pop() if len(errors) == 1 else "; ".join(f"{p}: {e}" for p, e in failed.items())
        which = "the probe" if len(failed) == len(_DTYPES) else f"the {'/'.join(failed)} probe"
        estimated.append(f"{what} {type(module).__name__}: {which} failed ({why}); {_assumed(failed)}")
    return result, out_saved


def _find(block: nn.Module | None, pred) -> nn.Module | None:
    return next((m for m in block.modules() if pred(m)), None) if block is not None else None


def spec_from_config(config, *, name: str | None = None, freeze_embeddings: bool = False,
                     causal_lm: bool = False) -> ModelSpec:
    """A ModelSpec from a transformers config: the model is built on the meta device (no memory).
    causal_lm: the language model with its LM head (pretraining), not a sequence classifier."""
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
    estimated: list[str] = []
    norm_bytes, _ = _measured(norm, hidden, "norm layer", estimated)
    act_bytes, act_out = _measured(act, intermediate, "MLP activation", estimated)
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
        estimated=tuple(estimated),
    )

"""train.compile: torch.compile applied to a plain model, as torchtitan applies it, before sharding.

A transformer's repeated blocks are compiled each on its own (regional compilation): the blocks are
one class with the same parameter shapes, so with dynamo's inlining of nn.Modules (the default)
their parameters are graph inputs and one compiled graph serves all of them; compile time does
not grow with depth, and FSDP2's hooks on each block stay outside the graph. A model without such
blocks (a CNN, whose stages differ in shape) is compiled whole. Modules are compiled in place
(`nn.Module.compile`), so state dicts, checkpoints and exports keep their keys.

Only training runs compiled: validation, generation and the stand-in steps of a stream (shapes of
their own, eval mode) run eagerly (`eager`), so a training run compiles once per region, never
again for them. Training batches keep the compiled shape: `fixed_rows` pads a short batch (the
last of an epoch) with rows whose labels the loss ignores, and splits a longer one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from workflows.parallel import transformer_blocks


def compile_regions(model: nn.Module) -> list[nn.Module]:
    """The modules `compile_model` compiles: the repeated transformer blocks when there are several
    with identical parameter shapes (one graph for all), else the whole model."""
    blocks = transformer_blocks(model)
    shapes = {tuple((n, tuple(p.shape)) for n, p in b.named_parameters()) for b in blocks}
    return blocks if len(blocks) > 1 and len(shapes) == 1 else [model]


def compile_model(model: nn.Module, backend: str = "inductor") -> list[nn.Module]:
    """Compile `model`'s regions in place (before FSDP2/DDP wrap it); returns them. A language model's
    loss is compiled too (a Hugging Face model with an output head, `lm_head`, peft's inside its
    wrapper): over a vocabulary-wide head, the eager loss upcasts all logits to fp32 and makes
    log-softmax and NLL separate passes; compiled, they are one fused pass that keeps no fp32 copy."""
    regions = compile_regions(model)
    for region in regions:
        region.compile(backend=backend)
    for module in model.modules():  # the model that owns the head (not a wrapper that forwards attributes)
        if "lm_head" in module._modules and callable(getattr(module, "loss_function", None)):
            module.loss_function = torch.compile(module.loss_function, backend=backend)
    return regions


def eager() -> contextlib.AbstractContextManager:
    """Compiled modules run their eager code inside (validation, generation, stand-in steps)."""
    return torch.compiler.set_stance("force_eager")


def batch_rows(batch: dict) -> int:
    return int(batch["labels"].shape[0])


def fixed_rows(batch: dict, size: int, pad_label: int) -> Iterator[tuple[dict, int]]:
    """`batch` as pieces of exactly `size` rows, each with the number of its real rows: a longer
    batch split (its pieces go into the same optimizer step), a short one padded by repeating its
    rows with `pad_label` labels (the loss ignores them; label counts, samples and tokens count the
    real rows only). Real-valued labels cannot be ignored: such a batch goes through as it is."""
    n = batch_rows(batch)
    if n == size or batch["labels"].is_floating_point():
        yield batch, n
        return
    for lo in range(0, n, size):
        piece = {k: v[lo: lo + size] for k, v in batch.items()}
        real = min(size, n - lo)
        if real < size:
            idx = torch.arange(size, device=batch["labels"].device) % real
            piece = {k: same_format(v.index_select(0, idx), v) for k, v in piece.items()}
            piece["labels"][real:] = pad_label
        yield piece, real


def same_format(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` in `like`'s memory format (index_select makes a contiguous copy of channels_last images,
    whose strides a compiled graph guards on)."""
    if like.dim() == 4 and not like.is_contiguous() and like.is_contiguous(memory_format=torch.channels_last):
        return t.contiguous(memory_format=torch.channels_last)
    return t

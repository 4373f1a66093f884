"""Linear layers with their weights pre-packed for oneDNN, for decoding in fp32 on a CPU.

Why: PyTorch's CPU linear hands each call to MKL's sgemm, which re-lays the weight out for its kernel at
every call; at a decode step's shapes (a row per request, 1 to 32) that is a large share of it. Packed once
in oneDNN's blocked layout the same matmuls run faster: `python -m benchmarks.generate` runs static
batching on both (rows `static` and `static_packed`, docs/BENCHMARKS.md). bf16 weights ran slower packed
(measured in process on the same machine), so only fp32 weights are packed. PyTorch has no public module
for it: its compiler packs the same way when it freezes a graph (torch._inductor's mkldnn fusion passes)
and vLLM's CPU backend packs its linears with oneDNN too; here the modules stay eager (a step's token
count and cache lengths change every step), so the same oneDNN ops are called directly.

The original weight stays where it is (the output head shares it with the embedding; peft's adapters
and `generate` read it): packing holds the layers' weights a second time. A packed layer computes
with its packed copy only while that copy is current: with gradients on, another dtype or device, or a
weight changed (in place or replaced) since, it is an ordinary nn.Linear again.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# up to this many rows (a step's tokens) a packed layer computes with the weight itself (MKL's matrix-vector
# path): none, since oneDNN's packed kernel reads the weight faster at every row count, a lone stream's too
# (a step both ways: benchmarks/step_profile.py, docs/BENCHMARKS.md "The engine's step, profiled")
UNPACKED_ROWS = 0


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(torch.nn.Linear):
    """An nn.Linear (its class swapped in place: isinstance and peft's wrapping still see a Linear) that
    computes with `_packed`, its weight in oneDNN's layout, while that is current."""

    _packed: tuple[torch.Tensor, tuple] | None = None  # (the weight packed, what it was packed from: `source`)

    def __getstate__(self):
        """A copy or a pickle leaves the packed weight out (oneDNN's opaque tensor has no storage to copy):
        it computes with its weight until packed again."""
        state = dict(super().__getstate__())
        state.pop("_packed", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, packed = self.weight, self._packed
        if (packed is None or packed[1] != source(w) or x.dtype != w.dtype or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return F.linear(x, w, self.bias)
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] <= UNPACKED_ROWS:
            return F.linear(x, w, self.bias)
        y = torch.ops.mkldnn._linear_pointwise(rows, packed[0], self.bias, "none", [], "")
        return y.view(*shape[:-1], y.shape[-1])


def source(w: torch.Tensor) -> tuple:
    """What identifies a weight's values: its storage (`.data` replaced, as `to(dtype)` does, changes it),
    its version (bumped by every in-place change), dtype, shape and device."""
    return w.data_ptr(), w._version, w.dtype, w.shape, w.device


def pack_linears(model: torch.nn.Module) -> int:
    """Pack every fp32 CPU nn.Linear of `model` (again where its weight changed since); returns the bytes
    the packed copies hold (0 where nothing could be packed)."""
    if not packing_available():
        return 0
    held = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        w = module.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            continue
        if type(module) is torch.nn.Linear:
            module.__class__ = PackedLinear
        elif not isinstance(module, PackedLinear):  # a subclass with its own forward: leave it
            continue
        current = module._packed
        if current is None or current[1] != source(w):
            with torch.no_grad():
                module._packed = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), None), source(w))
        held += w.numel() * w.element_size()
    if held:
        log.info("fp32 linear weights packed for oneDNN: %.0f MB held a second time", held / 1e6)
    return held

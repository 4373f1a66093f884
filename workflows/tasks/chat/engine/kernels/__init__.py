"""The engine's own C++ kernel: decode attention over the slot cache (decode_attention.cpp), built once per
machine with torch's C++ extension builder and loaded as `torch.ops.workflows_kernels.decode_attention`.

Why by hand: a decode token's attention reads its row's keys and values once each, a few query heads per
key/value head (3 of SmolLM2's 9), so it is bound by reading the cache. torch's CPU operators for it (two
batched matmuls and a softmax, SDPA with GQA, einsum, flex_attention compiled: none was faster at these
shapes) run each small product as a call of its own and read every row up to the longest row's length,
masked. The kernel reads each row to its own length, once, its query heads together (ATen's vector types and
Sleef's exp), and takes work items longest first across the step's threads; what it gains:
docs/BENCHMARKS.md, "The engine's decode attention" (`python -m benchmarks.decode_attention`).

Built where the engine runs on a CPU in fp32 (`decode_attention_kernel`): the compiler inductor already
needs for the compiled forward, flags for the CPU's vector width (torch's own reading of it, so a cache of
builds shared by machines of another width is not loaded on them); cached by torch in TORCH_EXTENSIONS_DIR
(default ~/.cache/torch_extensions), so a replica after the first on a machine loads it in a moment. Where it
cannot be built (no compiler) the engine says so in its log and attends with torch's operators.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
KERNELS = ("auto", "kernel", "torch")  # serve.generate.attention_kernel
# torch's own flags and defines for the vector width it runs at (ATen's Vectorized picks its code by them)
_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
                     "-DCPU_CAPABILITY_AVX512"],
          "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]}


@functools.lru_cache(maxsize=1)
def _load() -> str | None:
    """Build (or load the cached build of) the kernel, once a process: None once it is registered, else why not."""
    try:
        from torch.utils.cpp_extension import load

        width = torch.backends.cpu.get_cpu_capability()
        load(name=f"workflows_decode_attention_{width.lower()}",
             sources=[str(SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-fopenmp", *_FLAGS.get(width, [])], extra_ldflags=["-fopenmp"], verbose=False)
        return None
    except Exception as e:  # no compiler, no ninja, a build error: torch's operators instead
        # the compiler's or the shell's own line ("error:", "not found"), not the command or ninja's summary
        lines = [ln.strip() for ln in str(e).strip().splitlines()] or [""]
        said = next((ln for ln in lines if "error:" in ln or ln.endswith("not found")), lines[-1])
        return f"{type(e).__name__}: {said[:300]}"


def decode_attention_kernel(choice: str, device: torch.device, dtype: torch.dtype):
    """The kernel `choice` asks for (serve.generate.attention_kernel): "torch", none (torch's operators);
    "kernel", the kernel or a clear error; "auto", the kernel where it applies (fp32 on a CPU), else none, and
    where it applies but cannot be built, none, said in the log."""
    if choice not in KERNELS:
        raise ValueError(f"attention_kernel {choice!r}: one of {', '.join(KERNELS)}")
    if choice == "torch":
        return None
    if device.type != "cpu" or dtype != torch.float32:  # not what the kernel computes: no build, no warning
        if choice == "kernel":
            raise RuntimeError(f"serve.generate.attention_kernel=kernel: {dtype} on {device.type} (the kernel: fp32 "
                               "on a CPU); set it to auto or torch")
        return None
    why = _load()
    if why is None:
        return torch.ops.workflows_kernels.decode_attention
    if choice == "kernel":
        raise RuntimeError(f"serve.generate.attention_kernel=kernel: {why}; set it to auto or torch")
    log.warning("the engine's decode attention runs on torch's operators: the kernel could not be built (%s)", why)
    return None

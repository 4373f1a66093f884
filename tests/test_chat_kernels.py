"""The engine's decode attention kernel (workflows.tasks.chat.engine.kernels): what softmax attention over
each row's own positions gives, at head sizes its vector path takes and one it does not; the engine's attention
of a step with it equals torch's operators'; bad input and bad settings get clear errors."""

from __future__ import annotations

import types

import pytest
import torch

from workflows.tasks.chat.engine.cache import SlotCache, attend
from workflows.tasks.chat.engine.kernels import decode_attention_kernel

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel():
    return decode_attention_kernel("kernel", CPU, torch.float32)


def reference(q, keys, values, slots, lengths, scale):
    """Softmax attention in float64, each token over its own slot's first `length` positions."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
        k, v = keys[slot, :, :length].double(), values[slot, :, :length].double()  # [heads, length, dim]
        weights = torch.softmax(q[i].double() @ k.transpose(-1, -2) * scale, -1)  # [heads, group, length]
        out[i] = weights @ v
    return out


@pytest.mark.parametrize("dim,group", [(64, 3), (128, 4), (32, 1), (48, 2)])
def test_the_kernel_is_softmax_attention_over_each_rows_own_length(kernel, dim, group):
    g = torch.Generator().manual_seed(dim + group)
    slots_n, heads, capacity = 6, 2, 40
    keys = torch.randn(slots_n, heads, capacity, dim, generator=g)
    values = torch.randn(slots_n, heads, capacity, dim, generator=g)
    q = torch.randn(5, heads, group, dim, generator=g) * 3  # large scores: the softmax's max subtraction matters
    slots = torch.tensor([4, 0, 2, 4, 5])  # any order, a slot twice
    lengths = torch.tensor([1, 40, 17, 9, 33])  # one position, the whole capacity, and between
    got = kernel(q, keys, values, slots, lengths, dim ** -0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(q, keys, values, slots, lengths, dim ** -0.5),
                               rtol=1e-5, atol=1e-5)
    # positions past a row's length are not read: changing them changes nothing
    keys[:, :, 33:] = float("nan")
    values[:, :, 33:] = float("nan")
    short = lengths.clamp(max=33)
    torch.testing.assert_close(kernel(q, keys, values, slots, short, dim ** -0.5).double(),
                               reference(q, keys, values, slots, short, dim ** -0.5), rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_a_length_or_slot_outside_the_cache(kernel):
    keys = torch.zeros(2, 1, 8, 16)
    q = torch.zeros(1, 1, 1, 16)
    for slots, lengths in (([0], [0]), ([0], [9]), ([2], [3]), ([-1], [3])):
        with pytest.raises(RuntimeError, match="out of the cache"):
            kernel(q, keys, keys, torch.tensor(slots), torch.tensor(lengths), 1.0)
    with pytest.raises(RuntimeError, match="fp32 only"):
        kernel(q.double(), keys.double(), keys.double(), torch.tensor([0]), torch.tensor([3]), 1.0)


def test_a_steps_attention_with_the_kernel_equals_torchs_operators(kernel):
    """Decode rows of lengths 1 to 90 (one long enough to attend alone on torch's path) in a step beside a
    prefill chunk: the attention's outputs agree, and so do the caches it wrote."""
    config = types.SimpleNamespace(num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                                   hidden_size=192)
    g = torch.Generator().manual_seed(0)
    caches = []
    for choice in ("kernel", "torch"):
        cache = SlotCache(config, 6, 256, CPU, torch.float32, attention_kernel=choice)
        assert (cache.kernel is kernel) == (choice == "kernel")
        cache.reserve(128)
        cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=torch.Generator().manual_seed(1)))
        cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=torch.Generator().manual_seed(2)))
        caches.append(cache)
    # tokens 0-3 decode (slots 3, 0, 5, 1 at positions 0, 89, 6, 11), tokens 4-6 are slot 2's chunk at 20-22
    slots, positions = [3, 0, 5, 1, 2, 2, 2], [0, 89, 6, 11, 20, 21, 22]
    query = torch.randn(7, 6, 1, 32, generator=g)
    key, value = torch.randn(7, 2, 1, 32, generator=g), torch.randn(7, 2, 1, 32, generator=g)
    outs = []
    for cache in caches:
        plan = cache.plan(slots, positions, [0, 1, 2, 3], [(4, 3)])
        assert (plan.kernel_lengths is not None) == (cache.kernel is not None)
        outs.append(attend(plan, 0, query, key, value, None))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0].keys[0], caches[1].keys[0]) and torch.equal(caches[0].values[0], caches[1].values[0])
    # every token decoding (the step's whole output from the kernel)
    decode_only = [cache.plan(slots[:4], positions[:4], [0, 1, 2, 3], []) for cache in caches]
    outs = [attend(p, 0, query[:4], key[:4], value[:4], 0.3) for p in decode_only]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_the_setting_chooses_the_kernel_or_torchs_operators():
    assert decode_attention_kernel("torch", CPU, torch.float32) is None
    assert decode_attention_kernel("auto", CPU, torch.float32) is not None
    assert decode_attention_kernel("auto", CPU, torch.bfloat16) is None  # fp32 only: torch's operators
    with pytest.raises(RuntimeError, match="attention_kernel=kernel: torch.bfloat16"):
        decode_attention_kernel("kernel", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="attention_kernel 'fast'"):
        decode_attention_kernel("fast", CPU, torch.float32)


def test_without_a_compiler_auto_falls_back_to_torchs_operators_and_kernel_says_why(tmp_path):
    """A machine where the kernel cannot be built (its compiler missing, a fresh build folder): auto attends with
    torch's operators and says so in the log; kernel is an error naming the setting."""
    import os
    import subprocess
    import sys

    script = ("import logging, torch\n"
              "logging.basicConfig(level=logging.WARNING)\n"
              "from workflows.tasks.chat.engine.kernels import decode_attention_kernel\n"
              "assert decode_attention_kernel('auto', torch.device('cpu'), torch.float32) is None\n"
              "try:\n"
              "    decode_attention_kernel('kernel', torch.device('cpu'), torch.float32)\n"
              "except RuntimeError as e:\n"
              "    print('refused:', e)\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "decode attention runs on torch's operators: the kernel could not be built" in done.stderr
    assert "refused: serve.generate.attention_kernel=kernel:" in done.stdout and "no-compiler: not found" in done.stdout


def test_the_benchmark_times_both_kinds_on_the_same_step_and_they_agree():
    """benchmarks/decode_attention.py at a short context: every step timed for both kinds, their outputs equal."""
    from benchmarks.decode_attention import STEPS, measure

    got = measure(12, 1)
    assert len(got["ms_runs"]["kernel"]) == len(got["ms_runs"]["torch"]) == STEPS
    assert got["max_abs_diff"] < 1e-4 and got["speedup"] > 0 and got["layers"] == 30

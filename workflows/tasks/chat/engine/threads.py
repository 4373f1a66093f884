"""The engine's steps run in its own thread, so the OpenMP threads that compute them must be that
thread's alone.

PyTorch's CPU build parallelizes with GNU OpenMP (libgomp), which keeps a pool of worker threads per
thread that ever ran a parallel region. The thread that loaded and packed the model (the replica's, a
command's) keeps its pool once the engine's thread has one of its own; with more pool threads than
cores, libgomp makes every idle worker stop spinning after about a thousand turns (its "throttled" spin,
whatever OMP_WAIT_POLICY or GOMP_SPINCOUNT say), so each of a step's ~200 short matmuls waits for its
workers to wake (benchmarks/openmp_pool.py measures a stream's token gap with the pool kept and
released: docs/BENCHMARKS.md, "The engine's thread and OpenMP"). `release_openmp_pool` releases the calling
thread's pool (OpenMP 5's `omp_pause_resource_all`; torch has no call for it): the engine calls it
where it is built, before its own thread starts, once the model is loaded and packed.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_hard: the pool's threads end; the next parallel region in this thread starts new ones


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch computes with: the libgomp its wheel ships (already loaded: dlopen of
    the same path returns that library), or None where it ships another (macOS: libomp)."""
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if not os.path.exists(path):
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def release_openmp_pool() -> bool:
    """Release the calling thread's OpenMP worker threads; whether the runtime did."""
    runtime = _openmp_runtime()
    pause = getattr(runtime, "omp_pause_resource_all", None)
    if pause is None:
        log.debug("no libgomp with omp_pause_resource_all: the OpenMP pool is left as it is")
        return False
    return pause(OMP_PAUSE_HARD) == 0

"""The engine's steps have the OpenMP threads to themselves (workflows.tasks.chat.engine.threads): the
thread that builds an engine (and loaded its model) gives its OpenMP worker threads back first, so
libgomp does not throttle the decode thread's workers for holding more threads than cores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import os, sys, tempfile, torch
    from tests.chat_serve_task import build_tiny_chat
    from workflows.tasks.chat.engine import Engine

    def tasks():
        return set(os.listdir("/proc/self/task"))

    model, tokenizer = build_tiny_chat(tempfile.mkdtemp())
    before = tasks()
    x = torch.randn(1500, 1500)
    (x @ x).exp()  # parallel regions in this thread: its OpenMP pool starts worker threads
    workers = tasks() - before
    engine = Engine(model, tokenizer, max_batch=2)
    try:
        print(len(workers), len(workers & tasks()))
    finally:
        engine.close()
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
                    reason="libgomp's worker threads, seen in /proc: Linux with 2 cores or more")
def test_building_an_engine_releases_the_building_threads_openmp_workers():
    from workflows.tasks.chat.engine.threads import _openmp_runtime

    if getattr(_openmp_runtime(), "omp_pause_resource_all", None) is None:
        pytest.skip("this torch computes with another OpenMP runtime than libgomp")
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    started, left = map(int, out.stdout.split()[-2:])
    assert started >= 1, "the parallel regions started no OpenMP worker thread"
    assert left == 0, f"{left} of the building thread's {started} OpenMP workers outlived the engine's start"

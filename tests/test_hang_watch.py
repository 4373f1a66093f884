"""tests/hang_watch.py, the gate's guard against a hung test, in a pytest of its own with a 2 s limit:
the hung test fails with its stacks written and printed, the tests after it still run, and a main
thread that swallows the exception makes the process exit instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, list[Path]]:
    (tmp_path / "test_slow.py").write_text(body)
    hangs = tmp_path / "hangs"
    hangs.mkdir()
    env = {**os.environ, "WORKFLOWS_TEST_HANG_SECONDS": "2", "WORKFLOWS_TEST_HANG_GRACE_SECONDS": "3",
           "WORKFLOWS_TEST_HANG_DIR": str(hangs), "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.hang_watch", "-p", "no:cacheprovider",
                          "-q", str(tmp_path / "test_slow.py")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    return out, sorted(hangs.glob("*.txt"))


def test_a_hung_test_fails_with_its_stacks_and_the_next_test_runs(tmp_path):
    out, dumps = run_pytest(tmp_path, """
import time

def wait_for_ever():
    while True:
        time.sleep(0.5)

def test_hangs():
    wait_for_ever()

def test_after():
    pass
""")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 1 passed" in out.stdout
    assert "PhaseHung" in out.stdout and "test_hangs (call) ran past 2 s" in out.stdout
    (dump,) = dumps
    text = dump.read_text()
    assert text.startswith("test_slow.py::test_hangs (call) still running after 2 s")
    assert 'in wait_for_ever' in text  # the main thread's Python stack
    assert f"hung: {dump.name}" in out.stdout and "wait_for_ever" in out.stdout  # printed in the summary


def test_a_run_without_a_hang_leaves_no_folder(tmp_path):
    out, dumps = run_pytest(tmp_path, "def test_quick():\n    pass\n")
    assert out.returncode == 0 and not dumps and not (tmp_path / "hangs").exists(), out.stdout


def test_a_main_thread_that_swallows_the_exception_ends_the_process(tmp_path):
    out, dumps = run_pytest(tmp_path, """
import time

def test_swallows():
    while True:
        try:
            time.sleep(0.5)
        except BaseException:
            pass
""")
    assert out.returncode == 70, out.stdout + out.stderr
    (dump,) = dumps
    assert "did not take the exception within" in dump.read_text()

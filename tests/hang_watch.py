"""A test phase (setup, call, teardown) that runs past HANG_SECONDS is taken as hung: every thread's
stack (Python's, and native frames through py-spy where it can attach) is written to a file, the
test fails there with an exception raised in its main thread, and the run goes on. If the main
thread does not take the exception within GRACE_SECONDS (a wait inside C++ that checks no signals, as
in Ray's GlobalStateAccessor), the worker process exits, which ends the run (the Makefile's
--max-worker-restart=0). The run's terminal summary prints every dump.

Without it a hang anywhere in `make test` stops the whole run until CI's time limit, with no test
named and no stack to read (seen: Ray Train fits in a long-lived test process that never return).
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

HANG_SECONDS = float(os.environ.get("WORKFLOWS_TEST_HANG_SECONDS", "900"))  # the longest phase takes ~300 s
GRACE_SECONDS = float(os.environ.get("WORKFLOWS_TEST_HANG_GRACE_SECONDS", "60"))
DIR_ENV = "WORKFLOWS_TEST_HANG_DIR"  # set by the main process, inherited by xdist's workers


class PhaseHung(Exception):
    """A test phase ran past HANG_SECONDS; its threads' stacks are in the file named."""


def _raise_hung(signum, frame):
    raise PhaseHung(_Watch.message or "hung")


class _Watch:
    message = ""

    def __init__(self, nodeid: str, phase: str):
        self.nodeid, self.phase, self.done = nodeid, phase, threading.Event()
        self.thread = threading.Thread(target=self._run, name="hang-watch", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.done.set()

    def _run(self) -> None:
        if self.done.wait(HANG_SECONDS):
            return
        path = Path(os.environ[DIR_ENV]) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{time.time():.0f}.txt"
        with open(path, "w") as f:
            f.write(f"{self.nodeid} ({self.phase}) still running after {HANG_SECONDS:.0f} s, pid {os.getpid()}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.flush()
            spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
            if Path(spy).exists():
                try:
                    out = subprocess.run([spy, "dump", "--native", "--pid", str(os.getpid())],
                                         capture_output=True, text=True, timeout=60)
                    f.write(f"\npy-spy dump --native:\n{out.stdout}{out.stderr}")
                except (OSError, subprocess.TimeoutExpired) as e:
                    f.write(f"\npy-spy dump failed: {e}\n")
        _Watch.message = f"{self.nodeid} ({self.phase}) ran past {HANG_SECONDS:.0f} s; threads' stacks in {path}"
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
        if not self.done.wait(GRACE_SECONDS):
            with open(path, "a") as f:
                f.write(f"\nthe main thread did not take the exception within {GRACE_SECONDS:.0f} s: worker exits\n")
            os._exit(70)


def pytest_configure(config):
    if DIR_ENV not in os.environ:  # the main process (xdist's workers inherit it)
        os.environ[DIR_ENV] = tempfile.mkdtemp(prefix="workflows-test-hangs-")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR2, _raise_hung)


def _watched(item, phase: str):
    watch = _Watch(item.nodeid, phase)
    try:
        yield
    finally:
        watch.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _watched(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _watched(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _watched(item, "teardown")


def pytest_unconfigure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        try:
            os.rmdir(os.environ.get(DIR_ENV, ""))  # only when empty: a dump stays to be read
        except OSError:
            pass


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for path in sorted(Path(os.environ.get(DIR_ENV, "/nonexistent")).glob("*.txt")):
        terminalreporter.section(f"hung: {path.name}")
        terminalreporter.write(path.read_text())

"""SIGTERM and SIGINT stop a command cleanly: the signal becomes an exception in the main thread,
so the command's own `finally`s (Serve drained and shut down, Ray shut down, the embedded store
persisted) run, one line is printed, and the process exits 143 (SIGTERM) or 130 (SIGINT;
`workflows serve` exits 0, Ctrl-C being how it is meant to stop) instead of dying mid-call.

`ray.init()` installs its own SIGTERM handler (`sys.exit(15)`, raised wherever the main thread
is, which can leave Ray's core to abort at exit), so the handlers are installed again after it.

Python runs a signal's handler wherever the main thread is, a `__del__` or a weakref callback included
(Ray Data's iterators shut their executor down in `__del__`); an exception raised there is only printed
(sys.unraisablehook) and the command would run on. A Stopped lost that way is raised again: the
signal is sent once more, from a thread, once the hook has returned.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


class Stopped(KeyboardInterrupt):
    """The command was asked to stop by a signal (a KeyboardInterrupt: code that handles Ctrl-C handles it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum, frame):
    # Later signals are ignored while the command stops: a second Ctrl-C would otherwise raise
    # inside Serve's or Ray's shutdown and leave a stack dump and half-stopped processes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Stopped(signum)


def _resend(signum: int) -> None:
    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    # from a thread: the main thread is still inside the hook, where a handler's exception is lost again
    threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()


def _unraisable(unraisable) -> None:
    if isinstance(unraisable.exc_value, Stopped):
        _resend(unraisable.exc_value.signum)
    else:
        _default_unraisable(unraisable)


_default_unraisable = sys.unraisablehook


def install() -> None:
    """Route SIGTERM and SIGINT to `Stopped` (main thread only: Python delivers signals there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _handler)
        signal.signal(signal.SIGINT, _handler)
        sys.unraisablehook = _unraisable


def exit_code(e: KeyboardInterrupt) -> int:
    return e.exit_code if isinstance(e, Stopped) else 130


def signal_name(e: KeyboardInterrupt) -> str:
    return e.name if isinstance(e, Stopped) else "SIGINT"

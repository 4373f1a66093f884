"""The terminal a person reads, and the log file that takes everything else.

A command that starts Ray points file descriptors 1 and 2 at a log file (`capture`). Redirecting at
the descriptor level is needed because most of what Ray prints never passes through anything
Python's logging configuration reaches: its C++ core (glog) writes to fd 2, its log monitor writes
the output of every worker and actor to the driver's stdout/stderr, tqdm bars and warnings write to
sys.stderr, and each library installs its own handlers. What the platform prints on purpose (`say`,
`warn`, `show`, `echo`) goes to duplicates of the original descriptors.

The descriptors stay redirected until the process exits: Ray keeps writing after a command's body
returns (late worker lines, its shutdown at exit). A `Relay` thread follows the log file and puts on
the terminal what a person must see from it: `say` lines printed inside Ray workers and actors
(forwarded to the driver by Ray), and a few warnings of Ray's, each once.
"""

from __future__ import annotations

import codecs
import os
import re
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.text import Text

# stderr of the terminal: sys.stderr until `capture` points it at a duplicate of the original fd 2
console = Console(stderr=True, highlight=False, soft_wrap=True)
_out: TextIO | None = None  # the terminal's stdout once captured
_err: TextIO | None = None
_log: CommandLog | None = None


def _emit(text: Text, to_log: bool = True) -> None:
    console.print(text)
    if to_log and _log is not None:  # the log file keeps the platform's lines too, for context around Ray's
        print(text.plain, file=sys.stderr, flush=True)


def _line(head: str, style: str, msg: str) -> Text:
    return Text.assemble((head, style), " ", msg)


def say(msg: str) -> None:
    """Progress for a person watching the terminal (from a Ray worker too: see `Relay`)."""
    if _log is not None:
        _log.relay.poll()  # what workers said before this line comes before it
    _emit(_line("workflows", "bold cyan", msg))


def warn(msg: str) -> None:
    """A warning that changes what the user should do or expect."""
    if _log is not None:
        _log.relay.poll()
    _emit(_line("workflows warning:", "bold yellow", msg))


def show(text: str) -> None:
    """A result printed on purpose to stdout (a table, a report), not into the log file."""
    print(text, file=_out or sys.stdout, flush=True)


def echo(msg: str) -> None:
    """A plain line on the terminal's stderr (`error: ...`: scripts and tests read it as is)."""
    print(msg, file=_err or sys.stderr, flush=True)
    if _log is not None:
        print(msg, file=sys.stderr, flush=True)


def active_log() -> CommandLog | None:
    return _log


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Ray's prefix of a forwarded line: "(pid=12)", "(MapWorker(MapBatches(f)) pid=12, ip=10.0.0.2)",
# "(autoscaler +18s)"
_RAY_PREFIX = re.compile(r"^\((?:.*?pid=\d+(?:, ip=[^)]*)?|autoscaler [^)]*)\)\s?")
_REPEATED = re.compile(r"\[repeated \d+x across cluster\]")
SAID_IN_WORKER = re.compile(r"^workflows (?:warning: )?")

# Ray's lines that a person must see on the terminal (once each): (pattern, what to print instead;
# None: Ray's line as is)
RAY_WARNINGS: list[tuple[re.Pattern, str | None]] = [
    (re.compile(r"Token authentication is enabled"),
     "Ray token authentication is on: clients of this cluster (ray job submit, the dashboard, a Ray "
     "client) need the token in ~/.ray/auth_token (RAY_AUTH_MODE=disabled turns it off)"),
    (re.compile(r"Token authentication is disabled"),
     "Ray token authentication is off: anyone who can reach the cluster's ports can run code on it"),
    (re.compile(r"cannot be scheduled right now|No available node types can fulfill"), None),
    (re.compile(r"running low on memory|OutOfMemoryError|CUDA out of memory"), None),
    (re.compile(r"is over \d+% full|local disk is full|No space left on device"), None),
]
# RAY_WARNINGS' entries about the machine's Ray setup (token authentication on/off), not about the
# run: for a cluster the command starts here itself, each is shown once per machine (a marker file
# under the user's state directory), not by every command; for a cluster it joins, every time.
MACHINE_NOTES = {0: "ray-token-auth-on", 1: "ray-token-auth-off"}
_own_cluster = False


def own_local_cluster() -> None:
    """The command starts a cluster of its own on this machine (runtime.init_ray, before ray.init)."""
    global _own_cluster
    _own_cluster = True


def shown_on_this_machine(note: str) -> bool:
    """Whether `note` was shown on this machine before; from now on it was."""
    from platformdirs import user_state_path

    marker = user_state_path("workflows") / "shown" / note
    if marker.exists():
        return True
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:  # a read-only home: shown each time, as before
        pass
    return False


def _ours(line: str) -> bool:
    """A line the driver wrote into the log itself (it is on the terminal already)."""
    return line.startswith(("workflows ", "error: "))


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def plain(line: str) -> str:
    """A log line as a terminal would end up showing it: no colour codes, the last \\r overwrite."""
    line = strip_ansi(line)
    parts = [p for p in line.split("\r") if p.strip()]
    return parts[-1].rstrip() if parts else ""


class Relay(threading.Thread):
    """Follows the log file and puts on the terminal the platform's lines said in Ray workers and
    actors, and RAY_WARNINGS, each once."""

    def __init__(self, path: Path, interval: float = 0.5):
        super().__init__(name="workflows-log-relay", daemon=True)
        self.path, self.interval = path, interval
        self._pos = path.stat().st_size if path.exists() else 0  # the same command in the same second appends
        self._partial = ""
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        self._warned: set[int] = set()
        self._lock = threading.Lock()
        self._done = threading.Event()  # not _stop: Thread has a method of that name

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self.poll()

    def stop(self) -> None:
        self._done.set()
        self.poll()

    def poll(self) -> None:
        """Relay the complete lines written since the last poll."""
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._pos)
                    chunk = f.read()
            except OSError:
                return
            self._pos += len(chunk)
            lines = (self._partial + self._decode(chunk)).split("\n")
            self._partial = lines.pop()
            for line in lines:
                self._handle(line)

    def _handle(self, raw: str) -> None:
        line = plain(raw)
        if _ours(line):
            return
        forwarded = _RAY_PREFIX.match(line)
        text = line[forwarded.end():] if forwarded else line
        said = SAID_IN_WORKER.match(text) if forwarded else None
        if said and _REPEATED.search(text):
            return  # Ray's count of lines like one already relayed
        if said:
            head = said.group(0).strip()
            _emit(_line(head, "bold yellow" if "warning" in head else "bold cyan", text[said.end():]), to_log=False)
            return
        for i, (pattern, message) in enumerate(RAY_WARNINGS):
            if i not in self._warned and pattern.search(text):
                self._warned.add(i)
                if i in MACHINE_NOTES and _own_cluster and shown_on_this_machine(MACHINE_NOTES[i]):
                    continue
                _emit(_line("workflows warning:", "bold yellow", message or text.strip()[:300]), to_log=False)


class CommandLog:
    """Fds 1 and 2 of this process written to `path`; the terminal kept for the platform's output."""

    def __init__(self, path: Path):
        self.path = path
        self.relay = Relay(path)

    def start(self) -> None:
        global _out, _err, _log
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        # os.dup's copies are not inheritable: Ray's processes get the log file, never the terminal
        _out = _reopen(1, sys.stdout)
        _err = _reopen(2, sys.stderr)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        console.file = _err
        _log = self
        self.relay.start()

    def finish(self) -> None:
        """Relay what is left; the descriptors stay on the log file (see the module's docstring)."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.relay.stop()

    def log_exception(self) -> None:
        """The traceback of the exception being handled, into the log file (not the terminal)."""
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()

    def tail(self, n: int = 20) -> list[str]:
        """The last `n` non-empty lines, as a terminal would show them."""
        sys.stdout.flush()
        sys.stderr.flush()
        with open(self.path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 256 * 1024))
            text = f.read().decode("utf-8", "replace")
        lines = [plain(ln) for ln in text.split("\n")]
        return [ln for ln in lines if ln and not _ours(ln)][-n:] if n > 0 else []


def _reopen(fd: int, like: TextIO) -> TextIO:
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding=getattr(like, "encoding", None) or "utf-8",
                     errors="backslashreplace")


def capture(log_dir: Path, command: str) -> CommandLog:
    """Send fds 1 and 2 of this process to `<log_dir>/<command>-<time>.log` from now on."""
    log = CommandLog(Path(log_dir) / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    log.start()
    say(f"logs: Ray's output goes to {log.path} (-v shows it here)")
    return log


def show_log_tail(n: int = 20) -> None:
    """After a failure: the end of the log, then where the whole of it is."""
    if _log is None:
        return
    _log.finish()
    lines = _log.tail(n)
    if lines:
        console.print(Text(f"the last {len(lines)} lines of Ray's output:", style="dim"))
        for line in lines:
            console.print(Text(f"  {line}", style="dim"))
    console.print(_line("workflows", "bold cyan", f"full log: {_log.path}"))

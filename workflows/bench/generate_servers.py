"""The servers the generation bench measures, each a process of its own: started from a command line,
ready once its health URL answers 200, stopped as a service manager stops it (SIGTERM: `workflows serve`
drains and shuts Ray down), its output in a log file that a failure to start quotes.

- `workflows serve` on a registered chat model (`serve_command`), what users run;
- the one-at-a-time peer (workflows.bench.generate_peer);
- the project's peers, from benchmarks/ (llama.cpp's server, vLLM): the same class, their own commands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from workflows.errors import UserError


class Server:
    """A server process; `url` is its OpenAI base URL (…/v1)."""

    def __init__(self, name: str, command: list[str], port: int, log: Path, health: str = "/health",
                 env: dict | None = None, timeout_s: float = 900):
        self.name, self.command, self.port, self.log = name, command, port, log
        self.url = f"http://127.0.0.1:{port}/v1"
        self.health = f"http://127.0.0.1:{port}{health}"
        self.env, self.timeout_s = env, timeout_s
        self.proc: subprocess.Popen | None = None
        self.starts = 0  # a server started again appends to its log
        self.paused = False

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        import requests

        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.paused = False
        with open(self.log, "wb" if self.starts == 1 else "ab") as out:  # the child holds its own descriptor
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(self.env or {})}, start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"bench generate: {self.name} exited ({self.proc.returncode}) before it was ready:\n"
                                f"{self.tail()}")
            try:
                if requests.get(self.health, timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise UserError(f"bench generate: {self.name} not ready after {self.timeout_s:.0f} s:\n{self.tail()}")

    @property
    def running(self) -> bool:
        """Started, not exited, not paused: a process that can take the CPU."""
        return self.proc is not None and self.proc.poll() is None and not self.paused

    def pause(self) -> None:
        """SIGSTOP to its process group while other rows run: an idle server that polls (vLLM's CPU worker
        spins at a quarter of a core) must not take the measured one's CPU."""
        self._signal_group(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)
        self.paused = False

    def _signal_group(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM to the server (`workflows serve` drains and stops Ray, as on Ctrl-C; SIGINT would be ignored
        by a server started from a background job), then SIGTERM and SIGKILL to the process group it started
        in; what of that group is left once it exited is killed too. Once stopped, it is not signalled again
        (its group's id may have gone to another process)."""
        if self.proc is None:
            return
        pid = self.proc.pid
        self.resume()  # a paused server cannot act on SIGTERM
        for sig, wait, group in ((signal.SIGTERM, timeout_s, False), (signal.SIGTERM, 15, True),
                                 (signal.SIGKILL, 10, True)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(pid, sig) if group else os.kill(pid, sig)
                self.proc.wait(wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        try:
            os.killpg(pid, signal.SIGKILL)  # the group's leftovers (none once Ray shut down)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None


def serve_command(config: str, overrides: list[str], spec: str) -> list[str]:
    """`workflows serve --model SPEC --config CONFIG --set ...`, with this interpreter's package."""
    sets = [a for o in overrides for a in ("--set", o)]
    return [sys.executable, "-m", "workflows", "serve", "--model", spec, "--config", config, *sets]


def peer_command(model_dir: str, port: int, threads: int) -> list[str]:
    return [sys.executable, "-m", "workflows.bench.generate_peer", "--model-dir", model_dir, "--port", str(port),
            "--threads", str(threads)]

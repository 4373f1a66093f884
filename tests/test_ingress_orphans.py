"""No orphaned ingress: a `workflows serve` killed at any moment of its startup leaves no HAProxy
(nor anything else of its cluster) behind, and a stale HAProxy of ours on the serve port is stopped
by the next one. Real processes throughout: the CLI, its own Ray cluster, the bundled HAProxy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import QUICKSTART, ROOT, sets
from tests.helpers import free_port
from workflows.serve.haproxy_guard import OWNER_ENV
from workflows.serve.ingress import TEMP_PREFIX, haproxy_binary
from workflows.serve.stale_ingress import free_serve_port, port_free

needs_haproxy = pytest.mark.skipif(haproxy_binary() is None, reason="no HAProxy binary installed here")


def _owned_by(pid: int) -> list[psutil.Process]:
    """Processes started for the command `pid`'s cluster: they carry its owner mark in their environment."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(OWNER_ENV, "").startswith(f"{pid}:"):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _haproxies_of(pid: int) -> list[psutil.Process]:
    return [p for p in _owned_by(pid) if p.name() == "haproxy"]


def _stale_haproxy(tmp: Path, port: int) -> psutil.Process:
    """A real HAProxy of the kind an earlier `workflows serve` left: config in a `wfh-` directory,
    listening on `port`, its parent (the shell standing in for the manager) gone."""
    import tempfile

    files = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp"))
    cfg = files / "node" / "haproxy.cfg"
    cfg.parent.mkdir()
    cfg.write_text("defaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n  timeout server 1s\n"
                   f"frontend f\n  bind 127.0.0.1:{port}\n  http-request return status 200\n")
    out = subprocess.run(["sh", "-c", f'"$0" -db -f {cfg} >/dev/null 2>&1 & echo $!', haproxy_binary()],
                         capture_output=True, text=True, check=True)
    proc = psutil.Process(int(out.stdout))
    deadline = time.time() + 10
    while port_free("127.0.0.1", port):
        assert time.time() < deadline and proc.is_running(), "the stale HAProxy did not listen"
        time.sleep(0.05)
    return proc


@needs_haproxy
def test_a_stale_haproxy_of_ours_is_stopped_and_any_other_holder_named(tmp_path):
    port = free_port()
    stale = _stale_haproxy(tmp_path, port)
    files = Path(stale.cmdline()[stale.cmdline().index("-f") + 1]).parent.parent
    said: list[str] = []
    try:
        free_serve_port("127.0.0.1", port, said.append)
        assert not stale.is_running() or stale.status() == psutil.STATUS_ZOMBIE
        assert port_free("127.0.0.1", port) and not files.exists()
        assert len(said) == 1 and f"stopped pid {stale.pid} (haproxy" in said[0] and str(port) in said[0]
    finally:
        if stale.is_running():
            stale.kill()
    import socket

    from workflows.errors import UserError

    with socket.socket() as other:  # anyone else's: named, never stopped
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(UserError, match=rf"serve.port {port} is in use on 127.0.0.1 by pid {os.getpid()} "):
            free_serve_port("127.0.0.1", port, said.append)


@needs_haproxy
@pytest.mark.parametrize("moment", ["ray started", "haproxy started", "serving"])
def test_a_killed_serve_leaves_no_ingress(quickstart_run, tmp_path, moment):
    """SIGTERM at a moment of startup, SIGKILL to the process group 5 s later (as a supervisor
    does): nothing listens on the port afterwards, no HAProxy nor other process of its cluster is
    left. `workflows serve` starts a cluster of its own here: one it joined would keep the Serve
    application (and that cluster's ingress) by design. The last case first finds the port held by
    a stale HAProxy of ours, which it stops."""
    port = free_port()
    stale = _stale_haproxy(tmp_path, port) if moment == "serving" else None
    cmd = [sys.executable, "-m", "workflows", "serve", "-m", "quickstart", "--config", str(QUICKSTART),
           *sets([*quickstart_run.overrides, f"serve.port={port}", "ray.num_cpus=1", "ray.address=local"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True, env={**os.environ, "RAY_ADDRESS": ""})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()

    def reached() -> bool:
        if moment == "haproxy started":
            return bool(_haproxies_of(proc.pid))
        return any(("ray: started" if moment == "ray started" else "is up behind HAProxy") in ln for ln in lines)

    deadline = time.time() + 240
    try:
        while not reached():
            assert proc.poll() is None and time.time() < deadline, f"never reached {moment!r}:\n" + "".join(lines)
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(5)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
        deadline = time.time() + 30
        while (left := _owned_by(proc.pid)) or not port_free("127.0.0.1", port):
            assert time.time() < deadline, f"left after {moment!r}: {[(p.pid, p.name()) for p in left]}, " \
                                           f"port free: {port_free('127.0.0.1', port)}"
            time.sleep(0.2)
        if stale is not None:
            assert any(f"serve: stopped pid {stale.pid} (haproxy" in ln for ln in lines), "".join(lines)
    finally:
        for p in _owned_by(proc.pid) + ([stale] if stale else []):
            try:
                p.kill()
            except psutil.Error:
                pass

"""Before `workflows serve` starts a cluster: is its port free, and if not, who holds it.

An HAProxy of ours that outlived its command (one started before workflows.serve.haproxy_guard,
or by a Ray that ignored it) keeps listening on the serve port, and Serve's own error names
neither the process nor a way out. Ours: its config lies in one of our private `wfh-` directories
(workflows.serve.ingress). Stale: no Serve HAProxyManager actor is its parent any more. Such a
process is stopped (and its directory removed); any other holder is named in a one-line error.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from workflows.config.cluster import cluster_address
from workflows.errors import UserError
from workflows.net import port_free
from workflows.serve.ingress import TEMP_PREFIX

MANAGER = "HAProxyManager"  # in the process title Ray gives the actor's worker: ray::HAProxyManager...


def listeners(port: int) -> list[psutil.Process]:
    """The processes with a TCP socket listening on `port` (any address), as far as we may see them."""
    pids = {c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    found = []
    for pid in sorted(pids):
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def our_haproxy_dir(proc: psutil.Process) -> Path | None:
    """The `wfh-` directory of an HAProxy started for one of our clusters (`-f DIR/<node>/haproxy.cfg`)."""
    try:
        args = proc.cmdline()
    except psutil.Error:
        return None
    if "-f" not in args[:-1] or "haproxy" not in os.path.basename(args[0] if args else ""):
        return None
    cfg = Path(args[args.index("-f") + 1])
    temp_roots = {Path("/tmp"), Path(tempfile.gettempdir())}
    for parent in cfg.parents:
        if parent.name.startswith(TEMP_PREFIX) and parent.parent in temp_roots:
            return parent
    return None


def manager_alive(proc: psutil.Process) -> bool:
    try:
        parent = proc.parent()
        return parent is not None and parent.pid != 1 and MANAGER in " ".join(parent.cmdline())
    except psutil.Error:
        return False


def describe(proc: psutil.Process) -> str:
    try:
        head = " ".join(proc.cmdline())[:120] or proc.name()
        return f"pid {proc.pid} ({proc.name()}: {head})"
    except psutil.Error:
        return f"pid {proc.pid}"


def stop(proc: psutil.Process, wait_s: float = 5) -> bool:
    """Stop `proc` (SIGTERM, then SIGKILL): False where we may not signal it (another user's, or
    a kernel that says no), for the caller to name instead of a traceback."""
    try:
        try:
            proc.terminate()
            proc.wait(wait_s)
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(wait_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.AccessDenied:
        return False
    return True


def free_before_serve_starts(cfg, say: Callable[[str], object]) -> None:
    """free_serve_port right before Serve starts on a cluster this command started (where Serve
    runs already, the port is its own). `workflows serve` and `pipeline` check before Ray starts
    too, but a pipeline trains for minutes in between: a port taken since would leave Serve's
    Python proxy failing to bind over and over while the holder answers."""
    from ray.serve.context import _get_global_client

    if cluster_address(cfg) is None and _get_global_client(raise_if_no_controller_running=False) is None:
        free_serve_port(cfg.serve.host, cfg.serve.port, say)


def free_serve_port(host: str, port: int, say: Callable[[str], object], wait_s: float = 5) -> None:
    """Make `host:port` bindable for a cluster this command starts: stop stale HAProxies of ours
    there (one line each), or raise a UserError naming whoever else holds it."""
    if port_free(host, port):
        return
    holders = listeners(port)
    others = [p for p in holders if our_haproxy_dir(p) is None or manager_alive(p)]
    if others:
        raise UserError(f"serve.port {port} is in use on {host} by {describe(others[0])}: stop it, or set "
                        "serve.port to another port")
    for proc in holders:
        files, who = our_haproxy_dir(proc), describe(proc)
        if not stop(proc):
            raise UserError(f"serve.port {port} is held by {who}, a stale HAProxy of an earlier `workflows serve` "
                            "that this user may not stop (access denied): stop it as its owner, or set serve.port "
                            "to another port")
        if files is not None:
            shutil.rmtree(files, ignore_errors=True)
        say(f"serve: stopped {who}, a stale HAProxy of an earlier `workflows serve` "
            f"(its manager is gone) that held port {port}")
    deadline = time.time() + wait_s
    while not port_free(host, port):
        if time.time() > deadline:
            raise UserError(f"serve.port {port} is in use on {host}"
                            + (" by a process of another user" if not holders else " (still, after stopping "
                               "a stale HAProxy)") + ": set serve.port to another port")
        time.sleep(0.1)

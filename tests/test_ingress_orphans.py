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
from workflows.net import port_free
from workflows.serve.haproxy_guard import OWNER_ENV
from workflows.serve.ingress import TEMP_PREFIX, haproxy_binary
from workflows.serve.stale_ingress import free_serve_port

needs_haproxy = pytest.mark.skipif(haproxy_binary() is None, reason="no HAProxy binary installed here")


def _owned_by(pid: int) -> list[psutil.Process]:
    """Processes started for the command `pid`'s cluster that carry its owner mark in their
    environment (workflows.serve.haproxy_guard's watchdog among them)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(OWNER_ENV, "").startswith(f"{pid}:"):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _alive(procs) -> list[psutil.Process]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.Error:
            pass
    return left


class Tree:
    """Every process seen below the command while it ran (its cluster: raylet, workers, HAProxy),
    found by ancestry: what outlives the command is reparented, but was seen here before."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.seen: dict[int, psutil.Process] = {}

    def look(self) -> None:
        try:
            for p in self.root.children(recursive=True):
                self.seen.setdefault(p.pid, p)  # psutil.Process keeps the start time: no pid reuse
        except psutil.Error:
            pass

    def haproxies(self) -> list[psutil.Process]:
        self.look()
        return [p for p in _alive(self.seen.values()) if _name(p) == "haproxy"]

    def left(self) -> list[psutil.Process]:
        return _alive([*self.seen.values(), *_owned_by(self.root.pid)])


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


def test_the_guard_runs_the_users_haproxy_in_place_and_dies_with_its_parent(monkeypatch):
    """Serve's binary override becomes the guard (around the user's own choice, restored after);
    the guard execs it in the same process (Serve waits for that pid) and the kernel kills it
    when the process that started it dies."""
    from workflows.serve import ingress

    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/bin/sleep")  # the user's "HAProxy"
    monkeypatch.delenv(OWNER_ENV, raising=False)
    env = ingress.cluster_env(True)
    with ingress.scoped_env(env):
        wrapper = os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"]
        assert wrapper != "/bin/sleep" and "/bin/sleep" in Path(wrapper).read_text()
        assert os.environ[OWNER_ENV] == env[OWNER_ENV]
    assert os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] == "/bin/sleep" and OWNER_ENV not in os.environ
    starter = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                "print(subprocess.Popen([sys.argv[1], '600']).pid, flush=True); time.sleep(600)",
                                wrapper], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(starter.stdout.readline()))
        deadline = time.time() + 10
        while child.cmdline() != ["/bin/sleep", "600"]:
            assert time.time() < deadline, child.cmdline()
            time.sleep(0.05)
    finally:
        starter.kill()
        starter.wait()
    deadline = time.time() + 10
    while _alive([child]):
        assert time.time() < deadline, "the guarded process outlived its parent"
        time.sleep(0.05)


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


@pytest.mark.parametrize("haproxy", ["0", "1"])
def test_a_serve_port_taken_after_the_commands_check_is_refused_in_one_line_before_serve_starts(monkeypatch,
                                                                                                  haproxy):
    """`workflows serve`/`pipeline` check serve.port before Ray starts; a pipeline then trains for
    minutes. Taken since (here: by a listener of this process), Serve's Python proxy would fail to
    bind it over and over while the holder answers: deploy names the holder in one line instead,
    before Serve starts, behind either ingress."""
    import socket

    import ray.serve
    import ray.serve.context

    from workflows.config import load_config
    from workflows.errors import UserError
    from workflows.serve import app

    started: list = []
    monkeypatch.setattr(ray.serve, "start", lambda **kw: started.append("start"))
    monkeypatch.setattr(ray.serve, "run", lambda *a, **kw: started.append("run"))
    monkeypatch.setattr(app, "application", lambda cfg, spec, served_as=None: None)
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda **kw: None)  # no Serve in the cluster yet
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", haproxy)
    port = free_port()
    cfg = load_config(QUICKSTART, ["ray.address=local", f"serve.port={port}"])
    with socket.create_server(("127.0.0.1", port)):
        with pytest.raises(UserError) as e:
            app.deploy(cfg, "quickstart:1")
    assert str(e.value).startswith(f"serve.port {port} is in use on 127.0.0.1 by pid {os.getpid()} ")
    assert len(str(e.value).splitlines()) == 1 and started == []
    assert app.deploy(cfg, "quickstart:1") == f"http://127.0.0.1:{port}"  # free again: Serve starts
    assert started == ["start", "run"]

class Serve:
    """`workflows serve` of the shared run's model in a new process group, on a cluster of its own
    (one it joined would keep the Serve application, and that cluster's ingress, by design)."""

    def __init__(self, quickstart_run, port: int):
        cmd = [sys.executable, "-m", "workflows", "serve", "-m", "quickstart", "--config", str(QUICKSTART),
               *sets([*quickstart_run.overrides, f"serve.port={port}", "ray.num_cpus=1", "ray.address=local"])]
        self.port = port
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     start_new_session=True, env={**os.environ, "RAY_ADDRESS": ""})
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()
        self.tree = Tree(self.proc.pid)

    def wait_for(self, moment: str) -> list[psutil.Process]:
        """Until HAProxy has started ("haproxy started") or the model is served ("serving");
        returns the HAProxy processes."""
        deadline = time.time() + 240
        while not ((haproxies := self.tree.haproxies()) and
                   (moment == "haproxy started" or any("is up behind HAProxy" in ln for ln in self.lines))):
            assert self.proc.poll() is None and time.time() < deadline, \
                f"never reached {moment!r}:\n" + "".join(self.lines)
            time.sleep(0.05)
        return haproxies

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def assert_nothing_left(self, what: str, within_s: float = 30) -> None:
        deadline = time.time() + within_s
        while (left := self.tree.left()) or not port_free("127.0.0.1", self.port):
            assert time.time() < deadline, f"left {what}: {[(p.pid, _name(p)) for p in left]}, " \
                                           f"port {self.port} free: {port_free('127.0.0.1', self.port)}"
            time.sleep(0.2)

    def cleanup(self) -> None:
        for p in self.tree.left():
            try:
                p.kill()
            except psutil.Error:
                pass


@needs_haproxy
# one moment and one fault in the gate; the other of each in make test-all
@pytest.mark.parametrize("moment", ["haproxy started", pytest.param("serving", marks=pytest.mark.extended)])
def test_a_serve_stopped_during_startup_leaves_no_ingress(quickstart_run, tmp_path, moment):
    """SIGTERM at a moment of startup, SIGKILL to the process group 5 s later (as a supervisor
    does): nothing listens on the port afterwards, no HAProxy nor other process of its cluster is
    left. In the "serving" case the port is first held by a stale HAProxy of ours, which the
    command stops and says so."""
    port = free_port()
    stale = _stale_haproxy(tmp_path, port) if moment == "serving" else None
    serve = Serve(quickstart_run, port)
    try:
        serve.wait_for(moment)
        serve.proc.send_signal(signal.SIGTERM)
        end = time.time() + 5
        while time.time() < end:
            serve.tree.look()
            time.sleep(0.05)
        serve.kill_group()
        serve.assert_nothing_left(f"after SIGTERM at {moment!r}, then SIGKILL")
        if stale is not None:
            assert any(f"serve: stopped pid {stale.pid} (haproxy" in ln for ln in serve.lines), "".join(serve.lines)
    finally:
        serve.cleanup()
        if stale is not None and stale.is_running():
            stale.kill()


@needs_haproxy
@pytest.mark.parametrize("fault", ["manager and raylet killed",
                                   pytest.param("command killed, manager hung", marks=pytest.mark.extended)])
def test_haproxy_dies_with_its_manager_or_its_command(quickstart_run, fault):
    """Where Ray cannot clean up, HAProxy still goes. Its manager SIGKILLed together with the
    raylet (which would kill the manager's process group): the parent-death signal ends HAProxy
    while the command lives. The command's process group SIGKILLed while the manager hangs
    (SIGSTOP), so that nothing of Ray cleans up: the guard's watchdog ends HAProxy."""
    serve = Serve(quickstart_run, free_port())
    try:
        haproxies = serve.wait_for("haproxy started")
        manager = haproxies[0].parent()
        assert "HAProxyManager" in " ".join(manager.cmdline())
        raylet = next(p for p in serve.tree.seen.values() if _name(p) == "raylet")
        if fault == "manager and raylet killed":
            for p in (manager, raylet):
                p.kill()
            deadline = time.time() + 10
            while _alive(haproxies):
                assert time.time() < deadline, f"HAProxy outlived its manager: {haproxies}"
                time.sleep(0.1)
            assert serve.proc.poll() is None  # the command lives: the watchdog had no part in it
        else:
            manager.suspend()
            serve.kill_group()
            deadline = time.time() + 10
            while _alive(haproxies):
                assert time.time() < deadline, f"HAProxy outlived its command: {haproxies}"
                time.sleep(0.1)
            manager.kill()
        serve.kill_group()
        serve.assert_nothing_left(f"after {fault!r}")
    finally:
        serve.cleanup()


@needs_haproxy
def test_a_stale_haproxy_we_may_not_stop_is_named_in_one_line(tmp_path, monkeypatch):
    """Another user's HAProxy (or a kernel that refuses the signal): psutil's AccessDenied becomes
    a one-line error naming the process. The refusal is mocked (the tests run as a user who may
    signal anything); the HAProxy, its port and its directory are real."""
    from workflows.errors import UserError

    port = free_port()
    stale = _stale_haproxy(tmp_path, port)

    def refused(self):
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "terminate", refused)
    said: list[str] = []
    try:
        with pytest.raises(UserError, match=rf"serve.port {port} is held by pid {stale.pid} \(haproxy.*may not stop"):
            free_serve_port("127.0.0.1", port, said.append)
        assert stale.is_running() and not said
    finally:
        monkeypatch.undo()
        files = Path(stale.cmdline()[stale.cmdline().index("-f") + 1]).parent.parent
        stale.kill()
        stale.wait(10)
        import shutil

        shutil.rmtree(files, ignore_errors=True)

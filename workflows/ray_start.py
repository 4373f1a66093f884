"""Starting a local Ray cluster on a busy machine: once more when its node died starting up.

Ray 2.60's raylet gives the dashboard agent a fixed 15 s to write its port file and aborts when it has
not (ray-project/ray#65983, no setting changes it); on a loaded 2-core machine the agent's imports can
take longer. `ray.init` then says only "The current node timed out during startup", after a wait of
its own, and leaves the processes it did start running (GCS, dashboard, monitors): it had not yet
recorded its node, so `ray.shutdown()` cannot stop them. Ray retries none of it, so this module does:
it stops what the failed start left, then starts again.

And stopping one (`shutdown_local`): a worker whose exit hangs after it left the cluster outlives
`ray.shutdown()`. Ray 2.60's core worker can deadlock in its own destructor (`~Publisher`, seen after
a test run: a `ray::TrainController` whose job had ended, 590 MB, for good), and the raylet, which
counts it gone once it disconnected, never kills it; so the session's processes that outlive the
shutdown are stopped here.

And quieting its own processes (`quiet_control_plane`): GCS, the dashboard, the agents and the monitors
run at niceness 0, as the replica does (`serve.replica_niceness`), and Serve's controller and proxy actor
at Ray's 15. On a node of few cores their wake-ups (metrics, health checks, state polls: a few percent of
a core each) preempt the engine's threads mid-step, which shows in its inter-token gaps. Ray has no
setting for its own processes' niceness, so they are reniced here once started, thread by thread
(niceness is per thread on Linux). Never the raylet (each worker it starts would inherit it, and an
unprivileged raylet could not start a replica below it), nor the ingress (HAProxy, and its manager,
which starts HAProxy anew on each reload), nor any other worker: those do the serving.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import psutil

from workflows.console import warn

T = TypeVar("T")
STARTUP_TIMEOUT = "The current node timed out during startup"  # Ray's message (ray/_private/node.py)
ATTEMPTS = 2


def start_local(start: Callable[[], T], attempts: int = ATTEMPTS) -> T:
    """`start()` (a `ray.init` of a local cluster); when Ray's node timed out starting, the processes
    it left stopped and `start()` called again, up to `attempts` times in all. `start` picks its ports
    anew on each call: the failed start's dashboard may still hold its port a moment."""
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in _descendants()}
        try:
            return start()
        except Exception as e:
            if STARTUP_TIMEOUT not in str(e) or attempt == attempts:
                raise
            left = stop_left_behind(before)
            warn(f"ray: the local cluster's node did not start in time (a busy machine: Ray gives its dashboard "
                 f"agent 15 s); stopped the {left} process(es) it left, starting it again "
                 f"({attempt + 1} of {attempts})")
    raise AssertionError("unreachable")


def stop_left_behind(before: set[int]) -> int:
    """Stop this process's descendants not in `before` (pids), and any process that names their Ray
    session (the raylet's children outlive it, reparented); returns how many were stopped."""
    new = [p for p in _descendants() if p.pid not in before]
    sessions = {s for p in new for s in _sessions(_cmdline(p))}
    others = [p for p in psutil.process_iter() if p.pid not in before and p not in new
              and sessions & set(_sessions(_cmdline(p)))]
    procs = new + others
    _stop(procs)
    return len(procs)


def shutdown_local(grace_s: float = 5.0) -> int:
    """`ray.shutdown()` of the local cluster this process started, then stop its processes that are still
    running `grace_s` later (terminate, then kill); returns how many were stopped."""
    import ray

    procs = [p for p in _descendants() if _of_ray(p)]
    ray.shutdown()
    deadline = time.monotonic() + grace_s
    while (alive := [p for p in procs if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive:
        titles = ", ".join(sorted({_title(_cmdline(p)) for p in alive}))
        _stop(alive)
        warn(f"ray: stopped {len(alive)} process(es) of the local cluster that outlived its shutdown ({titles})")
    return len(alive)


# Ray's own workers that serve nothing; every other worker (a replica, an engine's, a pooled one that an
# actor may take next, the ingress's) keeps the niceness it has
CONTROL_WORKERS = ("ray::ServeController", "ray::ProxyActor", "ray::DashboardAgent", "ray::RuntimeEnvAgent",
                   "ray::Drain")


def quiet_control_plane(niceness: int) -> list[int]:
    """Raise (never lower) to `niceness` every thread of the local cluster's control processes that this
    process started, with their children (the dashboard's modules); returns their pids."""
    quieted: list[int] = []
    for p in _descendants():
        cmdline = _cmdline(p)
        title = _title(cmdline)
        if title.startswith("ray::"):
            if not title.startswith(CONTROL_WORKERS):
                continue
        elif not _sessions(cmdline) or title.endswith("/raylet"):  # HAProxy names no session: its manager's child
            continue
        for proc in (p, *_descendants(p)):
            if proc.pid not in quieted and _renice(proc, niceness):
                quieted.append(proc.pid)
    return quieted


def _renice(p: psutil.Process, niceness: int) -> bool:
    try:
        threads = p.threads()
    except psutil.Error:  # gone, or not ours to read
        return False
    for thread in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, thread.id) < niceness:
                os.setpriority(os.PRIO_PROCESS, thread.id, niceness)
        except OSError:  # the thread ended since the listing
            continue
    return True


def _stop(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def _running(p: psutil.Process) -> bool:
    """Not exited; a zombie (exited, its parent yet to reap it) takes nothing and cannot be stopped."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone
        return False


def _of_ray(p: psutil.Process) -> bool:
    """A process of a Ray session: a worker (titled `ray::...`) or one naming its session (raylet, GCS,
    dashboard, monitors)."""
    cmdline = _cmdline(p)
    return _title(cmdline).startswith("ray::") or bool(_sessions(cmdline))


def _title(cmdline: list[str]) -> str:
    return cmdline[0] if cmdline else ""


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # gone, a zombie, or not ours to read
        return []


def _descendants(of: psutil.Process | None = None) -> list[psutil.Process]:
    """The processes under `of` (this process by default); none once it is gone."""
    try:
        return (of or psutil.Process()).children(recursive=True)
    except psutil.Error:
        return []


def _sessions(cmdline: list[str]) -> list[str]:
    """The Ray session names (session_<time>_<pid>) in a process's command line."""
    return [part for arg in cmdline for part in arg.split("/") if part.startswith("session_") and "=" not in part]

"""A local cluster whose node dies starting up is started again (workflows.ray_start): real Ray, its
dashboard agent made slower than the raylet's fixed 15 s wait for it (tests/slow_agent), as a busy
machine makes it; the failed start's processes are stopped, the second start serves tasks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import QUICKSTART, ROOT

# init_ray as a command calls it, then a task on the cluster it started and the processes of the failed
# start still running (Ray's processes die with the driver: only while it runs do they cost anything)
SCRIPT = f"""
import os, psutil, ray
from workflows.config import load_config
from workflows.runtime import init_ray
init_ray(load_config({str(QUICKSTART)!r}, ["ray.num_cpus=1", "serve.haproxy=false", "tracking.enabled=false"]))
print("task:", ray.get(ray.remote(lambda: 41 + 1).remote()), flush=True)
agent = open(os.environ["SLOW_AGENT_MARKER"]).read()
session = next(part for part in agent.split("/") if part.startswith("session_"))
def names(p):
    try:
        return any(session in arg for arg in p.cmdline())
    except psutil.Error:
        return False
print("left:", [p.pid for p in psutil.process_iter() if names(p)], flush=True)
ray.shutdown()
"""


@pytest.mark.integration
@pytest.mark.extended  # ~45 s, most of it Ray's own waits for the node that never starts
def test_a_node_that_times_out_starting_is_stopped_and_started_again(tmp_path):
    marker = tmp_path / "marker"
    marker.write_text("armed")
    path = [str(ROOT / "tests" / "slow_agent"), os.environ.get("PYTHONPATH")]  # no empty entry (the cwd)
    env = {**os.environ, "RAY_ADDRESS": "", "WORKFLOWS_DASHBOARD_PORT": "0", "SLOW_AGENT_MARKER": str(marker),
           "PYTHONPATH": os.pathsep.join(filter(None, path))}
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    agent = marker.read_text()
    assert agent != "armed", "the slow agent never started: the fault was not injected"
    assert res.returncode == 0, res.stderr[-3000:]
    assert "task: 42" in res.stdout
    assert "starting it again (2 of 2)" in res.stderr, res.stderr[-3000:]
    assert "left: []" in res.stdout, f"processes of the failed start still run: {res.stdout}"


# a command's runtime on a local cluster, where an actor leaves the cluster and its worker's exit then hangs
# (as Ray 2.60's core worker can hang in its own destructor): the raylet counts it gone, ray.shutdown misses it
LEAVING = f"""
import os, time, psutil, ray
from workflows.config import load_config
from workflows.runtime import runtime
cfg = load_config({str(QUICKSTART)!r}, ["ray.num_cpus=1", "serve.haproxy=false", "tracking.enabled=false",
                                       "storage.embedded.enabled=false", "storage.root=" + os.environ["ROOT_DIR"]])
with runtime(cfg):
    @ray.remote
    class Leaving:
        def pid(self):
            return os.getpid()

        def leave(self):
            import atexit, signal
            atexit.register(time.sleep, 600)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            ray.actor.exit_actor()

    actor = Leaving.remote()
    pid = ray.get(actor.pid.remote())
    print("pid:", pid, flush=True)
    try:
        ray.get(actor.leave.remote())
    except ray.exceptions.ActorDiedError:
        pass
    time.sleep(2)
    print("left the cluster, running:", psutil.pid_exists(pid), flush=True)
alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
print("after the runtime:", alive, flush=True)
"""


@pytest.mark.integration
@pytest.mark.extended  # ~20 s: a cluster's start, and the 5 s grace and 5 s terminate of the hung worker
def test_a_worker_whose_exit_hangs_does_not_outlive_the_runtime(tmp_path):
    import psutil

    env = {**os.environ, "RAY_ADDRESS": "", "WORKFLOWS_DASHBOARD_PORT": "0", "ROOT_DIR": str(tmp_path / "store")}
    res = subprocess.run([sys.executable, "-c", LEAVING], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    pid = next((int(line.split()[1]) for line in res.stdout.splitlines() if line.startswith("pid:")), None)
    try:
        assert res.returncode == 0, res.stderr[-3000:]
        assert "left the cluster, running: True" in res.stdout, res.stdout  # the fault: it outlives its actor
        assert "after the runtime: False" in res.stdout, res.stdout
        assert "outlived its shutdown (ray::Leaving)" in res.stderr, res.stderr[-3000:]
    finally:  # on the old code it runs on, sleeping in its exit
        if pid is not None and psutil.pid_exists(pid):
            psutil.Process(pid).kill()

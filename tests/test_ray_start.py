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

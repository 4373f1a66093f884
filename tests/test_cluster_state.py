"""The cluster's nodes and resources, asked of the GCS with a deadline (workflows.cluster_state)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from workflows import cluster_state

ROOT = Path(__file__).resolve().parents[1]


def test_the_cluster_as_ray_describes_it(ray_cluster):
    ray = ray_cluster
    assert [n.node_id for n in cluster_state.alive_nodes()] == sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    ours, theirs = cluster_state.cluster_resources(), ray.cluster_resources()
    assert set(ours) == set(theirs) and ours["CPU"] == theirs["CPU"] == 2
    node = cluster_state.alive_nodes()[0]
    assert node.address == ray.util.get_node_ip_address() and node.metrics_export_port > 0
    assert [sorted(r) for r in cluster_state.available_per_node()] == [
        sorted(r) for r in ray._private.state.available_resources_per_node().values()]


# A GCS stopped (SIGSTOP: the connection stays open, nothing answers) is the lost reply ray.nodes() waits
# on for ever; its own cluster, in a process of its own, so the session's cluster goes on.
STOPPED_GCS = """
import signal, time, psutil, ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
from workflows import cluster_state as cs
cs.TIMEOUT_S = 2.0
gcs, = [p for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server"]  # ray.init started it
assert len(cs.alive_nodes()) == 1
def stopped(proc):  # every thread of it: the stop reaches each thread as it next runs
    return all(psutil.Process(t.id).status() == psutil.STATUS_STOPPED for t in proc.threads())
gcs.send_signal(signal.SIGSTOP)
try:
    deadline = time.monotonic() + 30
    while not stopped(gcs) and time.monotonic() < deadline:
        time.sleep(0.01)
    print("STOPPED", stopped(gcs))
    for query in (cs.alive_nodes, cs.cluster_resources, cs.available_per_node):
        t = time.monotonic()
        try:
            query()
            print("ANSWERED", query.__name__)
        except cs.ClusterUnreachable as e:
            print("UNREACHABLE", query.__name__, round(time.monotonic() - t, 1), e)
finally:
    gcs.send_signal(signal.SIGCONT)
print("AFTER", cs.cluster_resources()["CPU"])
"""


def test_a_gcs_that_does_not_answer_fails_the_query_by_its_deadline():
    out = subprocess.run([sys.executable, "-c", STOPPED_GCS], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "STOPPED True" in out.stdout, out.stdout
    lines = [line.split(" ", 3) for line in out.stdout.splitlines() if line.startswith("UNREACHABLE")]
    assert [name for _, name, *_ in lines] == ["alive_nodes", "cluster_resources", "available_per_node"], out.stdout
    for _, _, seconds, message in lines:
        assert 3.5 <= float(seconds) < 30, out.stdout  # two tries of 2 s each, then the error
        assert "did not answer" in message and "2 tries" in message
    assert "AFTER 1.0" in out.stdout


def test_the_product_asks_the_cluster_only_through_cluster_state():
    """ray.nodes(), ray.cluster_resources(), ray.available_resources() and Ray's per-node availability
    wait without a deadline; workflows/ calls none of them outside cluster_state."""
    banned = {"nodes", "cluster_resources", "available_resources", "available_resources_per_node"}
    found = []
    for path in sorted((ROOT / "workflows").rglob("*.py")):
        if path.name == "cluster_state.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            called = node.func if isinstance(node, ast.Call) else None
            ray_call = (isinstance(called, ast.Attribute) and called.attr in banned
                        and ast.unparse(called).startswith("ray."))
            ray_import = (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray"
                          and any(a.name in banned for a in node.names))
            if ray_call or ray_import:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_no_subprocess_forks_a_driver_through_a_preexec_fn():
    """Popen's preexec_fn forks the whole calling process and runs every at-fork handler in it; in a Ray
    driver gRPC's are the suspects of requests to the GCS lost for ever (the test run's hangs, each right
    after one). Spawns without one (vfork) run none."""
    found = []
    for folder in ("workflows", "tests", "reliability", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.keyword) and node.arg == "preexec_fn":
                    found.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
    assert not found, found

"""`ray job submit` against a real multi-node cluster: `cluster/local/start.sh` starts a head and a
worker node (separate `ray start`s with their own raylets, object stores and shard caches, token
auth on), and the tiny quickstart pipeline runs as a Ray job uploaded with
`cluster/runtime-env.yaml`; its driver runs the embedded S3 endpoint. Stopped with `stop.sh`."""

import json
import os
import random
import secrets
import socket
import subprocess
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import ROOT, free_port, tiny_overrides

RAY = Path(sys.executable).parent / "ray"
START = ROOT / "cluster" / "local" / "start.sh"
STOP = ROOT / "cluster" / "local" / "stop.sh"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _base_port(nodes: int) -> int:
    """A BASE_PORT whose per-node ports (BASE_PORT + 10*i .. +5) are all free; below the
    usual ephemeral range, so that the OS does not hand them out meanwhile."""
    for _ in range(200):
        base = random.randrange(20000, 32000, 10)
        if all(_port_free(base + 10 * i + k) for i in range(nodes) for k in range(6)):
            return base
    raise RuntimeError("no free port block for the local cluster")


@dataclass
class LocalCluster:
    env: dict  # for clients: RAY_AUTH_MODE=token and this cluster's token
    gcs_address: str  # for drivers: ray.address / RAY_ADDRESS
    dashboard: str  # for `ray job ...`: http://127.0.0.1:PORT
    state_dir: Path


@contextmanager
def local_cluster(state_dir: Path, workers: int, head_cpus: int, cpus_per_node: int = 1) -> Iterator[LocalCluster]:
    """cluster/local/start.sh on free ports with a state dir of its own; stop.sh --purge at exit."""
    dashboard = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_API_SERVER_ADDRESS")}
    env.update(
        # A token of this cluster's own: the nodes and the clients get it from the environment,
        # so ~/.ray/auth_token is neither needed nor written.
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY=str(RAY), STATE_DIR=str(state_dir), NUM_WORKERS=str(workers), HEAD_CPUS=str(head_cpus),
        CPUS_PER_NODE=str(cpus_per_node), OBJECT_STORE_MB="256", RAY_PORT=str(free_port()),
        DASHBOARD_PORT=str(dashboard), CLIENT_PORT=str(free_port()), BASE_PORT=str(_base_port(workers + 1)),
    )
    # Every process of the cluster must find *this* cluster's dashboard. Ray Train's
    # PlacementGroupCleaner calls the state API without an address; with another Ray instance on
    # the machine (this test session's own) auto-detection fails, so the placement groups of Tune
    # trials that Tune stopped are never removed, and the next training waits forever for CPUs.
    node_env = {**env, "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard}"}
    try:
        started = subprocess.run(["bash", str(START)], cwd=ROOT, env=node_env, capture_output=True, text=True,
                                 timeout=400)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        assert f"head + {workers} worker node(s), {workers + 1} alive" in started.stdout, started.stdout
        env_file = (state_dir / "env").read_text()
        assert "RAY_AUTH_MODE=token" in env_file and f"RAY_ADDRESS=127.0.0.1:{env['RAY_PORT']}" in env_file
        yield LocalCluster(env=node_env, gcs_address=f"127.0.0.1:{env['RAY_PORT']}",
                           dashboard=f"http://127.0.0.1:{dashboard}", state_dir=state_dir)
    finally:
        stopped = subprocess.run(["bash", str(STOP), "--purge"], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=300)
        print(stopped.stdout, stopped.stderr)


def _ray(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(RAY), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_pipeline_as_ray_job_on_local_multinode_cluster(tmp_path):
    out = tmp_path / "job"
    with local_cluster(tmp_path / "cluster", workers=1, head_cpus=1) as cluster:
        env, address = cluster.env, cluster.dashboard
        submit = ["job", "submit", "--address", address, "--working-dir", ".", "--runtime-env", "cluster/runtime-env.yaml"]

        # The job's `python` is the environment that holds `ray` (start.sh puts it first on PATH).
        res = _ray([*submit, "--", "python", "-c", "import sys; print('job python:', sys.executable)"], env, 300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        line = next(ln for ln in res.stdout.splitlines() if ln.startswith("job python: "))
        assert Path(line.split(": ", 1)[1]).parent == Path(sys.executable).parent, line

        sets = [*tiny_overrides(out), "ray.address=auto", "cache.dir=auto", "serve.enabled=false",
                "tune.num_samples=1", "tune.max_epochs=1"]  # tuning itself is tested in test_tune.py
        job_id = f"workflows-test-{uuid.uuid4().hex[:8]}"
        res = _ray([*submit, "--submission-id", job_id, "--",
                    "python", "-m", "workflows", "pipeline", "--config", "configs/quickstart.yaml",
                    *[a for s in sets for a in ("--set", s)]], env, 900)
        status = _ray(["job", "status", "--address", address, job_id], env, 120)
        logs = _ray(["job", "logs", "--address", address, job_id], env, 120).stdout
        # `ray job submit` exits 0 for a job that was stopped or lost too: ask for the final status
        assert res.returncode == 0 and f"job '{job_id}' succeeded" in status.stdout.lower(), (
            status.stdout[-500:] + status.stderr[-500:] + "\n" + logs[-6000:])

        for stage in ["data:", "preprocess:", "tune:", "train:", "evaluate:", "pipeline: done"]:
            assert f"workflows {stage}" in logs, stage
        assert "registered quickstart:v1" in logs and "majority baseline" in logs
        runs = out / "runs" / "quickstart"
        for stage in ["preprocess", "tune", "train", "pipeline"]:
            assert (runs / f"{stage}.json").exists(), stage
        summary = json.loads((runs / "pipeline.json").read_text())
        assert summary["model"] == {"name": "quickstart", "version": 1, "uri": "s3://workflows/models/quickstart/v1"}
        assert summary["tune"]["trials"] == 1 and "serve" not in summary
        assert summary["config"]["ray"]["address"] == "auto"
        # cache.dir=auto: the nodes cached the shards they read in their own WORKFLOWS_CACHE_DIR
        cached = {node: len(list((cluster.state_dir / node / "cache" / "shards").glob("*.data")))
                  for node in ("head", "worker-1")}
        assert sum(cached.values()) > 0, cached
        print("job stage seconds:", summary["seconds"], "cached shards per node:", cached)

"""A throwaway multi-process Ray cluster on this machine: `cluster/local/start.sh` on free ports
with a state dir of its own and a token of its own (token auth on), `stop.sh --purge` at exit.
Used by the tests that submit Ray jobs and by secrets_hygiene's token-auth checks."""

from __future__ import annotations

import os
import random
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
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


def ray_cli(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(RAY), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@contextmanager
def local_cluster(state_dir: Path, workers: int, head_cpus: int, cpus_per_node: int = 1) -> Iterator[LocalCluster]:
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
        # the default 180 s is for a quiet machine; here other tests or rows may hold every core
        START_TIMEOUT_S=os.environ.get("START_TIMEOUT_S", "360"),
    )
    # Every process of the cluster must find *this* cluster's dashboard. Ray Train's
    # PlacementGroupCleaner calls the state API without an address; with another Ray instance on
    # the machine (a test session's own) auto-detection fails, so the placement groups of Tune
    # trials that Tune stopped are never removed, and the next training waits forever for CPUs.
    node_env = {**env, "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard}"}
    try:
        started = subprocess.run(["bash", str(START)], cwd=ROOT, env=node_env, capture_output=True, text=True,
                                 timeout=900)
        alive = f"head + {workers} worker node(s), {workers + 1} alive"
        if started.returncode != 0 or alive not in started.stdout:
            raise RuntimeError(f"cluster/local/start.sh failed (exit {started.returncode}):\n"
                               + started.stdout[-3000:] + started.stderr[-3000:])
        env_file = (state_dir / "env").read_text()
        if "RAY_AUTH_MODE=token" not in env_file or f"RAY_ADDRESS=127.0.0.1:{env['RAY_PORT']}" not in env_file:
            raise RuntimeError(f"start.sh wrote an unexpected {state_dir / 'env'}:\n{env_file}")
        yield LocalCluster(env=node_env, gcs_address=f"127.0.0.1:{env['RAY_PORT']}",
                           dashboard=f"http://127.0.0.1:{dashboard}", state_dir=state_dir)
    finally:
        stopped = subprocess.run(["bash", str(STOP), "--purge"], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=300)
        print(stopped.stdout, stopped.stderr)

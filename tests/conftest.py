"""Shared fixtures: one real local Ray cluster for the session, real embedded S3 endpoints."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workflows.reliability import free_port, tiny_overrides

__all__ = ["free_port", "tiny_overrides"]  # tests import these from here too

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SHARED = ROOT.parent / "shared"

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")  # as workflows.runtime sets it


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster (2 CPUs, as on CI) shared by every test that needs Ray."""
    import ray

    from workflows.runtime import _port_or_free

    if not ray.is_initialized():
        port = _port_or_free(8265)
        # as workflows.runtime.init_ray does: the state API must not auto-detect among clusters
        os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
        ray.init(num_cpus=2, logging_level=logging.WARNING, log_to_driver=False, dashboard_port=port)
        # the cluster's processes have it; commands the tests start must find their own cluster
        os.environ.pop("RAY_API_SERVER_ADDRESS")
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture
def tiny_cfg(tmp_path):
    from workflows.config import load_config

    def make(*extra: str):
        return load_config(QUICKSTART, [*tiny_overrides(tmp_path), *extra])

    return make


def run_cli(*args: str, timeout: float = 600, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The real command line, in a new process."""
    return subprocess.run([sys.executable, "-m", "workflows", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})

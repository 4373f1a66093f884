"""Run `workflows pipeline` in a fresh process against a fresh embedded store, and time it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def fresh_overrides(tmp: str | Path) -> list[str]:
    """A fresh embedded store, output directory and shard cache under `tmp`."""
    return [f"storage.embedded.data_dir={tmp}/s3", f"output_dir={tmp}/runs", f"cache.dir={tmp}/cache"]


def run_pipeline_in(tmp: str | Path, config: str, overrides: list[str]) -> tuple[float, dict]:
    """Wall seconds of the whole command (Ray start-up included) and its pipeline.json summary;
    the store, summaries and cache stay under `tmp`."""
    cmd = [sys.executable, "-m", "workflows", "pipeline", "--config", config]
    for o in [*fresh_overrides(tmp), *overrides]:
        cmd += ["--set", o]
    t0 = time.time()
    subprocess.run(cmd, check=True)
    wall = time.time() - t0
    return wall, json.loads(next(Path(tmp, "runs").glob("*/pipeline.json")).read_text())


def run_pipeline(config: str, overrides: list[str]) -> tuple[float, dict]:
    """As run_pipeline_in, in a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        return run_pipeline_in(tmp, config, overrides)

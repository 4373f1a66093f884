"""Run `workflows pipeline` in a fresh process against a fresh embedded store, and time it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_pipeline(config: str, overrides: list[str]) -> tuple[float, dict]:
    """Wall seconds of the whole command (Ray start-up included) and its pipeline.json summary."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "workflows", "pipeline", "--config", config,
               "--set", f"storage.embedded.data_dir={tmp}/s3", "--set", f"output_dir={tmp}/runs",
               "--set", f"cache.dir={tmp}/cache"]
        for o in overrides:
            cmd += ["--set", o]
        t0 = time.time()
        subprocess.run(cmd, check=True)
        wall = time.time() - t0
        summary = json.loads(next(Path(tmp, "runs").glob("*/pipeline.json")).read_text())
    return wall, summary

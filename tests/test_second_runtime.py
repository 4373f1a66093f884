"""A second runtime in one process (issue #41): a notebook that stops its runtime and starts it again,
a script that runs two stages each in a runtime of its own. What is tied to a cluster (the cache-stats
actor's handle, Ray metric objects) must be looked up again on the new cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each round: a local Ray cluster of its own (runtime() starts it and shuts it down), a store and a
# shard cache of its own, so that both rounds read their raw shards through the cache.
SCRIPT = """
import json, sys
from pathlib import Path
from tests.helpers import tiny_overrides
from workflows.config import load_config
from workflows.pipeline.stages import stage_preprocess
from workflows.runtime import runtime

tmp = Path(sys.argv[1])
for round_ in (1, 2):
    cfg = load_config("quickstart", [*tiny_overrides(tmp / f"round{round_}"), "ray.num_cpus=1", "name=twice"])
    with runtime(cfg) as rt:
        import ray
        session = ray.get_runtime_context().get_session_name()
        stage_preprocess(rt)
    summary = json.loads((tmp / f"round{round_}" / "runs" / "twice" / "preprocess.json").read_text())
    print("ROUND", json.dumps({"round": round_, "session": session, "cache": summary["shard_cache"]}), flush=True)
"""


@pytest.mark.integration
def test_a_second_runtime_in_one_process_runs_its_stage(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    rounds = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("ROUND ")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["round"] for r in rounds] == [1, 2]
    assert rounds[0]["session"] != rounds[1]["session"], "the second round must run on a new cluster"
    for r in rounds:  # each round counts its own reads: every raw shard once from the store
        assert r["cache"]["misses"] > 0 and r["cache"]["bytes_from_store"] > 0, r
    first, second = (tuple(r["cache"][k] for k in ("misses", "bytes_from_store")) for r in rounds)
    assert second == first, "the second cluster's totals start from zero: the same fetches as the first's"

"""Run by test_multinode.py in its own process: a 2-node `ray.cluster_utils.Cluster` on this
machine, each node with its own shard-cache directory (WORKFLOWS_CACHE_DIR, inherited by the
node's raylet and workers), and two preprocessing runs over the same raw shards."""

import json
import os
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import QUICKSTART, tiny_overrides  # noqa: E402
from workflows.config import load_config  # noqa: E402
from workflows.pipeline import stage_preprocess  # noqa: E402
from workflows.runtime import runtime  # noqa: E402

tmp = Path(sys.argv[1])
cluster = Cluster()
for name in ("head", "worker"):
    os.environ["WORKFLOWS_CACHE_DIR"] = str(tmp / f"cache-{name}")
    cluster.add_node(num_cpus=1)
del os.environ["WORKFLOWS_CACHE_DIR"]
cluster.wait_for_nodes()
ray.init(address=cluster.address)

out = {}
base = [*tiny_overrides(tmp), "cache.dir=auto", "data.builtin_rows_per_class=80"]
for run, extra in (("first", []), ("second", ["preprocess.max_length=24"])):
    cfg = load_config(QUICKSTART, base + extra)
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        summary = json.loads((Path(cfg.output_dir) / cfg.name / "preprocess.json").read_text())
        out[run] = {"version": data.version, "cache": summary["shard_cache"]}
out["cached_files"] = {name: len(list((tmp / f"cache-{name}" / "shards").glob("*.data"))) for name in ("head", "worker")}
print("RESULT " + json.dumps(out))
ray.shutdown()
cluster.shutdown()

"""Run by test_multinode.py in its own process: a 2-node `ray.cluster_utils.Cluster` on this
machine, each node with its own shard-cache directory (WORKFLOWS_CACHE_DIR, inherited by the
node's raylet and workers), two preprocessing runs over the same raw shards, then one read per shard."""

import json
import os
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import QUICKSTART  # noqa: E402
from tests.helpers import tiny_overrides  # noqa: E402
from workflows.config import load_config  # noqa: E402
from workflows.pipeline.stages import stage_preprocess  # noqa: E402
from workflows.preprocess.sources import list_shards  # noqa: E402
from workflows.runtime import runtime  # noqa: E402
from workflows.storage.shards import read_shards, shard_placement  # noqa: E402

tmp = Path(sys.argv[1])
cluster = Cluster()
node_names = {}
for name in ("head", "worker"):
    os.environ["WORKFLOWS_CACHE_DIR"] = str(tmp / f"cache-{name}")
    node_names[cluster.add_node(num_cpus=1).node_id] = name
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

# One shard per dataset: a single group of reads, placed on the shard's node like any other.
with runtime(cfg) as rt, rt.cache_counts() as single:
    shards, fmt = list_shards(cfg.data.source, rt.storage)
    for shard in shards:
        read_shards([shard], fmt, rt.storage, cfg.cache).materialize()
    owner = {s.uri: node_names[node] for node, group in shard_placement(shards).items() for s in group}
out["single_shard_reads"] = single
cached = {name: [json.loads(p.read_text())["uri"] for p in (tmp / f"cache-{name}" / "shards").glob("*.json")]
          for name in ("head", "worker")}
out["placement"] = {
    uri.rsplit("/", 1)[-1]: {"owner": owner[uri], "cached_on": sorted(n for n, us in cached.items() if uri in us)}
    for uri in owner
}
out["cached_files"] = {
    name: len(list((tmp / f"cache-{name}" / "shards").glob("*.data"))) for name in ("head", "worker")
}

if len(sys.argv) > 2:  # an MLflow server: a process on each node logs an epoch into one run on it
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from workflows.tracking.run_logger import RunLogger

    @ray.remote(num_cpus=1)
    def log_epoch(spec, epoch: int) -> str:
        logger = RunLogger(spec)  # as rank 0 of a Train run does
        logger.log_epoch({"epoch": epoch, "val_f1": 0.25 * (epoch + 1), "global_step": 0})
        logger.close()
        return ray.get_runtime_context().get_node_id()

    cfg = load_config(QUICKSTART, [*base, "tracking.enabled=true", f"tracking.uri={sys.argv[2]}",
                                   "tracking.experiment=multinode"])
    with runtime(cfg) as rt:
        run = rt.tracking.start("train")
        spec = run.spec()
        ids = {name: node for node, name in node_names.items()}
        placed = ray.get([
            log_epoch.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ids[name], soft=False)).remote(spec, i)
            for i, name in enumerate(("head", "worker"))
        ])
        run_id = run.id  # spec() hands workers a run key at once; the id is known once the run exists
        run.end()
    out["tracking"] = {"run_id": run_id, "nodes": [node_names[p] for p in placed]}
print("RESULT " + json.dumps(out))
ray.shutdown()
cluster.shutdown()

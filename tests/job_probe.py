"""Run as a Ray job by test_jobs.py (`ray job submit -- python tests/job_probe.py DIR`): starts Ray as
every command does (workflows.runtime.runtime, ray.address unset), runs one task, and prints a
`probe: {json}` line: the GCS address the driver is connected to, the cluster's alive nodes, the
node the task ran on."""

import json
import sys
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parent.parent  # the job's working directory: this checkout, uploaded
sys.path.insert(0, str(ROOT))
from workflows.cluster_state import alive_nodes  # noqa: E402
from workflows.config import load_config  # noqa: E402
from workflows.runtime import runtime  # noqa: E402


@ray.remote
def node_id() -> str:
    return ray.get_runtime_context().get_node_id()


tmp = Path(sys.argv[1])
cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
    "storage.embedded.enabled=false", f"storage.root={tmp}/store", f"output_dir={tmp}/runs",
    f"cache.dir={tmp}/cache", "tracking.enabled=false",
])
assert cfg.ray.address is None, cfg.ray.address
with runtime(cfg):
    task_node = ray.get(node_id.remote(), timeout=180)
    nodes = [n.node_id for n in alive_nodes()]
    print("probe:", json.dumps({"gcs": ray.get_runtime_context().gcs_address, "nodes": nodes, "task_node": task_node}))

"""Run by test_train_stream.py in its own process: an elastic training run (train.num_workers=[1, 2],
loader=stream) on a 2-node `ray.cluster_utils.Cluster` on this machine, 2 CPUs per node (a training
worker each; preprocessing needs 2 on a node). Once Ray Train has registered the epoch's step
checkpoint at 40% (the ranks wait there), the second node is removed, and with it the worker on it:
Ray Train restarts the group on the one node left, from that checkpoint. Prints RESULT {json}."""

import faulthandler
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.stream_lineage import DIGITS, ROWS, lineage, overrides  # noqa: E402
from workflows.config import load_config  # noqa: E402
from workflows.loader import epoch_order, parquet_index  # noqa: E402
from workflows.pipeline.stages import stage_preprocess  # noqa: E402
from workflows.runtime import runtime  # noqa: E402
from workflows.train.stream_input import SampleRecorder, head  # noqa: E402
from workflows.train.trainer import fit  # noqa: E402

tmp = Path(sys.argv[1])
# Ray Train's elastic policy sizes a restart from the cluster view of the autoscaling coordinator,
# refreshed on its own tick: right after the node goes, it still counts 2 workers, and that start
# waits for resources until this timeout (measured: "The worker group startup timed out after 60.0
# seconds waiting for 2 workers", then "Detected ready resources for 1 workers"). Shorter here;
# the cluster's processes inherit it.
os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "20"
cluster = Cluster()
cluster.add_node(num_cpus=2)
second = cluster.add_node(num_cpus=2)
cluster.wait_for_nodes()
ray.init(address=cluster.address)

record = tmp / "elastic"
record.mkdir()
marker = tmp / "second-node-removed"
removed: dict = {}


class HoldPastTheFirstCheckpoint:
    """The run's on_step hook: a two-worker rank waits before its step after the 40% checkpoint (step 2 of
    5) until the second node is gone, so the node goes at one point of the epoch on a quiet or a loaded
    machine, not wherever the ranks had got to. A wait is bounded: a run whose node never goes still ends."""

    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, rank: int, epoch: int, step: int) -> None:
        import ray.train

        if ray.train.get_context().get_world_size() == 2 and epoch == 0 and step >= 2:
            deadline = time.time() + 300
            while not os.path.exists(self.marker) and time.time() < deadline:
                time.sleep(0.05)


def registered_checkpoints(runs_root: str, storage) -> int:
    """How many checkpoints Ray Train's controller has registered for the run (its checkpoint manager's
    snapshot, written once every rank has reported one): the node goes only after that, or the restart
    would begin the epoch again."""
    from workflows.storage.uri import filesystem

    fs, root = filesystem(runs_root, storage)
    fs.invalidate_cache()  # s3fs keeps listings: the run's folder and its snapshot appear while this polls
    for snapshot in fs.glob(f"{root}/elastic-*/checkpoint_manager_snapshot.json"):
        return len(json.loads(fs.cat_file(snapshot)).get("checkpoint_results") or [])
    return 0


def remove_second_node_at_the_first_checkpoint(runs_root: str, storage) -> None:
    """The second node goes once the controller has registered the 40% checkpoint (the ranks wait for it
    there: HoldPastTheFirstCheckpoint); then the marker lets the ranks, or the restarted one, go on."""
    deadline = time.time() + 900
    try:
        while time.time() < deadline:
            if registered_checkpoints(runs_root, storage):
                cluster.remove_node(second)
                removed["at"] = time.time()
                return
            time.sleep(0.2)
    finally:
        marker.touch()


def diagnose_and_exit_past(seconds: float) -> None:
    """A run that has not finished after `seconds` (a normal one takes 1.5-3 minutes) prints what each
    process is doing (the cluster's nodes, live actors and placement groups, py-spy stacks of the Train
    controller, the workers and the autoscaling coordinator, this driver's threads) and exits 3: a hang
    fails the test in minutes with its cause, instead of running into the test's own timeout."""
    time.sleep(seconds)
    print(f"HANG the run had not finished after {seconds:.0f} s", flush=True)
    try:
        from ray._private.state import actors as actor_table  # the GCS's own table: no dashboard here

        print("HANG nodes " + json.dumps([(n["NodeID"][:8], n["Alive"]) for n in ray.nodes()]), flush=True)
        live = [a for a in actor_table().values() if a["State"] != "DEAD"]
        for a in live:
            print(f"HANG actor {a['ActorClassName']} {a['State']} node={a['Address']['NodeID'][:8]} pid={a['Pid']}",
                  flush=True)
        for pg_id, pg in ray.util.placement_group_table().items():
            print(f"HANG placement group {pg_id[:8]} {pg['state']} {pg['bundles']}", flush=True)
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        for a in live:
            if a["Pid"] and any(k in a["ActorClassName"] for k in ("Controller", "Worker", "Autoscaling", "Coord")):
                stacks = subprocess.run([spy, "dump", "--pid", str(a["Pid"])], capture_output=True, text=True,
                                        timeout=30)
                print(f"HANG stacks of {a['ActorClassName']} pid={a['Pid']}\n{stacks.stdout}{stacks.stderr}",
                      flush=True)
    except Exception as e:  # diagnostics must not mask the hang itself
        print(f"HANG diagnostics failed: {e!r}", flush=True)
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
    sys.stdout.flush()
    threading.Timer(60, os._exit, args=(3,)).start()  # should the shutdown itself hang
    try:
        ray.shutdown()  # the driver first: the cluster refuses to remove the node a driver is connected to
        cluster.shutdown()
    finally:
        os._exit(3)


threading.Thread(target=diagnose_and_exit_past, args=(float(os.environ.get("ELASTIC_RUN_WATCHDOG_S", 480)),),
                 daemon=True).start()
try:
    elastic = ["train.num_workers=[1,2]", "train.cpus_per_worker=2", "train.max_failures=3"]
    cfg = load_config(DIGITS, overrides(tmp, *elastic))
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        index = head(parquet_index(data.files["train"], rt.storage), ROWS)
        expected = epoch_order(index.counts, cfg.train.seed, 0, cfg.train.shuffle_window).tolist()
        watcher = threading.Thread(target=remove_second_node_at_the_first_checkpoint,
                                   args=(cfg.uri("runs"), rt.storage), daemon=True)
        watcher.start()
        out = fit(cfg, rt.storage, data, run_prefix="elastic", on_samples=SampleRecorder(str(record)),
                  on_step=HoldPastTheFirstCheckpoint(str(marker)))
finally:
    ray.shutdown()
    cluster.shutdown()
ranks_per_attempt = []
for f in sorted(record.glob("samples-*.jsonl")):
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    ranks_per_attempt.append({"file": f.name, "first_t": rows[0]["t"], "positions": [r["position"] for r in rows]})
print("RESULT " + json.dumps({"removed": "at" in removed, "expected": expected, "lineage": lineage(record),
                              "files": ranks_per_attempt, "history": out.history}, default=str))

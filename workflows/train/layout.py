"""`train.num_workers: auto`: the training workers the platform chooses for the cluster it finds.

- GPUs (train.use_gpu): one worker per GPU of the cluster, data-parallel (FSDP or DDP).
- One node of CPUs: one worker with every CPU free on it, a thread per core, training the plain model
  (a group of one has nothing to shard or reduce). Measured on the quickstart's model on 2 cores
  (`workflows bench train`, docs/BENCHMARKS.md "Training"): 17% less per epoch than two single-core FSDP2
  workers at the same global batch, while two single-core DDP workers took 6% less than it (one run each).
- Several nodes of CPUs: one worker per node, each with the CPUs free on the node that has the fewest
  (the workers are alike), FSDP or DDP across them.

A number or an elastic [min, max] in the config is used as it is.
"""

from __future__ import annotations

from workflows.cluster_state import available_per_node
from workflows.config import WorkflowConfig
from workflows.errors import UserError

AUTO = "auto"


def resolved(cfg: WorkflowConfig) -> tuple[WorkflowConfig, str | None]:
    """(`cfg` with train.num_workers and cpus_per_worker chosen for the Ray cluster when num_workers is auto,
    else as given; why, in words, when chosen)."""
    if cfg.train.num_workers != AUTO:
        return cfg, None
    update, why = choose(cfg.train, available_per_node())
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=update)}), why


def choose(tc, nodes: list[dict]) -> tuple[dict, str]:
    """(the train settings auto sets, why) for `nodes`, each node's free resources ({"CPU": 2, "GPU": 1}).
    A worker runs a thread per CPU it holds, up to its machine's cores (worker_setup.set_torch_threads)."""
    if tc.use_gpu:
        gpus = sum(int(n.get("GPU", 0)) for n in nodes)
        if gpus < 1:
            raise UserError("train.num_workers is auto and train.use_gpu is set, but the Ray cluster has no GPU free")
        return {"num_workers": gpus}, f"one worker per GPU of the cluster ({gpus})"
    free = [int(n.get("CPU", 0)) for n in nodes if int(n.get("CPU", 0)) >= 1]
    if not free:
        raise UserError("train.num_workers is auto, but no node of the Ray cluster has a CPU free; set "
                        "train.num_workers and train.cpus_per_worker")
    cpus = min(free)
    update = {"num_workers": len(free), "cpus_per_worker": float(cpus)}
    if len(free) == 1:
        return update, (f"one worker with the {cpus} CPUs free on the node, a thread per core (one node: no "
                        "gradients to exchange between workers)")
    return update, f"one worker per node ({len(free)}), {cpus} CPUs each"


def described(tc, why: str | None) -> str:
    """The layout as the train line says it: workers, CPUs each, strategy, and why when auto chose it."""
    return (f"{tc.num_workers} worker(s) x {tc.cpus_per_worker:g} CPU, {tc.strategy}"
            + (f" (num_workers auto: {why})" if why else ""))


def layout_summary(tc, why: str | None) -> dict:
    """The layout as the train stage's summary keeps it."""
    return {"num_workers": tc.num_workers, "cpus_per_worker": tc.cpus_per_worker, "why": why}



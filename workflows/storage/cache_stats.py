"""Shard-cache counters gathered from every Ray task on every node.

Each read task counts in its own process; it adds its delta to one named actor (so a stage can put
cluster-wide totals in its JSON summary) and to Ray metrics (Prometheus, via Ray's metrics agent).
"""

from __future__ import annotations

import dataclasses

from workflows.cluster_scoped import per_cluster

ACTOR_NAME = "workflows-cache-stats"
FIELDS = ("hits", "misses", "bytes_from_store", "bytes_from_cache", "evictions")


def _actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class CacheStatsActor:
        def __init__(self):
            self.totals = dict.fromkeys(FIELDS, 0)

        def add(self, delta: dict) -> None:
            for k in FIELDS:
                self.totals[k] += int(delta.get(k, 0))

        def snapshot(self) -> dict:
            return dict(self.totals)

    return CacheStatsActor


@per_cluster
def tracker():
    """The cluster's stats actor, created on first use by the driver, which keeps the handle
    (a named actor without a handle held anywhere is collected at once); another handle once the
    process is on another cluster (workflows.cluster_scoped)."""
    return _actor_class().options(name=ACTOR_NAME, get_if_exists=True).remote()


def snapshot() -> dict:
    import ray

    return ray.get(tracker().snapshot.remote())


def delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in FIELDS}


@per_cluster
def _counters() -> dict:
    from ray.util.metrics import Counter

    return {k: Counter(f"workflows_cache_{k}", description=f"shard cache {k.replace('_', ' ')}") for k in FIELDS}


def report(before, after) -> None:
    """From a Ray task: add this task's counts (CacheStats before/after) to the cluster totals."""
    import ray

    d = delta(dataclasses.asdict(before), dataclasses.asdict(after))
    if not any(d.values()):
        return
    for k, v in d.items():
        if v:
            _counters()[k].inc(v)
    try:
        actor = ray.get_actor(ACTOR_NAME)
    except ValueError:
        return  # nobody asked for totals
    try:
        ray.get(actor.add.remote(d))
    except ray.exceptions.RayActorError:
        # the totals' actor went down with its node (an elastic run losing one): the read itself
        # succeeded and its counts are in the metrics above; failing it would fail training
        pass

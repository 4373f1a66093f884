"""Shard-cache counters gathered from every Ray task on every node.

Each read task counts in its own process; it adds its delta to one named actor (so a stage can put
cluster-wide totals in its JSON summary) and to Ray metrics (Prometheus, via Ray's metrics agent).
"""

from __future__ import annotations

import dataclasses

ACTOR_NAME = "workflows-cache-stats"
FIELDS = ("hits", "misses", "bytes_from_store", "bytes_from_cache", "evictions")
_metrics: dict | None = None


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


_tracker = None


def tracker():
    """The cluster's stats actor, created on first use by the driver, which keeps the handle
    (a named actor without a handle held anywhere is collected at once)."""
    global _tracker
    if _tracker is None:
        _tracker = _actor_class().options(name=ACTOR_NAME, get_if_exists=True).remote()
    return _tracker


def snapshot() -> dict:
    import ray

    return ray.get(tracker().snapshot.remote())


def delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in FIELDS}


def _counters() -> dict:
    global _metrics
    if _metrics is None:
        from ray.util.metrics import Counter

        _metrics = {
            k: Counter(f"workflows_cache_{k}", description=f"shard cache {k.replace('_', ' ')}") for k in FIELDS
        }
    return _metrics


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

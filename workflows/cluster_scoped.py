"""Objects tied to one Ray cluster (an actor's handle, Ray metric objects), kept per process and made
again when the process is connected to another cluster.

A process can start a second runtime: a notebook that stops its runtime and starts it again, a script
that runs two stages each in a runtime of its own, `make reliability`'s rows in one process. A handle
kept in a module global from the first cluster then names an actor that is gone ("Can't find actor
... from a different cluster"), and metric objects were registered with the first cluster's core
worker. Functools' caches know nothing of clusters, so the key here is the cluster's session (new at
every cluster start) and the job (a driver that reconnects to the same cluster is a new job, and the
actors its last job owned are gone with that job).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def cluster_key() -> tuple[str, str]:
    """(session, job) of the cluster this process is connected to."""
    import ray

    ctx = ray.get_runtime_context()
    return ctx.get_session_name(), ctx.get_job_id()


class PerCluster(Generic[T]):
    """`factory()` once per cluster this process is connected to; call the instance to get it."""

    def __init__(self, factory: Callable[[], T]):
        self.factory = factory
        self._key: tuple[str, str] | None = None
        self._value: T | None = None
        functools.update_wrapper(self, factory)

    def __call__(self) -> T:
        key = cluster_key()
        if self._value is None or key != self._key:
            self._value, self._key = self.factory(), key
        return self._value


def per_cluster(factory: Callable[[], T]) -> PerCluster[T]:
    return PerCluster(factory)

"""Draining before Serve shuts down, for `workflows serve` stopped by a signal.

`serve.shutdown()` kills the proxies while the replicas stop, so a request in flight at that
moment loses its connection. The serve command therefore drains first: it creates a `Drain`
actor; each replica finds it at start-up and waits on it (one pending call, no polling). On stop,
every replica answers new /predict requests 503 with `Connection: close` (clients drop their
keep-alive connections), finishes the requests it holds, and reports when it has none left; then
Serve is shut down. Replicas deployed without the command (`serve run`, a RayService) find no
`Drain` actor and skip this: Serve's own graceful shutdown applies there.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import ray

NAME, NAMESPACE = "workflows-serve-drain", "workflows"


@ray.remote(num_cpus=0, max_concurrency=1000)
class Drain:
    def __init__(self) -> None:
        # Ctrl-C in a terminal signals the whole process group (systemd's default SIGTERMs the whole
        # cgroup), this worker too: it must outlive the drain; it dies with its owner, the command.
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:  # not on the main thread
            pass
        self._stop = asyncio.Event()
        self._replicas: dict[str, int | None] = {}  # replica -> requests left when drained (None: draining)

    async def register(self, replica: str) -> None:
        self._replicas[replica] = None

    async def wait_stop(self) -> None:
        await self._stop.wait()

    async def stop(self) -> None:
        self._stop.set()

    async def drained(self, replica: str, answered: int) -> None:
        self._replicas[replica] = answered

    async def state(self) -> dict:
        return dict(self._replicas)


def create() -> ray.actor.ActorHandle:
    actor: Any = Drain  # an actor class (ray.remote), which mypy sees as the plain class
    return actor.options(name=NAME, namespace=NAMESPACE, get_if_exists=True, lifetime=None).remote()


def drain(actor, timeout_s: float = 10.0) -> dict:
    """Tell every replica to drain; wait until all report no request in flight (or `timeout_s`).
    Returns {"replicas", "drained", "in_flight_answered", "seconds"}, and "error" where the stop did not reach
    the replicas or the actor failed."""
    t0 = time.time()
    state: dict = {}
    error, stopped = None, False
    try:
        ray.get(actor.stop.remote(), timeout=timeout_s)
        stopped = True
        # each wait bounded by what is left of timeout_s, as the stop's: the command stops even where the
        # actor no longer answers (the replicas not drained by then are reported as such)
        while (left := timeout_s - (time.time() - t0)) > 0:
            state = ray.get(actor.state.remote(), timeout=left)
            if all(v is not None for v in state.values()):
                break
            time.sleep(0.1)
    except ray.exceptions.RayError as e:  # Serve still shuts down gracefully, without the 503s first
        if not (stopped and isinstance(e, ray.exceptions.GetTimeoutError)):
            error = type(e).__name__
    done = [v for v in state.values() if v is not None]
    return {"replicas": len(state), "drained": len(done), "in_flight_answered": sum(done),
            "seconds": round(time.time() - t0, 2), **({"error": error} if error else {})}


async def watch(server, replica: str) -> None:
    """In a replica: wait for the stop, then set `server.stopping` and report once nothing is in flight."""
    try:
        actor = ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:  # not started by `workflows serve`
        return
    try:
        await actor.register.remote(replica)
        await actor.wait_stop.remote()
        server.stopping = True
        answered = server.in_flight
        while server.in_flight:
            await asyncio.sleep(0.02)
        await actor.drained.remote(replica, answered)
    except ray.exceptions.RayError:  # the command died without stopping: nothing to drain for
        return

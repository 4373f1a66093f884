"""workflows.serve.drain, as `workflows serve` stops: its waits end within the drain's timeout."""

from __future__ import annotations

import threading
import time


def test_a_drain_whose_actor_stops_answering_ends_within_its_timeout(ray_cluster):
    """The Drain actor took the stop, then answers nothing more (its process stuck, its node overloaded):
    the drain still returns after its timeout, the replicas counted as not drained, instead of holding
    the command's Ctrl-C up forever."""
    from workflows.serve import drain

    @ray_cluster.remote(num_cpus=0)
    class Unanswering:
        def stop(self) -> None:
            pass

        def state(self) -> dict:
            time.sleep(600)
            return {}

    actor = Unanswering.remote()
    ray_cluster.get(actor.__ray_ready__.remote(), timeout=300)  # up: the stop itself is answered
    report: dict = {}
    stopper = threading.Thread(target=lambda: report.update(drain.drain(actor, timeout_s=2)), daemon=True)
    try:
        stopper.start()
        stopper.join(60)
        assert not stopper.is_alive(), "the drain still waits on an actor that does not answer"
        assert report["seconds"] < 30 and report["drained"] == report["replicas"] == 0, report
        assert "error" not in report, report  # the stop reached it: a timeout, not a failure
    finally:
        ray_cluster.kill(actor)

"""What the connected Ray cluster has (its alive nodes, their resources), asked of the GCS with a deadline.

`ray.nodes()`, `ray.cluster_resources()` and `ray._private.state.available_resources_per_node()` go
through the driver's GlobalStateAccessor, a second GCS client whose calls wait on a future with no
deadline: a request lost on the way leaves the calling thread blocked for ever, inside C++ where no
signal reaches it (a long-lived driver, our test run among them, met it after ~1,600 calls). Here the
core worker's own GCS client asks instead, each call with a timeout, retried once, then a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TIMEOUT_S = 30.0
ATTEMPTS = 2


class ClusterUnreachable(RuntimeError):
    """The GCS did not answer a query within its deadline, twice."""


@dataclass(frozen=True)
class Node:
    node_id: str  # hex, as ray.get_runtime_context().get_node_id() gives it
    address: str
    metrics_export_port: int
    resources: dict[str, float] = field(default_factory=dict)  # the node's totals


def _ask(what: str, call):
    import ray

    worker = ray._private.worker.global_worker
    last: Exception | None = None
    for _ in range(ATTEMPTS):
        try:
            return call(worker.gcs_client, TIMEOUT_S)
        except Exception as e:  # a timeout or a lost connection: Ray raises several kinds, all retried once
            last = e
    raise ClusterUnreachable(
        f"Ray's GCS at {worker.gcs_client.address} did not answer {what} within {TIMEOUT_S:g} s "
        f"({ATTEMPTS} tries): {last}"
    ) from last


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes, by node id."""
    from ray._raylet import NodeID
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    infos = _ask("its node table", lambda gcs, t: gcs.get_all_node_info(timeout=t))
    nodes = [
        Node(NodeID(i.node_id).hex(), i.node_manager_address, i.metrics_export_port, dict(i.resources_total))
        for i in infos.values()
        if i.state == GcsNodeInfo.ALIVE
    ]
    return sorted(nodes, key=lambda n: n.node_id)


def metric_samples(prefix: str) -> list[dict]:
    """The Prometheus samples named `prefix`* that every alive node exports now (its metrics export
    port): {name, labels, value, node} each."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    rows = []
    for node in alive_nodes():
        text = requests.get(f"http://{node.address}:{node.metrics_export_port}/metrics", timeout=10).text
        rows += [{"name": s.name, "labels": s.labels, "value": s.value, "node": node.address}
                 for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name.startswith(prefix)]
    return rows


def cluster_resources() -> dict[str, float]:
    """The alive nodes' resources summed, as ray.cluster_resources() gives them."""
    total: dict[str, float] = {}
    for node in alive_nodes():
        for name, amount in node.resources.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def available_per_node() -> list[dict[str, float]]:
    """The resources free now on each alive node (what a worker group can get), as Ray's
    available_resources_per_node() gives them."""
    reply = _ask("its resource usage", lambda gcs, t: gcs.get_all_resource_usage(timeout=t))
    return [dict(usage.resources_available) for usage in reply.resource_usage_data.batch]

"""The `ray` section: which Ray cluster a command joins or starts (`cluster_address`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pydantic import Field

from workflows.config.base import Strict

if TYPE_CHECKING:
    from workflows.config.workflow import WorkflowConfig


class RayConfig(Strict):
    address: str | None = Field(
        None,
        description="Ray cluster to join ('auto', host:port, ray://...); 'local' starts a cluster of the command's "
        "own; None joins RAY_ADDRESS's cluster where it is set and not 'local' (`ray job submit` sets it), "
        "else starts a local one",
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a newly started local cluster")
    dashboard: bool = Field(
        True,
        description="start Ray's dashboard with a local cluster; false: fewer processes for a one-node "
        "`workflows serve` (train, tune and `bench serve` need it: Ray Train V2 and the state API use it)",
    )
    dashboard_port: int | None = Field(
        None, ge=0, le=65535,
        description="port of a local cluster's dashboard (a free one instead when it is taken; 0: any free port); "
        "None: $WORKFLOWS_DASHBOARD_PORT where set, else Ray's 8265",
    )


def cluster_address(cfg: WorkflowConfig) -> str | None:
    """The running cluster a command joins, or None to start a local cluster of its own: ray.address
    if set ("local" starts one), else RAY_ADDRESS if set and not "local" (`ray job submit` sets it
    in a job's driver to the cluster's GCS address; cluster/local/start.sh's env file exports it),
    joined as ray.address=auto would."""
    if cfg.ray.address:
        return None if cfg.ray.address == "local" else cfg.ray.address
    env = os.environ.get("RAY_ADDRESS", "")
    return env if env and env != "local" else None

"""`ray job submit` against a real multi-node cluster: `cluster/local/start.sh` starts a head and a
worker node (separate `ray start`s with their own raylets, object stores and shard caches, token
auth on); a job uploaded with `cluster/runtime-env.yaml` runs in the nodes' environment, and only
with the cluster's token. Stopped with `stop.sh`."""

import sys
import uuid
from pathlib import Path

import pytest

from reliability.local_cluster import local_cluster, ray_cli
from reliability.secrets import ray_token_auth_checks


@pytest.mark.slow
def test_job_submission_on_local_multinode_cluster_needs_its_token(tmp_path):
    with local_cluster(tmp_path / "cluster", workers=1, head_cpus=1) as cluster:
        env, address = cluster.env, cluster.dashboard
        submit = [
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            ".",
            "--runtime-env",
            "cluster/runtime-env.yaml",
        ]

        # Token auth guards job submission: without the cluster's token, or with another, the Jobs
        # API and `ray job submit` refuse (the same checks as the secrets_hygiene reliability row).
        auth = ray_token_auth_checks(cluster, tmp_path / "auth")
        assert auth["checked"] >= 6 and not auth["wrong"] and not auth["errors"], auth

        # One job, which prints the `python` it runs: the environment that holds `ray` (start.sh puts it
        # first on PATH). The pipeline as a Ray job on this kind of cluster is the README's cluster
        # block, run by tests/test_readme.py.
        entrypoint = "python -c \"import sys; print('job python:', sys.executable)\""
        job_id = f"workflows-test-{uuid.uuid4().hex[:8]}"
        res = ray_cli([*submit, "--submission-id", job_id, "--", "bash", "-c", entrypoint], env, 300)
        status = ray_cli(["job", "status", "--address", address, job_id], env, 120)
        logs = ray_cli(["job", "logs", "--address", address, job_id], env, 120).stdout
        # `ray job submit` exits 0 for a job that was stopped or lost too: ask for the final status
        assert res.returncode == 0 and f"job '{job_id}' succeeded" in status.stdout.lower(), (
            status.stdout[-500:] + status.stderr[-500:] + "\n" + logs[-6000:]
        )
        line = next((ln for ln in logs.splitlines() if ln.startswith("job python: ")), None)
        assert line and Path(line.split(": ", 1)[1]).parent == Path(sys.executable).parent, line

"""`ray job submit` against a real multi-node cluster: `cluster/local/start.sh` starts a head and a
worker node (separate `ray start`s with their own raylets, object stores and shard caches, token
auth on), and the tiny quickstart pipeline runs as a Ray job uploaded with
`cluster/runtime-env.yaml`; its driver runs the embedded S3 endpoint. Stopped with `stop.sh`."""

import json
import shlex
import sys
import uuid
from pathlib import Path

import pytest

from reliability.local_cluster import local_cluster, ray_cli
from reliability.secrets import ray_token_auth_checks
from tests.helpers import tiny_overrides


@pytest.mark.slow
def test_pipeline_as_ray_job_on_local_multinode_cluster(tmp_path):
    out = tmp_path / "job"
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

        # One job: its entrypoint first prints which `python` it runs (the environment that holds
        # `ray`: start.sh puts it first on PATH), then runs the pipeline with that `python`.
        sets = [
            *tiny_overrides(out),
            "ray.address=auto",
            "cache.dir=auto",
            "serve.enabled=false",
            "tune.num_samples=1",
            "tune.max_epochs=1",
        ]  # tuning itself is tested in test_tune.py
        pipeline = shlex.join(
            [
                "python",
                "-m",
                "workflows",
                "pipeline",
                "--config",
                "configs/quickstart.yaml",
                *[a for s in sets for a in ("--set", s)],
            ]
        )
        entrypoint = f"python -c \"import sys; print('job python:', sys.executable)\" && {pipeline}"
        job_id = f"workflows-test-{uuid.uuid4().hex[:8]}"
        res = ray_cli([*submit, "--submission-id", job_id, "--", "bash", "-c", entrypoint], env, 900)
        status = ray_cli(["job", "status", "--address", address, job_id], env, 120)
        logs = ray_cli(["job", "logs", "--address", address, job_id], env, 120).stdout
        # `ray job submit` exits 0 for a job that was stopped or lost too: ask for the final status
        assert res.returncode == 0 and f"job '{job_id}' succeeded" in status.stdout.lower(), (
            status.stdout[-500:] + status.stderr[-500:] + "\n" + logs[-6000:]
        )

        line = next((ln for ln in logs.splitlines() if ln.startswith("job python: ")), None)
        assert line and Path(line.split(": ", 1)[1]).parent == Path(sys.executable).parent, line
        for stage in ["data:", "preprocess:", "tune:", "train:", "evaluate:", "pipeline: done"]:
            assert f"workflows {stage}" in logs, stage
        assert "registered quickstart:v1" in logs and "majority baseline" in logs
        runs = out / "runs" / "quickstart"
        for stage in ["preprocess", "tune", "train", "pipeline"]:
            assert (runs / f"{stage}.json").exists(), stage
        summary = json.loads((runs / "pipeline.json").read_text())
        assert summary["model"] == {"name": "quickstart", "version": 1, "uri": "s3://workflows/models/quickstart/v1"}
        assert summary["tune"]["trials"] == 1 and "serve" not in summary
        assert summary["config"]["ray"]["address"] == "auto"
        # cache.dir=auto: the nodes cached the shards they read in their own WORKFLOWS_CACHE_DIR
        cached = {
            node: len(list((cluster.state_dir / node / "cache" / "shards").glob("*.data")))
            for node in ("head", "worker-1")
        }
        assert sum(cached.values()) > 0, cached
        print("job stage seconds:", summary["seconds"], "cached shards per node:", cached)

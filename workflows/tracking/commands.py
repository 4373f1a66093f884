"""`workflows runs` (recent runs of the config's experiment) and `workflows ui` (MLflow's server and UI
on the configured store, its artifacts read from the configured object store)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from workflows.errors import UserError
from workflows.tracking.store import check_reachable, http_defaults, one_line, redact_uri, resolve_uri

# the metrics `runs` shows, in this order, where a run has them
KEY_METRICS = ("weighted_f1", "best_val_f1", "val_f1", "val_accuracy", "train_loss", "best_val_loss", "rows_train")


def _duration(start: int | None, end: int | None) -> str:
    if not start:
        return "-"
    seconds = ((end or time.time() * 1000) - start) / 1000
    return f"{seconds / 60:.1f}m" if seconds >= 120 else f"{seconds:.0f}s"


def recent_runs(cfg, limit: int = 20) -> list[dict]:
    """The newest `limit` runs of the config's experiment (name, status, key metrics, duration);
    children after their parent."""
    uri = resolve_uri(cfg)
    if uri.startswith("sqlite:") and not Path(uri.split(":///", 1)[-1]).exists():
        return []  # nothing tracked with this config yet
    http_defaults()
    try:
        check_reachable(uri, create=False)
    except Exception as e:
        raise UserError(f"tracking store {redact_uri(uri)}: {one_line(e)}") from None
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment or cfg.name)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=limit)
    rows = []
    for r in runs:
        metrics = r.data.metrics
        rows.append({
            "run_id": r.info.run_id,
            "name": r.info.run_name,
            "parent": r.data.tags.get("mlflow.parentRunId"),
            "status": r.info.status,
            "started": datetime.fromtimestamp(r.info.start_time / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "duration": _duration(r.info.start_time, r.info.end_time),
            "metrics": {k: metrics[k] for k in KEY_METRICS if k in metrics},
            "stopped_early": r.data.tags.get("tune.stopped_early") == "true",
        })
    by_id = {r["run_id"]: r for r in rows}
    ordered: list[dict] = []

    def add(row: dict, depth: int) -> None:
        ordered.append({**row, "depth": depth})
        for child in reversed([c for c in rows if c["parent"] == row["run_id"]]):  # oldest child first
            add(child, depth + 1)

    for row in rows:
        if row["parent"] not in by_id:
            add(row, 0)
    return ordered


def format_runs(rows: list[dict]) -> str:
    lines = [f"{'started (UTC)':<19}  {'run':<30} {'status':<9} {'duration':>8}  key metrics"]
    for r in rows:
        name = ("  " * r["depth"] + (r["name"] or r["run_id"][:8]))[:30]
        metrics = ", ".join(f"{k} {v:.4g}" for k, v in r["metrics"].items())
        status = r["status"] + ("*" if r["stopped_early"] else "")
        lines.append(f"{r['started']:<19}  {name:<30} {status:<9} {r['duration']:>8}  {metrics}")
    if any(r["stopped_early"] for r in rows):
        lines.append("* a tune trial that ASHA stopped early")
    return "\n".join(lines)


def ui_available() -> bool:
    """mlflow-skinny serves the REST API only; the web UI's built assets come with the full package's
    files, which `make install` adds."""
    import mlflow.server

    return os.path.isfile(os.path.join(os.path.dirname(mlflow.server.__file__), "js", "build", "index.html"))


def server_command(backend_uri: str, host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri,
            "--host", host, "--port", str(port), "--workers", "1"]


def server_env(storage) -> dict[str, str]:
    """The server reads run artifacts from the configured object store (S3 endpoint, embedded key)."""
    from workflows.storage.uri import EMBEDDED_KEY

    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job workers
    if storage.endpoint_url:
        env["MLFLOW_S3_ENDPOINT_URL"] = storage.endpoint_url
    if storage.embedded:  # moto accepts any key; not a secret
        env.update(AWS_ACCESS_KEY_ID=EMBEDDED_KEY, AWS_SECRET_ACCESS_KEY=EMBEDDED_KEY)
    return env


def run_ui(rt, host: str, port: int, say) -> int:
    """MLflow's server on the configured SQLite store until Ctrl-C; for an http:// store, its address."""
    uri = resolve_uri(rt.cfg)
    if uri.startswith(("http://", "https://")):
        say(f"ui: the tracking server serves its own UI: {redact_uri(uri)}")
        return 0
    if not ui_available():
        from importlib.metadata import version

        say("ui: MLflow's web pages are not installed (mlflow-skinny serves the REST API only); `make install` "
            f"adds them, or pip install --no-deps mlflow=={version('mlflow-skinny')} (README, Experiment tracking)")
    proc = subprocess.Popen(server_command(uri, host, port), env=server_env(rt.storage))
    say(f"ui: MLflow on http://{host}:{port} (store {uri}); Ctrl-C to stop")

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # as Ctrl-C: the server stops, then the embedded endpoint
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(30)
        return 0

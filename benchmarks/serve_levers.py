"""Ray Serve against its peer (workflows.bench.serve_peer), and the levers that close the gap
(`python -m benchmarks.serve_levers`): each lever against the peer with `compare`
(workflows.bench.serve_load).

`levers` starts `workflows serve` once per variant, in a process of its own (Ray's Serve flags
are environment variables read when its processes start, so each variant needs a fresh cluster),
compares it with the peer, and stops it with SIGTERM (recording how long the clean stop took).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from workflows.bench.serve_load import compare
from workflows.net import free_port

# (name, what it changes, environment, --set overrides); the default row first
LEVERS = [
    ("HAProxy ingress (default)", "serve.haproxy=auto: HAProxy where its binary is installed (Linux)", {}, []),
    ("Python proxy", "serve.haproxy=false: Serve's proxy actor in front of the replicas", {},
     ["serve.haproxy=false"]),
    ("Python proxy + gRPC proxy -> replica", "serve.haproxy=false, RAY_SERVE_USE_GRPC_BY_DEFAULT=1",
     {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}, ["serve.haproxy=false"]),
    ("model call in a thread", "serve.model_in_thread=true", {}, ["serve.model_in_thread=true"]),
    ("access log off", "serve.access_log=false (no line per request in the proxy and replica logs)", {},
     ["serve.access_log=false"]),
    ("throughput-optimized", "RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (gRPC, direct ingress, no separate user loop)",
     {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}, []),
    ("fewer Ray processes", "ray.dashboard=false (no dashboard process)", {}, ["ray.dashboard=false"]),
]


class ServeProcess:
    """`workflows serve` in a new process with extra environment and overrides; SIGTERMed on exit."""

    def __init__(self, spec: str, config: str, overrides: list[str], env: dict, port: int, log: Path):
        sets = [a for o in [*overrides, f"serve.port={port}"] for a in ("--set", o)]
        self.args = [sys.executable, "-m", "workflows", "serve", "--model", spec, "--config", config, *sets]
        self.env, self.url, self.log = {**os.environ, **env}, f"http://127.0.0.1:{port}", log
        self.stop: dict = {}

    def __enter__(self) -> ServeProcess:
        import requests

        with open(self.log, "w") as sink:
            self.proc = subprocess.Popen(self.args, stdout=sink, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        deadline = time.time() + 600
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if requests.get(f"{self.url}/healthz", timeout=5).ok:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"workflows serve did not come up: {self.log.read_text()[-2000:]}")

    def __exit__(self, *exc) -> None:
        t0 = time.time()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        self.stop = {"exit_code": rc, "seconds": round(time.time() - t0, 1)}


def levers(spec: str, config: str, overrides: list[str], peer_url: str, rows: list[dict], logs: Path,
           reps: int = 5) -> list[dict]:
    logs.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (name, change, env, extra) in enumerate(LEVERS):
        row: dict = {"lever": name, "change": change}
        try:
            with ServeProcess(spec, config, [*overrides, *extra], env, free_port(), logs / f"lever-{i}.log") as sp:
                row.update(compare(sp.url, peer_url, rows, reps))
            row["stop"] = sp.stop
        except RuntimeError as e:  # a lever that does not start here is a result too
            row["error"] = str(e).splitlines()[-1][:300] if str(e) else "failed"
        out.append(row)
    return out


GOALS = {"serve_vs_peer_throughput": 0.9, "p50_over_peer_ms": 3.0}


def run(config: str | None, overrides: list[str]) -> dict:
    from workflows import registry
    from workflows.bench.serve_peer import Peer
    from workflows.config import load_config
    from workflows.dataset import ProcessedDataset
    from workflows.pipeline.stages import demo_rows
    from workflows.runtime import runtime

    config = config or "configs/quickstart.yaml"
    overrides = [*overrides, "serve.max_batch_size=32", "serve.num_replicas=1", "serve.autoscaling=null"]
    cfg = load_config(config, overrides)
    logs = Path(cfg.output_dir) / cfg.name / "logs" / "bench-serve-levers"
    with runtime(cfg, ray_needed=False) as rt:
        ref = registry.resolve(cfg, rt.storage, os.environ.get("WORKFLOWS_BENCH_SERVE_MODEL", "quickstart"))
        spec = f"{ref.name}:{ref.version}"
        model_dir, _ = registry.fetch(cfg, rt.storage, spec)
        card = registry.model_card(cfg, rt.storage, spec)
        rows = demo_rows(ProcessedDataset.load((card.lineage or {})["dataset_uri"], rt.storage), rt, 256)
        threads = max(1, int(cfg.serve.cpus_per_replica))
        with Peer(model_dir, free_port(), threads, cfg.serve.max_batch_size, spec, logs / "peer.log") as peer:
            rows_out = levers(spec, config, overrides, peer.url, rows, logs)
    default = next(r for r in rows_out if r["lever"].endswith("(default)"))
    return {"model": spec, "cpus_per_replica": cfg.serve.cpus_per_replica, "max_batch_size": cfg.serve.max_batch_size,
            "levers": rows_out, "serve_vs_peer_throughput": default.get("serve_vs_peer_throughput"),
            "p50_over_peer_ms": default.get("p50_over_peer_ms"), "goals": GOALS}


def lever_rows(levers_: list[dict]) -> str:
    out = []
    for r in levers_:
        if "error" in r:
            out.append(f"| {r['lever']} | {r['change']} | did not start: {r['error']} | | | | | | |")
            continue
        s, p = r["serve"], r["peer"]
        stop = r.get("stop", {})
        out.append(
            f"| {r['lever']} | {r['change']} | {s['1']['p50_ms']} | {p['1']['p50_ms']} | {r['p50_over_peer_ms']} | "
            f"{s['32']['rps']:.0f} | {p['32']['rps']:.0f} | {r['serve_vs_peer_throughput']:.2f} | "
            f"{stop.get('seconds')} s, exit {stop.get('exit_code')} |")
    return "\n".join(out)


def _load(machine: dict) -> str:
    load = machine.get("load_average")
    if load is None:  # results stored before the load was recorded
        return "**shared with other work while measured**"
    return f"load average {load['before']} (1 min) before the run, {load['after_15min']} (15 min) when it ended"


def markdown(r: dict) -> str:
    def met(key, ok):
        return "met" if ok else "**not met**"

    ratio, over = r["serve_vs_peer_throughput"], r["p50_over_peer_ms"]
    return f"""## Serving: Ray Serve against a plain FastAPI peer, lever by lever

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs, {_load(r["machine"])}; figures are medians
of {r["levers"][0].get("reps", "n/a")} alternating runs, and the ratios within a row mean more than absolute times), model {r["model"]}, 1 replica x {r["cpus_per_replica"]} CPU, batches of at most {r["max_batch_size"]}.
Each row is `workflows serve` started afresh with that setting, driven by the same aiohttp client as the peer
(`workflows/bench/serve_peer.py`: FastAPI + uvicorn, one process, the same Predictor and threads, an asyncio
micro-batcher), both alternating point by point; the last column is its SIGTERM stop. The peer is one process;
Serve adds a proxy process (or HAProxy) and Ray's own processes beside the replica, on the same cores: where the
cores are few and the model is the bottleneck, what they spend is taken from the model.

| measure (default row) | value | goal |
| --- | --- | --- |
| `serve_vs_peer_throughput` (req/s at concurrency 32) | {ratio} | >= {r["goals"]["serve_vs_peer_throughput"]} ({met("t", ratio is not None and ratio >= r["goals"]["serve_vs_peer_throughput"])}) |
| `p50_over_peer_ms` (p50 at concurrency 1) | {over} ms | <= {r["goals"]["p50_over_peer_ms"]} ({met("p", over is not None and over <= r["goals"]["p50_over_peer_ms"])}) |

| lever | change | Serve p50 c=1 ms | peer p50 c=1 ms | p50 over peer ms | Serve req/s c=32 | peer req/s c=32 | Serve / peer c=32 | stop |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
{lever_rows(r["levers"])}
"""  # noqa: E501 (markdown table rows: one line each)


if __name__ == "__main__":
    from benchmarks.record import main

    main("serve-levers")

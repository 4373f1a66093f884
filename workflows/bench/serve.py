"""Serving: Serve against a plain FastAPI peer, dynamic batching, HTTP overhead, int8 and bf16, a 10k-request
load and a replica killed under load.

Measures the model `make demo` registered (`quickstart`, latest version; `--set` or a config to
use another store), over real HTTP to Ray Serve on this machine, with the same CPU budget for
every deployment (1 replica x `serve.cpus_per_replica`, 2 replicas for the replica-kill run):

- serve_vs_peer_throughput / p50_over_peer_ms: the batched deployment against a plain FastAPI app
  under uvicorn in one process (workflows.bench.serve_peer: same Predictor and threads, an
  equivalent micro-batcher), same client and rows, alternating: req/s at concurrency 32, Serve /
  peer (goal >= 0.9), and p50 at concurrency 1, Serve − peer (goal <= 3 ms).
- image: the same comparison for an image classifier (`digits`, latest version, registered by
  `workflows pipeline --config digits`; WORKFLOWS_BENCH_SERVE_IMAGE_MODEL names another): its
  deployment (same budget, max batch 32) against the peer with the same ImagePredictor and
  ImageContract (a body's images decoded by decode_image before batching, as in the replica),
  same client; the requests are JSON {"instances": [{"image": {"b64": ...}}]}, one image each:
  the raw PNGs of the held-out split as stored in the raw shards (the digits: 8x8 grayscale scans,
  resized to the model's 32x32 by the server). Goals: Serve >= 0.95x the peer's req/s at
  concurrency 32, p50 at concurrency 1 within 3 ms of the peer's.
- batched_vs_unbatched_throughput: requests/s at concurrency 32 with @serve.batch
  (max_batch_size 32) over the same deployment with max_batch_size 1 (the 4x goal moved to GPUs).
- p50_overhead_ms: p50 latency over HTTP at concurrency 1 minus the p50 of the same row through
  the predictor in this process. Beside it, healthz_p50_ms: the p50 of GET /healthz,
  the same request path with no model call, the floor of that overhead on this machine.
- int8_speedup / int8_f1_delta: dynamic int8 quantization vs fp32, in-process throughput on
  batches of 32, and weighted F1 on the model's held-out split (fp32 minus int8). bf16_speedup /
  bf16_f1_delta the same for bf16 weights and activations (meant for GPU replicas; measured on this
  machine's CPU, whose bf16 speed says nothing of a GPU's, while the F1 delta is the same numerics).
- load_10k: 10,000 requests at concurrency 64 (goal: 0 errors); replica_kill: one of 2 replicas
  SIGKILLed mid-load (goals: < 1% failed, recovery < 30 s).
- rolling_update: 2 replicas serve `rollout@production` (v1) under load at concurrency 32, as
  `workflows serve --model rollout@production` does; the alias is moved to v2 and the serving
  command's alias follower deploys v2 to the same application: Serve starts v2's replicas, then
  drains v1's (goals: 0 failed requests; only v2 answers within ROLLOVER_BOUND_S of the move). v1
  and v2 are two registrations of the measured model's artifact under a scratch prefix of the
  store (removed afterwards): the rollout path is the real one (new artifact id, new replicas fetch
  and load it), only the weights are the same.
- scale_to_zero: `serve.autoscaling.min_replicas: 0` (downscale after 2 s idle): each cycle waits
  for zero replicas, then sends one request, which waits for a replica to start and load the model
  (the cold start, p50 and p99), then 20 warm ones one after another (goal: every request answered).
- autoscaling: `serve.autoscaling` from 1 to 2 replicas (target 8 ongoing requests each, shortened
  delays) under load at concurrency 32, back to 1 when the load stops: seconds to scale up and
  down, throughput on 1 and on 2 replicas, errors while replicas come and go (goal: 0).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from workflows.bench.serve_changes import ROLLOVER_BOUND_S, autoscaling, replica_kill, rolling_update, scale_to_zero
from workflows.bench.serve_cpu import cpu_per_request
from workflows.bench.serve_load import LOAD_REQUESTS, get_p50_ms, load
from workflows.errors import UserError

MODEL = os.environ.get("WORKFLOWS_BENCH_SERVE_MODEL", "quickstart")
IMAGE_MODEL = os.environ.get("WORKFLOWS_BENCH_SERVE_IMAGE_MODEL", "digits")
PRECISIONS = ("fp32", "int8", "bf16")  # fp32 first: the others are compared with it
# The peer comparison replaced the goals of batched >= 4x unbatched and p50 overhead <= 5 ms over
# the in-process call, both bound by the CPU on 2 cores (issue 20); they are still measured.
GOALS = {
    "serve_vs_peer_throughput": 0.9,
    "p50_over_peer_ms": 3.0,
    "load_errors": 0,
    "replica_kill_failed_fraction": 0.01,
    "replica_kill_recovery_s": 30.0,
    "rolling_update_failed": 0,
    "rolling_update_bound_s": ROLLOVER_BOUND_S,
    "scale_to_zero_failed": 0,
    "autoscaling_errors": 0,
    "image_serve_vs_peer_throughput": 0.95,
    "image_p50_over_peer_ms": 3.0,
}


def run(config: str | None, overrides: list[str]) -> dict:
    from workflows.config import load_config
    from workflows.runtime import runtime

    cfg = load_config(config or "quickstart", overrides)
    with runtime(cfg) as rt:
        return _measure(rt)


def _measure(rt) -> dict:
    from ray import serve

    from workflows import registry
    from workflows.serve import ingress
    from workflows.serve.app import deploy

    cfg, ctx = rt.cfg, rt.storage
    try:
        ref = registry.resolve(cfg, ctx, MODEL)
    except UserError as e:
        raise UserError(f"{e}; bench serve measures a registered model: run `make demo` first") from None
    spec = f"{ref.name}:{ref.version}"
    rows = _test_rows(rt, spec, 512)
    out: dict = {
        "model": spec,
        "cpus_per_replica": cfg.serve.cpus_per_replica,
        "batch_wait_timeout_s": cfg.serve.batch_wait_timeout_s,
        "model_in_thread": cfg.serve.model_in_thread,
        "ingress": ingress.describe(cfg),
    }

    def deployed(max_batch: int, replicas: int = 1, model: str = spec, **serve_settings):
        c = cfg.model_copy(deep=True)
        c.serve.max_batch_size, c.serve.num_replicas, c.serve.autoscaling = max_batch, replicas, None
        c.serve.auth_token_env = None
        for key, value in serve_settings.items():
            setattr(c.serve, key, value)
        return deploy(c, model, name="bench")

    # batched: throughput/latency curve, p50 at concurrency 1, the 10k load
    url = deployed(32)
    load(url, rows, 64, 32)  # warm-up
    curve = {c: load(url, rows, max(200, 12 * c), c) for c in (1, 4, 16, 32, 64)}
    out["batched"] = curve
    out["healthz_p50_ms"] = round(get_p50_ms(f"{url}/healthz", 220), 2)
    load_10k = load(url, rows, LOAD_REQUESTS, 64)
    out["load_10k"] = load_10k
    out["peer"] = _peer(rt, spec, url, rows)
    out["serve_vs_peer_throughput"] = out["peer"]["serve_vs_peer_throughput"]
    out["p50_over_peer_ms"] = out["peer"]["p50_over_peer_ms"]
    serve.delete("bench")
    out["image"] = _image(rt, deployed)
    # unbatched, same budget
    url = deployed(1)
    load(url, rows, 32, 8)
    out["unbatched_c32"] = load(url, rows, 400, 32)
    serve.delete("bench")
    out["batched_vs_unbatched_throughput"] = round(curve[32]["rps"] / out["unbatched_c32"]["rps"], 2)

    direct = _direct_p50_ms(rt, spec, rows)
    out["direct_p50_ms"] = round(direct, 2)
    out.update(_inprocess_batching(rt, spec, rows))
    out["p50_overhead_ms"] = round(curve[1]["p50_ms"] - direct, 2)
    out.update(_precisions(rt, spec, rows))
    out["replica_kill"] = replica_kill(deployed, rows)
    serve.delete("bench")
    out["rolling_update"] = rolling_update(rt, spec, rows)
    serve.delete("bench")
    out["autoscaling"] = autoscaling(rt, spec, rows)
    serve.delete("bench")
    out["scale_to_zero"] = scale_to_zero(rt, spec, rows)
    serve.delete("bench")
    out["goals"] = GOALS
    out["goals_met"] = {
        "serve_vs_peer_throughput": (out["serve_vs_peer_throughput"] or 0) >= GOALS["serve_vs_peer_throughput"],
        "p50_over_peer_ms": (out["p50_over_peer_ms"] if out["p50_over_peer_ms"] is not None else 1e9)
        <= GOALS["p50_over_peer_ms"],
        "load_errors": load_10k["errors"] == 0,
        "replica_kill_failed_fraction": out["replica_kill"]["failed_fraction"] < GOALS["replica_kill_failed_fraction"],
        "replica_kill_recovery_s": (out["replica_kill"]["recovery_s"] or 1e9) < GOALS["replica_kill_recovery_s"],
        "rolling_update_failed": out["rolling_update"]["failed"] == GOALS["rolling_update_failed"]
        and out["rolling_update"]["switched"],
        "rolling_update_bound_s": (out["rolling_update"]["last_old_version_s"] or 0) <= ROLLOVER_BOUND_S
        and out["rolling_update"]["switched"],
        "scale_to_zero_failed": out["scale_to_zero"]["failed"] == GOALS["scale_to_zero_failed"],
        "autoscaling_errors": out["autoscaling"]["errors"] == 0
        and out["autoscaling"]["scaled_up_s"] is not None
        and out["autoscaling"]["scaled_down_s"] is not None,
    }
    image = out["image"].get("peer")
    if image:
        out["goals_met"]["image_serve_vs_peer_throughput"] = (
            (image["serve_vs_peer_throughput"] or 0) >= GOALS["image_serve_vs_peer_throughput"])
        out["goals_met"]["image_p50_over_peer_ms"] = (
            image["p50_over_peer_ms"] is not None and image["p50_over_peer_ms"] <= GOALS["image_p50_over_peer_ms"])
    return out


def _peer(rt, spec: str, url: str, rows: list[dict], cpu_requests: int = 0, more=None) -> dict:
    """The deployment against the plain FastAPI peer (workflows.bench.serve_peer): same Predictor,
    threads, batch size, client and rows, alternating point by point. With `cpu_requests`, then
    the CPU each spends per request at concurrency 32, process by process (`cpu_per_request`);
    with `more`, `more(peer_url)` as "levers" (other deployments against the same peer)."""
    from workflows import registry
    from workflows.bench.serve_load import compare
    from workflows.bench.serve_peer import Peer
    from workflows.net import free_port

    model_dir, _ = registry.fetch(rt.cfg, rt.storage, spec)
    log = Path(rt.cfg.output_dir) / rt.cfg.name / "logs" / f"bench-serve-peer-{spec.split(':')[0]}.log"
    threads = max(1, int(rt.cfg.serve.cpus_per_replica))
    text_rows = [{k: v for k, v in r.items() if k != "label"} for r in rows]
    with Peer(model_dir, free_port(), threads, 32, spec, log, rt.cfg) as peer:
        out = compare(url, peer.url, text_rows)
        if cpu_requests:
            out["cpu_ms_per_request"] = {name: cpu_per_request(u, text_rows, cpu_requests, 32)
                                         for name, u in (("serve", url), ("peer", peer.url))}
        if more is not None:
            out["levers"] = more(peer.url)
        return out


CPU_REQUESTS = 2000  # per server, at concurrency 32, for the CPU accounting of the image row
# the image row's deployment again with one serve.* setting changed (no new cluster needed), against the same peer
IMAGE_LEVERS = [("access log off", "serve.access_log=false", {"access_log": False}),
                ("model call in a thread", "serve.model_in_thread=true", {"model_in_thread": True})]


def _image(rt, deployed) -> dict:
    """The image classifier's deployment against the peer, with held-out raw images as requests; a
    dict naming why when no image model is registered."""
    from ray import serve

    from workflows import registry

    try:
        ref = registry.resolve(rt.cfg, rt.storage, IMAGE_MODEL)
    except UserError as e:
        return {"model": IMAGE_MODEL, "skipped": f"{e}; run `workflows pipeline --config digits` first"}
    from workflows.bench.serve_load import compare

    spec = f"{ref.name}:{ref.version}"
    rows = _image_rows(rt, spec, 256)

    def levers(peer_url: str) -> list[dict]:
        out = []
        for name, change, settings in IMAGE_LEVERS:
            serve.delete("bench")
            url = deployed(32, model=spec, **settings)
            load(url, rows, 64, 32)  # warm-up
            got = compare(url, peer_url, rows)
            out.append({"lever": name, "change": change, "serve": got["serve"], "peer": got["peer"],
                        **{k: got[k] for k in ("serve_vs_peer_throughput", "p50_over_peer_ms", "reps")}})
        return out

    url = deployed(32, model=spec)
    try:
        load(url, rows, 64, 32)  # warm-up
        out = {"model": spec, "request": "json-base64", "images": len(rows),
               "image_bytes_median": int(statistics.median(len(r["image"]["b64"]) * 3 // 4 for r in rows))}
        out["peer"] = _peer(rt, spec, url, rows, cpu_requests=CPU_REQUESTS, more=levers)
    finally:
        serve.delete("bench")
    return out


def _image_rows(rt, spec: str, n: int) -> list[dict]:
    """The first `n` held-out images of the model's dataset as JSON request instances
    ({"image": {"b64": ...}}), with the bytes of the raw records (tar or image-file shards) they were
    decoded from in preprocessing: what a client sends, not the stored tensors."""
    import base64

    from workflows import registry
    from workflows.preprocess.sources import list_shards
    from workflows.storage.shards import _read_local, read_parquet
    from workflows.storage.uri import filesystem

    card = registry.model_card(rt.cfg, rt.storage, spec)
    data = registry.lineage_dataset(rt.cfg, rt.storage, card)
    keys = [k for f in data.files["test"] for k in read_parquet(f, rt.storage, ["key"]).column("key").to_pylist()]
    if data.source != rt.cfg.data.source:  # the manifest's word, which chooses no place to read
        raise UserError(f"bench serve's image row reads the raw shards of data.source ({rt.cfg.data.source}); the "
                        f"model's dataset was made from {data.source}: set data.source to it")
    shards, fmt = list_shards(rt.cfg.data.source, rt.storage)
    if fmt not in ("tar", "image"):
        raise UserError(f"bench serve's image row reads tar or image-file raw shards; {data.source} holds {fmt}")
    wanted, found = set(keys[:n]), {}
    for shard in shards:
        fs, path = filesystem(shard.uri, rt.storage)
        with fs.open(path, "rb") as f:
            for row in _read_local(f, fmt, shard.uri).to_pylist():
                if row["key"] in wanted and row["image"]:
                    found[row["key"]] = row["image"]
        if len(found) == len(wanted):
            break
    return [{"image": {"b64": base64.b64encode(found[k]).decode()}} for k in keys[:n] if k in found]


def _test_rows(rt, spec: str, n: int) -> list[dict]:
    from workflows import registry

    card = registry.model_card(rt.cfg, rt.storage, spec)
    data = registry.lineage_dataset(rt.cfg, rt.storage, card)
    cols = [*data.text_columns, data.label_column]
    got = data.read("test", rt.storage, cache=rt.cfg.cache).select_columns(cols).take(n)
    return [{c: str(r[c]) for c in cols} for r in got]


def _predictor(rt, spec: str, precision: str):
    from workflows import registry
    from workflows.tasks.text.predictor import TextPredictor

    model_dir, _ = registry.fetch(rt.cfg, rt.storage, spec)
    return TextPredictor(model_dir, threads=max(1, int(rt.cfg.serve.cpus_per_replica)), precision=precision)


def _direct_p50_ms(rt, spec: str, rows: list[dict]) -> float:
    pred = _predictor(rt, spec, "fp32")
    text_cols = pred.text_columns
    times = []
    for i in range(220):
        row = {c: rows[i % len(rows)][c] for c in text_cols}
        t0 = time.perf_counter()
        pred.predict([row])
        if i >= 20:  # warm-up
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _inprocess_batching(rt, spec: str, rows: list[dict]) -> dict:
    """The most batching can give this model on these CPUs: rows/s of the predictor alone, batches
    of 32 vs one row at a time (no HTTP, no Serve), same rows and threads."""
    pred = _predictor(rt, spec, "fp32")
    sample = [{c: r[c] for c in pred.text_columns} for r in rows[:256]]
    pred.predict(sample[:32])  # warm-up
    t0 = time.perf_counter()
    for r in sample:
        pred.predict([r])
    one = len(sample) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(0, len(sample), 32):
        pred.predict(sample[i : i + 32])
    batched = len(sample) / (time.perf_counter() - t0)
    return {
        "inprocess_rows_per_s_batch1": round(one, 1),
        "inprocess_rows_per_s_batch32": round(batched, 1),
        "inprocess_batched_vs_unbatched": round(batched / one, 2),
    }


def _precisions(rt, spec: str, rows: list[dict]) -> dict:
    from workflows import registry
    from workflows.evaluate import evaluate_dataset

    out = {}
    for precision in PRECISIONS:
        pred = _predictor(rt, spec, precision)
        columns = {c: [r[c] for r in rows] for c in pred.text_columns}
        pred.probabilities({c: v[:64] for c, v in columns.items()}, batch_size=32)  # warm-up
        t0 = time.perf_counter()
        pred.probabilities(columns, batch_size=32)
        out[f"{precision}_rows_per_s"] = round(len(rows) / (time.perf_counter() - t0), 1)
    card = registry.model_card(rt.cfg, rt.storage, spec)
    data = registry.lineage_dataset(rt.cfg, rt.storage, card)
    f1 = {}
    for precision in PRECISIONS:
        cfg = rt.cfg.model_copy(deep=True)
        cfg.serve.precision = precision
        test = data.read("test", rt.storage, cache=cfg.cache).select_columns([*data.text_columns, data.label_column])
        f1[precision] = evaluate_dataset(cfg, spec, card, test, concurrency=1)["weighted"]["f1"]
    out["fp32_f1"] = round(f1["fp32"], 4)
    for precision in PRECISIONS[1:]:
        out[f"{precision}_speedup"] = round(out[f"{precision}_rows_per_s"] / out["fp32_rows_per_s"], 2)
        out[f"{precision}_f1"] = round(f1[precision], 4)
        out[f"{precision}_f1_delta"] = round(f1["fp32"] - f1[precision], 4)
    return out

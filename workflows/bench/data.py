"""Data plane: object store -> per-node shard cache -> Ray Data, counted at the S3 endpoint.

On the config's embedded S3 endpoint (moto over HTTP, in its own process) in a scratch data dir,
with a scratch cache dir, it writes ~512 MB of parquet shards (WORKFLOWS_BENCH_DATA_MB to change)
and measures, in one run:

- warm_object_store_bytes: object bytes the endpoint served (its own counters) while the same
  shards were read again as a second epoch, by a later trial (a Ray task) and by a second job (a
  new driver process on the same cluster). Goal 0.
- warm_vs_local_ratio: throughput of a later job's read through the cache (list the shards, open
  each cached copy, pyarrow-read it) over pyarrow reading the same local files directly.
- cold_vs_boto3_ratio: throughput of filling an empty cache over boto3's parallel downloads
  (s3transfer, multipart) of the same objects, same thread count. Median of alternating rounds.
- tokenize_speedup, image_decode.speedup: the text and image tasks' preprocessing (tokenize;
  decode + resize) with Ray Data on 2 CPUs over one process calling the same code, beside 2 plain
  processes doing it (the decode limit), interleaved rounds, the load average sampled in each
  (workflows/bench/prep_speedup.py).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from workflows.errors import UserError

GOALS = {"warm_object_store_bytes": 0, "warm_vs_local_ratio": 0.9, "cold_vs_boto3_ratio": 0.8}
THREADS = 8
ROUNDS = 3
N_SHARDS = 16
EMBED_DIM = 384  # a row carries a precomputed feature vector, as many real shards do: incompressible bytes


def run(config: str | None, overrides: list[str]) -> dict:
    from workflows.config import load_config
    from workflows.runtime import runtime

    scratch = Path(tempfile.mkdtemp(prefix="workflows-bench-data-"))
    try:
        cfg = load_config(config or "quickstart", [
            *overrides, f"storage.embedded.data_dir={scratch}/s3", f"cache.dir={scratch}/cache",
            f"output_dir={scratch}/runs", "cache.max_bytes=null"])
        if not cfg.storage.embedded.enabled:
            raise UserError("bench data counts traffic at the embedded S3 endpoint: set storage.embedded.enabled=true")
        with runtime(cfg) as rt:
            return _measure(rt, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(rt, scratch: Path) -> dict:
    from workflows.preprocess.sources import list_shards
    from workflows.storage.embedded import endpoint_traffic

    cfg, ctx = rt.cfg, rt.storage
    prefix = cfg.uri("bench", "data") + "/"
    mb = int(os.environ.get("WORKFLOWS_BENCH_DATA_MB", "512"))
    rt_say = _say
    rt_say(f"bench data: writing {N_SHARDS} parquet shards, ~{mb} MB, to {prefix}")
    rows = _write_shards(prefix, ctx, mb, scratch / "gen")
    shards, _ = list_shards(prefix, ctx)
    total = sum(s.size for s in shards)

    def traffic(fn):
        endpoint_traffic(ctx.endpoint_url, reset=True)
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        return seconds, endpoint_traffic(ctx.endpoint_url), out

    # -- cold fill vs boto3, alternating rounds ---------------------------------------------
    cold, boto = [], []
    for i in range(ROUNDS):
        s, t, _ = traffic(lambda: _boto3_download(shards, ctx, scratch / f"boto3-{i}"))
        boto.append({"seconds": s, "get_bytes": t["bytes_out"].get("GET", 0)})
        shutil.rmtree(scratch / f"boto3-{i}")
        s, t, _ = traffic(lambda: _cold_fill(shards, ctx, scratch / f"cold-{i}"))
        cold.append({"seconds": s, "get_bytes": t["bytes_out"].get("GET", 0)})
        shutil.rmtree(scratch / f"cold-{i}")
        rt_say(f"bench data: round {i + 1}: boto3 {total / boto[-1]['seconds'] / 1e6:.0f} MB/s, "
               f"cache fill {total / cold[-1]['seconds'] / 1e6:.0f} MB/s")
    cold_mbps = statistics.median(total / r["seconds"] / 1e6 for r in cold)
    boto_mbps = statistics.median(total / r["seconds"] / 1e6 for r in boto)

    # -- first epoch through Ray Data fills the cluster's cache; then everything is warm ------
    s, first, n = traffic(lambda: _ray_read(shards, ctx, cfg.cache))
    if n != rows:
        raise RuntimeError(f"read {n} rows, wrote {rows}")
    rt_say(
        f"bench data: first epoch via Ray Data {s:.1f}s, {first['bytes_out'].get('GET', 0) / 1e6:.0f} MB from the store"
    )
    warm = {}
    s, t, n = traffic(lambda: _ray_read(shards, ctx, cfg.cache))
    warm["second_epoch"] = {"seconds": round(s, 2), "rows": n, **_summ(t)}
    s, t, n = traffic(lambda: _later_trial(shards, ctx, cfg.cache))
    warm["later_trial"] = {"seconds": round(s, 2), "rows": n, **_summ(t)}
    s, t, n = traffic(lambda: _second_job(prefix, ctx, cfg.cache))
    warm["second_job"] = {"seconds": round(s, 2), "rows": n, **_summ(t)}
    for k, v in warm.items():
        if v["rows"] != rows:
            raise RuntimeError(f"{k} read {v['rows']} rows, wrote {rows}")

    # -- warm cached read vs pyarrow on the same local files ---------------------------------
    cache = cfg.cache.shard_cache(ctx)
    local_paths = [cache.fetch(s.uri, s.version, s.size) for s in shards]
    cached_t, local_t = [], []
    for _ in range(ROUNDS):
        cached_t.append(_timed(lambda: _cached_read(prefix, ctx, cache)))
        local_t.append(_timed(lambda: _local_read(local_paths)))
    warm_local_ratio = statistics.median(local_t) / statistics.median(cached_t)

    tok = _prep_speedups(cfg)
    endpoint_traffic(ctx.endpoint_url, reset=True)
    from workflows.storage.uri import filesystem

    fs, path = filesystem(prefix, ctx)
    fs.rm(path, recursive=True)  # nothing of it is persisted to the scratch store
    return {
        "data_mb": round(total / 1e6, 1),
        "shards": len(shards),
        "rows": rows,
        "threads": THREADS,
        "rounds": ROUNDS,
        "warm_object_store_bytes": max(v["object_bytes"] for v in warm.values()),
        "warm_reads": warm,
        "first_epoch_object_bytes": first["bytes_out"].get("GET", 0),
        "warm_vs_local_ratio": round(warm_local_ratio, 3),
        "warm_cached_read_mbps": round(total / statistics.median(cached_t) / 1e6, 1),
        "local_pyarrow_read_mbps": round(total / statistics.median(local_t) / 1e6, 1),
        "cold_vs_boto3_ratio": round(cold_mbps / boto_mbps, 3),
        "cold_fill_mbps": round(cold_mbps, 1),
        "boto3_mbps": round(boto_mbps, 1),
        "cold_rounds": cold,
        "boto3_rounds": boto,
        **tok,
        "goals": GOALS,
        "goals_met": {
            "warm_object_store_bytes": max(v["object_bytes"] for v in warm.values())
            <= GOALS["warm_object_store_bytes"],
            "warm_vs_local_ratio": warm_local_ratio >= GOALS["warm_vs_local_ratio"],
            "cold_vs_boto3_ratio": cold_mbps / boto_mbps >= GOALS["cold_vs_boto3_ratio"],
        },
    }


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _summ(t: dict) -> dict:
    return {
        "object_bytes": t["bytes_out"].get("GET", 0),
        "requests": t["requests"],
        "listing_bytes": t["bytes_out"].get("LIST", 0),
    }


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- data ------------------------------------------------------------------------------------
def _write_shards(prefix: str, ctx, mb: int, gen: Path) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from workflows.preprocess import quickstart_data

    base = quickstart_data.build(200)
    texts, labels = [r["text"] for r in base], [r["label"] for r in base]
    row_bytes = EMBED_DIM * 4 + 120
    per_shard = max(1, mb * 1_000_000 // N_SHARDS // row_bytes)
    gen.mkdir(parents=True)
    rng = np.random.default_rng(0)
    bucket, key_prefix = prefix.split("://", 1)[1].split("/", 1)
    client = ctx.boto3_client()
    uploads = []
    for i in range(N_SHARDS):
        idx = (np.arange(per_shard) + i * per_shard) % len(texts)
        emb = rng.standard_normal((per_shard, EMBED_DIM), dtype=np.float32)
        table = pa.table(
            {
                "text": [texts[j] for j in idx],
                "label": [labels[j] for j in idx],
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), EMBED_DIM),
            }
        )
        path = gen / f"part-{i:05d}.parquet"
        pq.write_table(table, path)
        uploads.append((path, key_prefix + path.name))
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda u: client.upload_file(str(u[0]), bucket, u[1]), uploads))
    shutil.rmtree(gen)
    return per_shard * N_SHARDS


def _bucket_key(uri: str) -> tuple[str, str]:
    bucket, key = uri.split("://", 1)[1].split("/", 1)
    return bucket, key


# -- the measured reads ----------------------------------------------------------------------
def _boto3_download(shards, ctx, out: Path) -> None:
    out.mkdir(parents=True)
    client = ctx.boto3_client()

    def get(shard):
        bucket, key = _bucket_key(shard.uri)
        client.download_file(bucket, key, str(out / key.rsplit("/", 1)[-1]))

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(get, shards))


def _cold_fill(shards, ctx, directory: Path) -> None:
    from workflows.storage.cache import ShardCache

    cache = ShardCache(str(directory), ctx)
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda s: cache.fetch(s.uri, s.version, s.size), shards))
    if cache.stats().misses != len(shards):
        raise RuntimeError("cold fill was not cold")


def _ray_read(shards, ctx, cache_cfg) -> int:
    import ray

    from workflows.preprocess.sources import read_dataset

    ray.data.DataContext.get_current().enable_progress_bars = False

    return sum(
        b.num_rows
        for b in read_dataset(shards, "parquet", ctx, cache_cfg).iter_batches(batch_size=None, batch_format="pyarrow")
    )


def _later_trial(shards, ctx, cache_cfg) -> int:
    """A Ray task that reads the dataset, as a tuning trial's driver does."""
    import ray

    return ray.get(ray.remote(num_cpus=0)(_ray_read).remote(shards, ctx, cache_cfg))


def _second_job(prefix: str, ctx, cache_cfg) -> int:
    """A new driver process on the same cluster: lists the shards and reads them with Ray Data."""
    import json

    import ray

    code = (
        "import json, sys, ray; from workflows.bench.data import _job_main; "
        "print(json.dumps(_job_main(*json.loads(sys.argv[1]))))"
    )
    args = json.dumps([ray.get_runtime_context().gcs_address, prefix, ctx.endpoint_url, cache_cfg.model_dump()])
    out = subprocess.run([sys.executable, "-c", code, args], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"second job failed: {out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1])


def _job_main(address: str, prefix: str, endpoint_url: str, cache: dict) -> int:
    import logging

    import ray

    from workflows.config import CacheConfig
    from workflows.preprocess.sources import list_shards
    from workflows.storage.uri import StorageContext

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    ctx = StorageContext(endpoint_url=endpoint_url, region="us-east-1", embedded=True)
    shards, _ = list_shards(prefix, ctx)
    return _ray_read(shards, ctx, CacheConfig(**cache))


def _cached_read(prefix: str, ctx, cache) -> None:
    import pyarrow.parquet as pq

    from workflows.preprocess.sources import list_shards

    shards, _ = list_shards(prefix, ctx)
    for s in shards:
        with cache.open_local(s.uri, s.version, s.size) as path:
            pq.read_table(path)


def _local_read(paths: list[str]) -> None:
    import pyarrow.parquet as pq

    for p in paths:
        pq.read_table(p)


# -- preprocessing on one node -------------------------------------------------------------
def _prep_speedups(cfg) -> dict:
    """Text (tokenize) and images (decode + resize), Ray Data over 2 CPUs against one process:
    workflows.bench.prep_speedup."""
    from workflows.bench import prep_speedup

    rows = int(os.environ.get("WORKFLOWS_BENCH_TOKENIZE_ROWS", "120000"))
    images = int(os.environ.get("WORKFLOWS_BENCH_IMAGES", str(prep_speedup.IMAGES)))
    tok = prep_speedup.tokenize(cfg, rows)
    _say(f"bench data: tokenize {rows} rows: one process {tok['sides']['one_process']['median_s']:.1f}s, "
         f"Ray Data x2 {tok['sides']['ray_data']['median_s']:.1f}s ({tok['speedup']}x, load {tok['load_mean']})")
    img = prep_speedup.decode(cfg, images)
    _say(f"bench data: decode {images} JPEGs: one process {img['sides']['one_process']['median_s']:.1f}s, "
         f"Ray Data x2 {img['sides']['ray_data']['median_s']:.1f}s ({img['speedup']}x, load {img['load_mean']})")
    return {"tokenize_rows": rows, "tokenize_one_process_s": tok["sides"]["one_process"]["median_s"],
            "tokenize_ray_data_s": tok["sides"]["ray_data"]["median_s"], "tokenize_speedup": tok["speedup"],
            "tokenize": tok, "image_decode": img}


def markdown(r: dict) -> str:
    met = r["goals_met"]

    def mark(k):
        return "met" if met[k] else "**not met**"

    w = r["warm_reads"]
    return f"""## Data plane

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs). {r["shards"]} parquet shards, {r["data_mb"]} MB,
{r["rows"]} rows, on the embedded S3 endpoint (moto over HTTP in its own process); requests and bytes are
counted by the endpoint itself. Throughputs are medians of {r["rounds"]} alternating rounds, {r["threads"]} threads each.

| measure | value | goal |
| --- | --- | --- |
| `warm_object_store_bytes` (max of second epoch / later trial / second job) | {r["warm_object_store_bytes"]} B | 0 ({mark("warm_object_store_bytes")}) |
| object bytes served: second epoch, later trial (Ray task), second job (new driver) | {w["second_epoch"]["object_bytes"]} / {w["later_trial"]["object_bytes"]} / {w["second_job"]["object_bytes"]} B | |
| requests at the endpoint during the second job | {w["second_job"]["requests"]} | |
| object bytes served during the first epoch | {r["first_epoch_object_bytes"] / 1e6:.1f} MB | |
| `warm_vs_local_ratio` (list + cached pyarrow read ÷ pyarrow read of the same local files) | {r["warm_vs_local_ratio"]:.3f} ({r["warm_cached_read_mbps"]:.0f} vs {r["local_pyarrow_read_mbps"]:.0f} MB/s) | >= 0.9 ({mark("warm_vs_local_ratio")}) |
| `cold_vs_boto3_ratio` (empty cache fill ÷ boto3 parallel download) | {r["cold_vs_boto3_ratio"]:.3f} ({r["cold_fill_mbps"]:.0f} vs {r["boto3_mbps"]:.0f} MB/s) | >= 0.8 ({mark("cold_vs_boto3_ratio")}) |
{_tokenize_row(r)}
The cold fill hashes every byte (sha256, for later verification) and fsyncs before the rename; boto3
does neither.
{_prep_section(r)}"""  # noqa: E501 (markdown table rows: one line each)


def _tokenize_row(r: dict) -> str:
    if "tokenize" in r:  # the preprocessing table below has it
        return ""
    return (f"| `tokenize_speedup` (Ray Data, 2 actors on 2 CPUs ÷ one process), {r['tokenize_rows']} rows | "
            f"{r['tokenize_speedup']:.2f}x ({r['tokenize_one_process_s']:.1f}s vs {r['tokenize_ray_data_s']:.1f}s) | |\n")  # noqa: E501


def _prep_verdict(t: dict, i: dict) -> str:
    """The goal (issue #30: >= 1.6x on 2 CPUs), in words, from the figures."""
    if "cpu_bound_speedup" not in t:
        return ""
    parts = []
    for name, x in (("tokenize", t), ("decode + resize", i)):
        met = "met" if x["speedup"] >= 1.6 else "not met"
        parts.append(f"{name}: {x['speedup']:.2f}x measured ({met}), {x['cpu_bound_speedup']:.2f}x bound from CPU "
                     f"on an idle node, {x['plain_processes_cpu_bound_speedup']:.2f}x for plain processes")
    return "Goal >= 1.6x: " + "; ".join(parts) + "."


def _prep_section(r: dict) -> str:
    """Preprocessing on one node (results stored before it was measured this way have no section)."""
    if "tokenize" not in r:
        return ""
    t, i = r["tokenize"], r["image_decode"]

    def row(name: str, x: dict) -> str:
        s = {k: v["median_s"] for k, v in x["sides"].items()}
        c = x.get("cpu_s")
        bound = (f" | {c['one_process']:.1f} / {c['ray_data']:.1f} / {c['plain_processes']:.1f} | "
                 f"**{x['cpu_bound_speedup']:.2f}x** ({x['plain_processes_cpu_bound_speedup']:.2f}x)") if c else ""
        return (f"| {name} | {s['one_process']:.2f}s ({x['one_process_cores']:.2f} cores) | {s['ray_data']:.2f}s | "
                f"**{x['speedup']:.2f}x** | {s['one_process_niced']:.2f}s | {x['speedup_same_niceness']:.2f}x | "
                f"{s['plain_processes']:.2f}s ({x['plain_processes_speedup']:.2f}x) | {x['load_mean']:.1f}{bound} |")

    cpu_cols = (" | CPU s: one process / Ray Data / plain | idle-node bound from CPU: Ray Data (plain)",
                " | --- | ---") if "cpu_s" in t else ("", "")

    return f"""
### Preprocessing on one node

The text and image tasks' own Ray Data map (`tokenize_batch`; `decode_batch`: decode, resize and
center-crop to {i["image_size"]}²) on {t["cpus"]} CPUs (Ray tasks, {t["cpus"]} at a time) against one process
calling the same code, beside the same work in one and in {t["cpus"]} plain started processes (multiprocessing)
at the niceness Ray gives its workers ({t["ray_worker_niceness"]}): the decode limit. Medians of interleaved
rounds; the last column is the 1-minute load average sampled during them (this machine has
{r["machine"]["cpus"]} CPUs). Goal: speedup >= 1.6x.

| work | one process (driver) | Ray Data, {t["cpus"]} CPUs | speedup | one process at Ray's niceness | Ray Data ÷ that | {t["cpus"]} plain processes at Ray's niceness (decode limit) | load{cpu_cols[0]} |
| --- | --- | --- | --- | --- | --- | --- | ---{cpu_cols[1]} |
{row(f"tokenize {t['rows']} rows, batches of {t['batch_size']}", t)}
{row(f"decode + resize {i['images']} JPEGs ({i['jpeg_kb_median']:.0f} KB median), batches of {i['batch_size']}", i)}

Ray starts its worker processes at niceness {t["ray_worker_niceness"]} (the raylet's `worker_niceness`), the
driver runs at 0: on a machine other work keeps busy (load above its CPU count) the scheduler gives
Ray's workers a small share next to any process at niceness 0, so "Ray Data ÷ one process" there
compares unequal priorities; "Ray Data ÷ that" and the decode limit compare like with like. On an
idle node niceness changes nothing. When the load stays above the CPU count, a second process gets
little more CPU than the first, and the decode limit itself stays near 1x: wall-clock ratios then
say nothing about scaling. The CPU seconds each side used (this process and its descendants: the
local Ray cluster, the plain processes) hardly depend on the load; {t["cpus"]} x one process's ÷ Ray
Data's is the speedup an idle node would give if Ray Data kept its {t["cpus"]} CPUs busy (it counts the
cluster's own background CPU, which grows with the wall time, on both sides).
{_prep_verdict(t, i)}
"""  # noqa: E501 (markdown table rows: one line each)

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
  (benchmarks/prep_speedup.py).
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

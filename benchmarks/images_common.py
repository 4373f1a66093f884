"""What the parts of `python -m benchmarks.images` share (benchmarks.images runs them): the goals,
the rows' names, the progress line, the sets painted or copied into the store and dropped again,
and what a stored scale run streamed. It imports none of the parts, so each part imports it."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.record import RESULTS_DIR

GOALS = {"warm_vs_best_peer": 1.0, "cold_vs_best_peer": 0.9, "warm_vs_local_dataloader": 0.9,
         "two_workers_vs_one": 0.9, "train_step_vs_loader": 0.9}
# cache_disk_bytes: the peak disk the capped cache held, open evicted files included, at most the cap
# plus one shard per decode process; exactly_once: every image of the set once in the epoch, by sample id
SCALE_GOALS: dict[str, Any] = {"images_per_s_vs_smallest": 0.9, "peak_pss_bytes": 6 * 2**30,
                               "cache_disk_bytes": "cap + 1 shard/reader", "exactly_once": True}
ROWS = ("ours", "ours_index", "ours2", "train_ray_data", "train_stream", "streaming", "litdata", "webdataset", "local",
        "decode", "ours_end")
ROOT = Path(__file__).resolve().parents[1]  # the tree the rows import workflows from


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)



# -- the set ------------------------------------------------------------------------------------
def _make_set(rt, prefix: str, size: int, opts: dict) -> dict:
    """Paint the set (synth-images) into the store; -> what it is and what writing it cost."""
    from workflows.preprocess.synth_images import SynthSpec, parse_size, synth_images

    spool, store = tempfile.gettempdir(), rt.embedded._proc.pid  # moto spools objects over ~5 MB there
    free_before = shutil.disk_usage(spool).free
    t0 = time.perf_counter()
    spec = SynthSpec(classes=int(opts["classes"]), shard_bytes=parse_size(opts["shard_bytes"], "bench.shard_bytes"))
    index = synth_images(prefix, size, rt.storage, spec, workers=int(opts["workers"]), say=_say)
    seconds = time.perf_counter() - t0
    return {**_describe(index, store, spool, free_before), "generate_s": round(seconds, 1),
            "generate_images_per_s": round(sum(s["samples"] for s in index["shards"]) / seconds, 1),
            "index": index}


def _describe(index: dict, store_pid: int, spool: str, free_before: int) -> dict:
    import psutil

    total = sum(s["bytes"] for s in index["shards"])
    images = sum(s["samples"] for s in index["shards"])
    return {"bytes": total, "images": images, "shards": len(index["shards"]), "classes": index["classes"],
            "shard_bytes_max": max(s["bytes"] for s in index["shards"]),
            "mean_image_bytes": round(total / images), "store_rss_bytes": psutil.Process(store_pid).memory_info().rss,
            "spool_dir": spool, "spool_disk_bytes_approx": free_before - shutil.disk_usage(spool).free}


def _copy_set(rt, src: str, src_index: dict, dst: str, size: int, index_json: bool = True) -> dict:
    """A set of about `size` bytes at `dst` whose shards are server-side copies of `src`'s, in turn,
    under new names: the scale curve's sets. What it measures (bytes fetched, cached, decoded) costs
    the same whether images repeat, and painting 27 GB needs CPU the shared machine lacks."""
    from concurrent.futures import ThreadPoolExecutor

    from workflows.storage.uri import join, write_json

    spool = tempfile.gettempdir()
    free_before = shutil.disk_usage(spool).free
    t0 = time.perf_counter()
    (sb, sk), (db, dk) = (u.split("://", 1)[1].split("/", 1) for u in (src, dst))
    client = rt.storage.boto3_client()
    shards: list[dict] = []
    todo: list[tuple[str, str]] = []
    total = 0
    while total < size:
        entry = src_index["shards"][len(shards) % len(src_index["shards"])]
        shards.append({**entry, "name": f"shard-{len(shards):06d}.tar"})
        todo.append((entry["name"], shards[-1]["name"]))
        total += entry["bytes"]

    def copy(names) -> str:
        done = client.copy_object(Bucket=db, Key=f"{dk}/{names[1]}",
                                  CopySource={"Bucket": sb, "Key": f"{sk}/{names[0]}"})
        return done["CopyObjectResult"]["ETag"].strip('"')

    with ThreadPoolExecutor(4) as pool:
        for i, etag in enumerate(pool.map(copy, todo)):
            # the copy's own version: a copy of a multipart upload gets another ETag than its source
            shards[i]["version"] = etag
            if i % 40 == 39:
                _say(f"bench images: {i + 1}/{len(todo)} shard copies")
    index = {**src_index, "shards": shards}
    if index_json:  # without: a set as users bring it, whose index the loader builds
        write_json(join(dst, "index.json"), index, rt.storage)
    return {**_describe(index, rt.embedded._proc.pid, spool, free_before),
            "copy_s": round(time.perf_counter() - t0, 1)}


def _drop(uri: str, ctx) -> None:
    from workflows.storage.uri import filesystem

    fs, path = filesystem(uri, ctx)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def whole_epoch(p: dict) -> bool:
    """The point's epoch delivered every image of its set exactly once (checked by sample id)."""
    f = p.get("ours_cold", {})
    return bool(f.get("samples", {}).get("exactly_once")) and f.get("images") == p["set"]["images"]


def streamed_bytes(p: dict) -> int:
    """What the point's epoch streamed of its set: all of it for a whole epoch, else the share of its
    distinct images (a capped or failed epoch does not count the set it did not read)."""
    f = p.get("ours_cold", {})
    if whole_epoch(p):
        return int(p["set"]["bytes"])
    # distinct images by sample id; results from before the check: the images delivered, at most
    distinct = f.get("samples", {}).get("distinct", min(f.get("images", 0), p["set"]["images"]))
    return int(p["set"]["bytes"] * distinct / max(p["set"]["images"], 1))


def _largest(this_run: int) -> int:
    """The largest set measured: this run's, or the scale run's stored beside it (images-scale.json)."""
    try:  # what its epochs streamed (results stored before it counted that said the painted size)
        scale = json.loads((RESULTS_DIR / "images-scale.json").read_text())
        return max(this_run, *(streamed_bytes(p) for p in scale["points"]))
    except (OSError, ValueError, KeyError, TypeError):
        return this_run

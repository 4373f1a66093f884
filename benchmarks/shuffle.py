"""Shuffle quality: how far apart the samples of one shard land in an epoch's order, ours
(workflows.loader.order.epoch_order: shards permuted per epoch, samples shuffled within a window of
`shuffle_window` consecutive shards) at several windows beside MosaicML Streaming's shuffles
(py1e, its default; py1s; naive) computed by Streaming's own functions in the peers' venv (the
order one rank with 8 DataLoader workers reads), and a
uniform random permutation (the ideal mix, and the worst cache working set).

Per order and shard sizes:
- gap: positions between consecutive samples of the same shard (mean, median, p5), also over
  the uniform permutation's mean (1.0 = as mixed as a full shuffle);
- span: the part of the epoch between a shard's first and last sample (mean, min), the time its
  file must stay readable (cached or open);
- open shards: the most shards whose span covers one position (the reader's working set);
- shards per batch: distinct shards among a batch of 256 consecutive positions (mean, min).

The peers' venv: $WORKFLOWS_BENCH_PEERS_PYTHON, else .venv-peers/bin/python (`make bench-peers`);
without it the Mosaic rows are missing and the result says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from workflows.loader.order import epoch_order, shard_offsets

BATCH = 256
SEED = 0
MOSAIC_WORKERS = 8  # DataLoader workers of the one rank whose read order Streaming's rows show
WINDOWS = (1, 4, 16)
# 100 shards x 1,200 samples; an ImageNet-like train set (1,281,167 images) in 1,101 shards of
# ~128 MB (about 1,164 JPEGs of ~110 KB each), as `workflows data synth-images` writes them
SHAPES = {"100x1200": [1200] * 100,
          "imagenet_1101": [1281167 // 1101 + (i < 1281167 % 1101) for i in range(1101)]}
# Streaming's defaults on one node: py1e with num_canonical_nodes = 1 (the physical nodes) and
# shuffle_block_size = max(4_000_000 // num_canonical_nodes, 1 << 18); py1s/py2s take 64 canonical
# nodes per physical node (streaming/base/dataset.py, 0.13)
MOSAIC = {"mosaic_py1e_default": ("py1e", 1, 4_000_000), "mosaic_py1e_block262144": ("py1e", 1, 1 << 18),
          "mosaic_py1s_default": ("py1s", 64, 1 << 18), "mosaic_naive": ("naive", 1, 1 << 18)}


def run(config: str | None, overrides: list[str]) -> dict:
    del config, overrides  # pure computation over shard sizes: no config, no cluster
    out: dict = {"batch": BATCH, "seed": SEED, "mosaic_workers": MOSAIC_WORKERS, "shapes": {}}
    peers = _peers_python()
    for shape, sizes in SHAPES.items():
        orders = {f"ours_window{w}": epoch_order(sizes, SEED, 0, w) for w in WINDOWS}
        orders["uniform"] = np.random.default_rng([SEED, 0]).permutation(sum(sizes))
        mosaic, why = _mosaic_orders(peers, sizes)
        orders.update(mosaic)
        offsets = shard_offsets(sizes)
        uniform_gap = None
        rows = {}
        for name in ["uniform", *[k for k in orders if k != "uniform"]]:
            m = measure(orders[name], offsets)
            uniform_gap = uniform_gap or m["gap_mean"]
            m["gap_mean_vs_uniform"] = round(m["gap_mean"] / uniform_gap, 3)
            rows[name] = m
        out["shapes"][shape] = {"shards": len(sizes), "samples": int(sum(sizes)), "orders": rows,
                                "mosaic_missing": why}
    return out


def measure(order: np.ndarray, offsets: np.ndarray, batch: int = BATCH) -> dict:
    """The figures of one epoch order (global sample ids by position) over shards at `offsets`."""
    n, shards = len(order), len(offsets) - 1
    if n != offsets[-1] or not np.array_equal(np.sort(order), np.arange(n)):
        raise ValueError("an epoch order must be a permutation of every sample id")
    shard = np.searchsorted(offsets, order, side="right") - 1  # the shard of each position
    by_shard = np.argsort(shard, kind="stable")  # positions grouped by shard, ascending within each
    pos_shard = shard[by_shard]
    gaps = np.diff(by_shard)[pos_shard[1:] == pos_shard[:-1]]
    first = np.full(shards, n)
    last = np.full(shards, -1)
    np.minimum.at(first, shard, np.arange(n))
    np.maximum.at(last, shard, np.arange(n))
    span = (last - first + 1) / n
    # open shards: +1 where a shard's span starts, -1 after it ends; the running sum's peak
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, first, 1)
    np.add.at(delta, last + 1, -1)
    per_batch = [len(np.unique(shard[i:i + batch])) for i in range(0, n - batch + 1, batch)]
    return {
        "gap_mean": round(float(gaps.mean()), 1), "gap_median": float(np.median(gaps)),
        "gap_p5": float(np.percentile(gaps, 5)),
        "span_mean": round(float(span.mean()), 4), "span_min": round(float(span.min()), 4),
        "open_shards_max": int(np.cumsum(delta).max()),
        "shards_per_batch_mean": round(float(np.mean(per_batch)), 1), "shards_per_batch_min": int(min(per_batch)),
    }


def _peers_python() -> str | None:
    for p in (os.environ.get("WORKFLOWS_BENCH_PEERS_PYTHON"), ".venv-peers/bin/python"):
        if p and Path(p).exists():
            return p
    return None


def _mosaic_orders(python: str | None, sizes: list[int]) -> tuple[dict[str, np.ndarray], str | None]:
    """Streaming's orders for `sizes`, from its own get_shuffle in the peers' venv (a subprocess)."""
    if python is None:
        return {}, "no peers' venv: set WORKFLOWS_BENCH_PEERS_PYTHON or run `make bench-peers`"
    cases = [{"name": k, "algo": a, "sizes": sizes, "ncn": ncn, "block": b} for k, (a, ncn, b) in MOSAIC.items()]
    with tempfile.TemporaryDirectory(prefix="workflows-bench-shuffle-") as out:
        script = Path(__file__).with_name("shuffle_peer.py")
        # -P: the script's folder (this package's modules) stays off the peer's sys.path
        spec = json.dumps({"cases": cases, "seed": SEED, "workers": MOSAIC_WORKERS, "batch": BATCH})
        done = subprocess.run([python, "-P", str(script), out, spec], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"Streaming's shuffle ({python}) failed: {done.stderr.strip()[-2000:]}")
        return {k: np.load(Path(out) / f"{k}.npy") for k in MOSAIC}, None


def markdown(r: dict) -> str:
    lines = [f"""## Shuffle quality

`{r["command"]}` ({r["measured_at"]}). How far apart the samples of one shard land in an epoch's order:
ours (`workflows.loader.order.epoch_order`: the shards permuted per epoch, then the samples of each
window of `shuffle_window` consecutive shards shuffled together) beside MosaicML Streaming's shuffles
computed by Streaming's own `get_shuffle` (its default on one node: `py1e`, 1 canonical node, block
4,000,000 samples), and a uniform random permutation. Gap: positions between consecutive samples of
one shard (÷ uniform: 1.0 is a full shuffle's mix); span: the part of the epoch between a shard's first
and last sample (how long its file must stay readable); open shards: the most spans covering one
position (the reader's working set); shards per batch: distinct shards in {r["batch"]} consecutive samples.
Streaming's rows are the order one rank reads: its shuffle over its default partition ("relaxed") for
one node, one rank, {r["mosaic_workers"]} DataLoader workers and batches of {r["batch"]}, taken round-robin (ours
does not depend on the workers: one rank reads the epoch order as it is).
"""]
    for shape, s in r["shapes"].items():
        lines.append(f"### {shape}: {s['shards']} shards, {s['samples']} samples\n")
        if s.get("mosaic_missing"):
            lines.append(f"Streaming's rows are missing: {s['mosaic_missing']}.\n")
        lines.append("| order | gap mean (÷ uniform) | gap median | gap p5 | span mean | span min | open shards (max) "
                     "| shards per batch (mean, min) |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, m in s["orders"].items():
            lines.append(f"| {name} | {m['gap_mean']:.0f} ({m['gap_mean_vs_uniform']:.3f}) | {m['gap_median']:.0f} | "
                         f"{m['gap_p5']:.0f} | {m['span_mean']:.4f} | {m['span_min']:.4f} | {m['open_shards_max']} | "
                         f"{m['shards_per_batch_mean']:.1f}, {m['shards_per_batch_min']} |")
        lines.append("")
    return "\n".join(lines)



if __name__ == "__main__":
    from benchmarks.record import main

    main("shuffle")

"""The scale curve of `python -m benchmarks.images` (`--tag scale --set bench.scale=...`): ours only, one
cold epoch per set size through a cache capped below the set."""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.images_common import SCALE_GOALS, _copy_set, _drop, _make_set, _say, streamed_bytes, whole_epoch
from benchmarks.images_proc import _env, _ours_cmd, _phases


def _scale(rt, scratch: Path, opts: dict, sizes: list[int]) -> dict:
    from workflows.preprocess.synth_images import parse_size

    workers = int(opts["workers"])
    logs = scratch / "logs"
    logs.mkdir()
    copies = opts["scale_distinct"] not in ("", "all")
    base_prefix = rt.cfg.uri("bench", "images", "scale-base")
    base: dict | None = None  # the painted set to copy, and its index.json: only with copies
    index: dict | None = None
    if copies:  # only where painting every set is more than the machine allows: the rows say so
        distinct = parse_size(opts["scale_distinct"], "bench.scale_distinct")
        _say(f"bench images: scale: painting {distinct / 1e9:.1f} GB of distinct shards to copy")
        base = _make_set(rt, base_prefix, distinct, opts)
        index = base.pop("index")
    # the same cap at every size, below the smallest set: eviction runs everywhere
    budget = int(opts["scale_cache_bytes"] and parse_size(opts["scale_cache_bytes"], "bench.scale_cache_bytes")
                 or rt.cfg.cache.max_bytes or 900 * 10**6)
    limit = int(opts["scale_max_images"]) if opts["scale_max_images"] else None
    points = []
    for size in sizes:
        prefix = rt.cfg.uri("bench", "images", f"scale-{size}")
        _say(f"bench images: scale: a {size / 1e9:.1f} GB set")
        if copies:
            assert base is not None and index is not None  # painted above
            data = _copy_set(rt, base_prefix, index, prefix, size)
            painted = {"how": f"server-side copies of {base['shards']} shards ({base['bytes'] / 1e9:.2f} GB, "
                              f"{base['images']} distinct images) painted once by synth-images in "
                              f"{base['generate_s']} s", "seconds": data["copy_s"], "distinct": False}
        else:
            data = _make_set(rt, prefix, size, opts)
            data.pop("index")
            painted = {"how": f"every image distinct, painted by synth-images (workers={workers})",
                       "seconds": data["generate_s"], "distinct": True}
        cache_dir = str(scratch / "cache-scale")
        args = {"endpoint": rt.storage.endpoint_url, "prefix": prefix, "workers": workers, "max_images": limit,
                "batch": int(opts["batch"]),
                "cache_dir": cache_dir, "max_bytes": budget, "phases": ["ours_cold"]}
        row = _phases(f"scale-{size}", [_ours_cmd(args)], _env(), rt, logs, cache_dir=cache_dir)
        # the disk goal: the cap plus one shard held open by each decode process
        disk_limit = budget + workers * max(data["shard_bytes_max"], 1)
        points.append({"set": data, "painted": painted, "cache_max_bytes": budget, "cache_disk_limit": disk_limit,
                       "capped_at_images": limit, **row})
        _drop(prefix, rt.storage)
        shutil.rmtree(cache_dir, ignore_errors=True)
    if copies:
        _drop(base_prefix, rt.storage)
    summary = summarize(points)
    result = {"workers": workers, "batch_size": int(opts["batch"]), "points": points, "painted": base,
              "max_images": limit,
              "ray": "not involved (the loader uses DataLoader worker processes, no Ray object store)", **summary}
    _plot(points, Path(opts["plot"]))
    return result


def summarize(points: list[dict]) -> dict:
    """images/s against the smallest set, the goals, and `largest_set_bytes` (what an epoch streamed)."""
    first = points[0].get("ours_cold", {}).get("images_per_s") if points else None
    for p in points:
        ips = p.get("ours_cold", {}).get("images_per_s")
        p["images_per_s_vs_smallest"] = round(ips / first, 3) if ips and first else None
        p["whole_epoch"] = whole_epoch(p)
        p["streamed_bytes"] = streamed_bytes(p)
    ok = bool(points) and all("ours_cold" in p for p in points)

    def every(check) -> bool:
        return ok and all(check(p) for p in points)

    met = {"images_per_s_vs_smallest": every(
               lambda p: p["images_per_s_vs_smallest"] >= SCALE_GOALS["images_per_s_vs_smallest"]),
           "peak_pss_bytes": every(lambda p: p["ours_cold"]["peak_pss_bytes"] <= SCALE_GOALS["peak_pss_bytes"]),
           "cache_disk_bytes": every(lambda p: 0 < p["ours_cold"].get("peak_cache_disk_bytes", 0)
                                     <= p["cache_disk_limit"]),
           "exactly_once": every(whole_epoch)}
    return {"largest_set_bytes": max((p["streamed_bytes"] for p in points), default=0), "goals": SCALE_GOALS,
            "goals_met": met}


def _plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from workflows.storage.atomic import atomic_write

    ok = [p for p in points if "ours_cold" in p]
    if not ok:
        return
    gb = [p["set"]["bytes"] / 1e9 for p in ok]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(gb, [p["ours_cold"]["images_per_s"] for p in ok], "o-", color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("set size (GB, log)")
    ax.set_ylabel("images/s", color="tab:blue")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(gb, [p["ours_cold"]["peak_pss_bytes"] / 2**30 for p in ok], "s--", color="tab:red")
    ax2.axhline(SCALE_GOALS["peak_pss_bytes"] / 2**30, color="tab:red", lw=0.5, ls=":")
    ax2.set_ylabel("peak memory, PSS summed (GiB)", color="tab:red")
    ax2.set_ylim(bottom=0)
    ax.set_title("StreamLoader, one epoch, cache capped below the set")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)



"""The scale curve of `workflows bench images` (`--tag scale --set bench.scale=...`): ours only, one
cold epoch per set size through a cache capped below the set."""

from __future__ import annotations

import shutil
from pathlib import Path

from workflows.bench.images import SCALE_GOALS, _copy_set, _drop, _make_set, _say
from workflows.bench.images_proc import _env, _ours_cmd, _phases


def _scale(rt, scratch: Path, opts: dict, sizes: list[int]) -> dict:
    from workflows.preprocess.synth_images import parse_size

    workers = int(opts["workers"])
    logs = scratch / "logs"
    logs.mkdir()
    distinct = parse_size(opts["scale_distinct"], "bench.scale_distinct")
    base_prefix = rt.cfg.uri("bench", "images", "scale-base")
    _say(f"bench images: scale: painting {distinct / 1e9:.1f} GB of distinct shards")
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
        data = _copy_set(rt, base_prefix, index, prefix, size)
        args = {"endpoint": rt.storage.endpoint_url, "prefix": prefix, "workers": workers, "max_images": limit,
                "cache_dir": str(scratch / "cache-scale"), "max_bytes": budget, "phases": ["ours_cold"]}
        row = _phases(f"scale-{size}", [_ours_cmd(args)], _env(), rt, logs)
        points.append({"set": data, "cache_max_bytes": budget, **row})
        _drop(prefix, rt.storage)
        shutil.rmtree(scratch / "cache-scale", ignore_errors=True)
    _drop(base_prefix, rt.storage)
    first = points[0].get("ours_cold", {}).get("images_per_s")
    for p in points:
        ips = p.get("ours_cold", {}).get("images_per_s")
        p["images_per_s_vs_smallest"] = round(ips / first, 3) if ips and first else None
    ok = [p for p in points if "ours_cold" in p]
    met = {"images_per_s_vs_smallest": bool(ok) and len(ok) == len(points) and all(
               p["images_per_s_vs_smallest"] >= SCALE_GOALS["images_per_s_vs_smallest"] for p in ok),
           "peak_pss_bytes": bool(ok) and len(ok) == len(points) and all(
               p["ours_cold"]["peak_pss_bytes"] <= SCALE_GOALS["peak_pss_bytes"] for p in ok)}
    result = {"workers": workers, "batch_size": 256, "points": points, "painted": base, "max_images": limit,
              "ray": "not involved (the loader uses "
              "DataLoader worker processes, no Ray object store)", "largest_set_bytes": max(p["set"]["bytes"]
              for p in points), "goals": SCALE_GOALS, "goals_met": met}
    _plot(points, Path(opts["plot"]))
    return result


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



"""The markdown of `python -m benchmarks.images` (docs/BENCHMARKS.md's images sections)."""

from __future__ import annotations

from benchmarks.images_common import GOALS, ROWS, _largest, streamed_bytes


def _spool(s: dict) -> str:
    n = s["spool_disk_bytes_approx"]
    if n < s["bytes"] / 2:  # free space also moves with what the machine's other sessions write
        return "its disk use, read from free space, was swamped by other sessions' writes on this shared disk"
    return f"about {n / 1e9:.1f} GB of disk, read from free space, approximate on a shared disk"


def _load(r: dict) -> str:
    la = r["machine"]["load_average"]
    return f"{la['before']} before, {la['after_15min']} over the last 15 min"


def _met(ok) -> str:
    return "met" if ok else "**not met**"


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n is not None else "-"


def _mb(n) -> str:
    return f"{n / 1e6:.0f} MB" if n is not None else "-"


LABELS = {"ours_cold": "ours (StreamLoader), cold", "ours_warm": "ours, warm",
          "ours_index_build": "ours: index build, a set without index.json (loader/index.py read_index: every shard "
                              "read once, through the cache)",
          "ours_cold_after_index": "ours, first epoch after that index build",
          "ours_2_workers_cold": "ours, 2 training ranks (1 decode process each), cold, summed",
          "ours_2_workers": "ours, 2 training ranks (1 decode process each), warm, summed",
          # the training rows' own labels (the run's settings) stand before these
          "train_ray_data": "workflows train defaults, loader ray_data over stored pixels: images/s into the step",
          "train_stream": "workflows train, loader stream, image_input raw: images/s into the step",
          "streaming_cold": "MosaicML Streaming (MDS), cold", "streaming_warm": "MosaicML Streaming, warm",
          "litdata_cold": "LitData, cold", "litdata_warm": "LitData, warm",
          "webdataset": "WebDataset, tars streamed from S3, no cache",
          "local_dataloader": "torch DataLoader, local files",
          "decode_limit": "decode limit: N processes decoding local files",
          "ours_warm_end": "ours, warm, again after the peers"}
CONVERSIONS = {"streaming": "streaming_convert", "litdata": "litdata_convert", "local": "local_convert",
               "train_ray_data": "train_ray_data_preprocess"}


def markdown(r: dict) -> str:
    return _scale_markdown(r) if "points" in r else _rows_markdown(r)


def _persistent(r: dict) -> str:
    if r.get("peer_persistent_workers"):
        return ", with persistent DataLoader workers, as ours"
    return " (measured before the peers' DataLoaders kept their workers between epochs, as ours does)"


def _reps(f: dict) -> str:
    reps = f.get("reps") or []
    return ", ".join(f"{x.get('images_per_s') or x.get('seconds')} @ {x.get('load_1min', '-')}" for x in reps) or "-"


def _method(r: dict) -> str:
    n = r.get("repetitions", 1)
    if n > 1:
        how = (f"Every row ran {n} times, the rows interleaved repetition by repetition; each figure is the median "
               "repetition's (every repetition's rate and 1-minute load in the last column).")
    else:
        how = "One repetition: ours warm in the ratios is the mean of its pass before the peers and the one after them."
    if r.get("cold_includes_index_build"):
        how += (f" Ours cold in `cold_vs_best_peer` includes building the index of a set without `index.json`: "
                f"{r.get('ours_cold_images_per_s')} images/s over the index build plus the first epoch, against each "
                "peer's whole cold pass (first batch included).")
    else:
        how += " Ours cold: a set with its `index.json` (no index build run), steady rate against steady rates."
    return how


def _training(rows: dict) -> str:
    """What the training rows measure, where they ran."""
    if not any(k.startswith("train_") for k in rows):
        return ""
    return ("\n\n"
            "The training rows (`benchmarks.images_train`) are real training runs: Ray Train with the "
            "product's trainer (`fit`), one worker, `model.name_or_path: pooled_linear` (a linear classifier over"
            " pooled pixels; batches reach the step as uint8, which it pools before normalizing, so the trainer "
            "does next to no per-pixel work and the input sets the pace), two epochs each, a fresh cache per "
            "run; the figure is "
            "the second (warm) epoch's images per second into the training step after its first step, as the "
            "trainer counts it (`samples_per_s_after_first_step`), its first step's time in the first-batch "
            "column. Their memory is the run's whole process tree (Ray's processes included) over the whole run; "
            "the store bytes of a warm epoch are not separated from the run's. `train_step_vs_loader` = the "
            "stream row ÷ ours, warm (the same decode processes). The ray_data row's conversion is `workflows "
            "preprocess` of the set to 224 px pixels, from nothing, each repetition.")


def _rows_markdown(r: dict) -> str:
    s, rows = r["set"], r["rows"]
    lines = []
    for row in [r for r in ROWS if r in rows]:  # stored with sorted keys: the report's own order
        phases = rows[row]
        conv = phases.get(CONVERSIONS.get(row, ""), {}).get("seconds")
        for phase in [p for p in LABELS if p in phases]:
            f = phases[phase]
            label = f.get("label") or LABELS[phase]
            if phase == "ours_2_workers" and (f.get("store_get_bytes") or 0) > 0:  # before it ran cold, then warm
                label = "ours, 2 training ranks (1 decode process each), cold (its one pass), summed"
            lines.append(f"| {label} | {f.get('images_per_s', '-')} | "
                         f"{f'{conv:.0f} s' if conv is not None else '-'} | {_mb(f.get('store_get_bytes'))} | "
                         f"{_gib(f.get('peak_pss_bytes'))} ({_gib(f.get('peak_rss_bytes'))}) | "
                         f"{f.get('first_batch_s', '-')} s | {f.get('load_1min', '-')} | {_reps(f)} |")
        if "error" in phases:
            why = phases["error"].rsplit(" | ", 1)[-1].strip()[:300].replace("|", "/")  # the exception's line
            lines.append(f"| {row}: **failed**: {why} | | | | | | | |")
    met = r["goals_met"]

    def goal(k: str) -> str:
        v = r.get(k)
        verdict = "not measured in this run" if v is None else "met" if met.get(k) else "**not met**"
        return f"| `{k}` | {v if v is not None else '-'} | >= {GOALS[k]} ({verdict}) |"

    p = r["persist"]
    table = "\n".join(lines)
    return f"""## Images: a training loop's input pipeline

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs, load average {_load(r)}: the machine is
shared, so absolute figures move; the ratios are within this run, and each row's 1-minute load is in the table).
The set: {s["images"]} synthetic ImageNet-like JPEGs (`workflows data synth-images`, mean {s["mean_image_bytes"] / 1e3:.0f} KB,
{s["classes"]} classes) in {s["shards"]} tar shards, {s["bytes"] / 1e9:.2f} GB, on the embedded S3 endpoint;
written in {s["generate_s"]} s ({s["generate_images_per_s"]} images/s). Every row: decode,
RandomResizedCrop(224), flip, uint8 CHW, batches of {r["batch_size"]}, {r["workers"]} decode processes, its own
process tree. Images/s is the steady rate after the first batch. Store bytes: counted by the endpoint. Memory: the
peak of PSS summed over the row's processes (RSS summed in brackets, which counts shared pages once per process).

| row | images/s | conversion | bytes from the store | peak memory PSS (RSS) | first batch | load (1 min) | each repetition: images/s (or s) @ load |
| --- | --- | --- | --- | --- | --- | --- | --- |
{table}

| ratio | value | goal |
| --- | --- | --- |
{goal("warm_vs_best_peer")}
{goal("cold_vs_best_peer")}
{goal("warm_vs_local_dataloader")}
{goal("two_workers_vs_one")}
{goal("train_step_vs_loader")}
| `ray_data_train_step_vs_loader` (the defaults' training row ÷ ours, warm) | {r.get("ray_data_train_step_vs_loader") or "-"} | |
| `warm_vs_decode_limit` | {r.get("warm_vs_decode_limit") or "-"} | |
| `cold_indexed_vs_best_peer` (a set with its saved index, whole passes) | {r.get("cold_indexed_vs_best_peer") or "-"} | |

{_method(r)}{_training(rows)}

Best peer: {r.get("best_peer_warm") or "none run"} (warm), {r.get("best_peer_cold") or "none run"} (cold); WebDataset has no local cache: its one pass
counts as cold only. Peers' warm rows read their own caches{_persistent(r)}. `largest_set_bytes`: {_largest(r["set"]["bytes"]) / 1e9:.1f} GB
(the scale run below: what one of its epochs streamed).

The embedded store: moto keeps each object over ~5 MB in a spooled temp file ({s["spool_dir"]}, deleted-on-close files:
they show in `df`, not `du`), so a set larger than memory fits if that disk has room; its process held
{s["store_rss_bytes"] / 2**20:.0f} MiB RSS after the {s["bytes"] / 1e9:.1f} GB upload ({_spool(s)}). Persisting it
(each command's runtime does at its end): {p["persist_s"]} s to write {p["objects_written"]} objects,
{p["bytes_on_disk"] / 1e9:.2f} GB, into its data dir; a new endpoint restores them at start in {p["restore_s"]} s, so the
data dir holds a second copy and every start re-uploads it to moto.
"""  # noqa: E501 (markdown table rows: one line each)


def _limit(r: dict) -> str:
    n = r.get("max_images")
    return (f"**each epoch capped at its first {n} images** (not a full epoch where the set has more: such a "
            "point says so, and `largest_set_bytes` counts only what it read)") if n else \
        "each epoch whole: every image of the set once, checked by sample id"


def _how(p: dict, r: dict) -> str:
    painted = p.get("painted")
    if not painted:  # results from before each point said so: every set was copies of one painted base
        b = r.get("painted") or {}
        return f"server-side copies of {b.get('images', '?')} distinct images painted once, copied in " \
               f"{p['set'].get('copy_s', '-')} s"
    how = painted.get("how", "-").replace("|", "/")
    return f"{how}, {painted.get('seconds', '-')} s" + ("" if painted.get("distinct", True) else
                                                        " (copies: distinct images were more than the machine allowed)")


def _epoch(p: dict) -> str:
    f, total = p.get("ours_cold", {}), p["set"]["images"]
    s, cap = f.get("samples"), p.get("capped_at_images")
    capped = f" (capped at {cap})" if cap else ""
    if p.get("whole_epoch"):
        return f"whole, each of {total} once"
    if s:
        return f"**partial**: {s['distinct']} of {total} images, {s['repeated']} repeated{capped}"
    if "images" not in f:
        return "-"
    n = f["images"]
    return f"{n} of {total} images delivered, not checked by sample id" if n >= total else \
        f"**partial**: {n} of {total} images{capped}"


def _streamed(r: dict) -> int:
    """largest_set_bytes from the points themselves: results stored before it counted only what an
    epoch streamed said the painted size."""
    return max((streamed_bytes(p) for p in r["points"]), default=0)


def _scale_markdown(r: dict) -> str:
    lines = []
    for p in r["points"]:
        s, f = p["set"], p.get("ours_cold", {})
        c = f.get("cache", {})
        lines.append(f"| {s['bytes'] / 1e9:.1f} GB ({s['images']} images) | {_epoch(p)} | "
                     f"{p['cache_max_bytes'] / 1e9:.1f} GB | "
                     f"{f.get('images_per_s', '-')} | {p.get('images_per_s_vs_smallest', '-')} | "
                     f"{_gib(f.get('peak_pss_bytes'))} ({_gib(f.get('peak_rss_bytes'))}) | "
                     f"{_gib(f.get('peak_cache_disk_bytes'))} (<= {_gib(p.get('cache_disk_limit'))}"
                     + (f"; pins {_gib(c['peak_pinned_bytes'])}" if c.get("peak_pinned_bytes") else "") + ") | "
                     f"{_mb(f.get('store_get_bytes'))} | {c.get('evictions', '-')} | "
                     f"{_how(p, r)} | {_gib(f.get('store_peak_rss_bytes'))} | {f.get('load_1min', '-')} |"
                     + (f" failed: {p['error'][:200]}" if "error" in p else ""))
    met = r["goals_met"]
    table = "\n".join(lines)
    return f"""## Images: cost as the data grows

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs, load average {_load(r)}, shared machine).
Ours only: one cold epoch per set size, {r["workers"]} decode processes, the shard cache capped below the set
(`cache.max_bytes`) so that eviction runs; {_limit(r)}. Ray: {r["ray"]}. `largest_set_bytes`:
{_streamed(r) / 1e9:.2f} GB (what one epoch streamed, not what was painted). Cache disk: the peak of the
cache's files plus evicted files still open, sampled every 0.25 s; its goal is the cap plus one shard per decode process.
"pins": the most the loader holds pinned at once (its shuffle window, the batches in flight, the prefetched
shards), which no eviction can free: a cap below it cannot be met, and the loader warns that it is.

| set | epoch | cache cap | images/s | vs the smallest | peak memory PSS (RSS) | cache disk (goal) | bytes from the store | evictions | painted (how, time) | store process peak RSS | load (1 min) |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
{table}

The images/s swing with the shared machine's load (last column: the 1-minute load average at the end of each
epoch, on 2 cores), not with the set's size; memory, bytes fetched and evictions are what the size could move.
Goals: images/s within 10% of the smallest set's at every size ({"met" if met["images_per_s_vs_smallest"] else "**not met**"});
peak memory <= 6 GiB PSS summed ({"met" if met["peak_pss_bytes"] else "**not met**"}); cache disk within its goal
({_met(met.get("cache_disk_bytes"))}); every epoch whole, each image exactly once ({_met(met.get("exactly_once"))}).

![images/s and peak memory by set size](images/images_scale.png)
"""  # noqa: E501 (markdown table rows: one line each)

"""Images delivered to a training loop: our StreamLoader beside MosaicML Streaming, LitData,
WebDataset, a local-disk torch DataLoader and the decode limit, on one machine, in one run, from
the same shards behind the same S3 endpoint (the embedded one: moto over HTTP, in its own process,
counting the bytes it serves).

    python -m benchmarks.images                      # the rows, on a 1 GB set
    python -m benchmarks.images --tag scale --set bench.scale=1GB,5GB,27GB   # ours as the data grows

The set is written by `workflows data synth-images` (ImageNet-like JPEGs in ~128 MB tar shards).
Every row runs in its own process (ours: benchmarks.image_rows, in this venv; the peers:
benchmarks.image_peers, in the peers' venv, `make bench-peers`) and applies the same
transform with the same code (workflows.preprocess.images: decode, RandomResizedCrop(224, scale
(0.08, 1)), flip, uint8 CHW), batches of 256, the same number of decode processes
(`bench.workers`, 2). Per phase, this process measures what the row cannot claim for itself:
bytes the endpoint served (its own counters), and the peak memory of the row's process tree
(PSS summed over the processes, sampled every 0.25 s: shared pages counted once; RSS summed beside
it). The row reports images, images/s (steady: after its first batch) and the time to the first
batch. Cold: an empty local cache; warm: the next epoch in the same process.

Options (`--set bench.KEY=VALUE`): size (1GB), workers (2), reps (3: the rows
interleaved, medians kept), batch (256, every row's), classes (100),
rows (all, or a comma list of ours,ours_index,ours2,train_ray_data,train_stream,streaming,litdata,webdataset,local,
decode; train_*: images/s into the step of a real training run, benchmarks.images_train), peers_python (default
.venv-peers/bin/python, else $WORKFLOWS_BENCH_PEERS_PYTHON), scale (sizes: runs ours only, one
cold epoch per size with the cache capped below the set, `cache.max_bytes` or scale_cache_bytes),
scratch (a directory on the disk that holds the set twice over), shard_bytes (128MB), scale_distinct
(all: every scale set painted whole, every image distinct; a size, e.g. 1GB: that much painted once and
every scale set made of server-side copies of those shards, which each row then says),
scale_cache_bytes (900MB, or cache.max_bytes), scale_max_images (empty: each epoch whole, every image
once; a number caps each epoch, and each point then says it was capped and counts only what it read),
plot (docs/images/images_scale.png: the scale curve).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.images_common import GOALS, ROWS, _copy_set, _drop, _largest, _make_set, _say
from workflows.errors import UserError

PLOT = Path("docs/images/images_scale.png")  # the scale section embeds it (relative to docs/)
OPTIONS = {"size": "1GB", "workers": "2", "reps": "3", "batch": "256", "classes": "100", "rows": "all",
           "peers_python": "", "scale": "",
           "scale_cache_bytes": "", "scratch": "", "shard_bytes": "128MB", "scale_distinct": "all",
           "scale_max_images": "", "plot": str(PLOT)}
# warm: a peer's own cache; WebDataset has none, so its pass is a cold row ("no cache") only
PEER_PHASES = {"streaming": "streaming_warm", "litdata": "litdata_warm"}
COLD_PEER_PHASES = {"streaming": "streaming_cold", "litdata": "litdata_cold", "webdataset": "webdataset"}
# the headline ratios: a later run on the same settings that measured one again makes an older
# section's figure history (workflows.bench.superseded); bench.rows only picks which rows run
FIGURES = ("warm_vs_best_peer", "cold_vs_best_peer", "warm_vs_local_dataloader", "two_workers_vs_one",
           "train_step_vs_loader", "ray_data_train_step_vs_loader", "warm_vs_decode_limit", "cold_indexed_vs_best_peer")
SELECTION_SETTINGS = ("bench.rows",)


def _options(overrides: list[str]) -> tuple[dict, list[str]]:
    opts: dict[str, Any] = dict(OPTIONS)  # rows becomes a tuple below
    rest: list[str] = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.startswith("bench."):
            name = key[len("bench."):]
            if name not in OPTIONS:
                raise UserError(f"--set {key}: unknown option of bench images; one of "
                                f"{', '.join('bench.' + k for k in OPTIONS)}")
            opts[name] = value
        else:
            rest.append(o)
    rows = ROWS[:-1] if opts["rows"] == "all" else tuple(r.strip() for r in opts["rows"].split(","))
    bad = [r for r in rows if r not in ROWS or r == "ours_end"]
    if bad:
        raise UserError(f"--set bench.rows: unknown row(s) {', '.join(bad)}; one of all, {', '.join(ROWS[:-1])}")
    opts["rows"] = rows
    if not opts["reps"].isdigit() or int(opts["reps"]) < 1:
        raise UserError(f"--set bench.reps={opts['reps']!r}: a positive number of repetitions")
    if not opts["batch"].isdigit() or int(opts["batch"]) < 1:
        raise UserError(f"--set bench.batch={opts['batch']!r}: a positive batch size")
    if not opts["workers"].isdigit() or int(opts["workers"]) < 1:
        raise UserError(f"--set bench.workers={opts['workers']!r}: a positive number of decode processes")
    return opts, rest


def run(config: str | None, overrides: list[str]) -> dict:
    from workflows.config import load_config
    from workflows.preprocess.synth_images import parse_size
    from workflows.runtime import runtime

    opts, rest = _options(overrides)
    sizes = [parse_size(s, "bench.scale") for s in opts["scale"].split(",") if s.strip()] if opts["scale"] else []
    size = parse_size(opts["size"], "bench.size")
    scratch = Path(tempfile.mkdtemp(prefix="workflows-bench-images-", dir=opts["scratch"] or None))
    try:
        cfg = load_config(config or "quickstart", [
            *rest, f"storage.embedded.data_dir={scratch}/s3", f"cache.dir={scratch}/cache",
            f"output_dir={scratch}/runs", "tracking.enabled=false"])
        if not cfg.storage.embedded.enabled:
            raise UserError("bench images counts traffic at the embedded S3 endpoint: "
                            "set storage.embedded.enabled=true")
        with runtime(cfg, ray_needed=False) as rt:
            if sizes:
                from benchmarks.images_scale import _scale

                return _scale(rt, scratch, opts, sizes)
            return _rows(rt, scratch, opts, size)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- the rows -----------------------------------------------------------------------------------
def _rows(rt, scratch: Path, opts: dict, size: int) -> dict:
    from benchmarks.images_proc import _env, _ours_cmd, _peers_python, _phases
    from benchmarks.images_train import config_file, train_row

    workers, reps = int(opts["workers"]), int(opts["reps"])
    prefix = rt.cfg.uri("bench", "images", "set")
    _say(f"bench images: writing a {size / 1e9:.1f} GB set to {prefix}")
    data = _make_set(rt, prefix, size, opts)
    index = data.pop("index")
    if "ours_index" in opts["rows"]:  # the same shards without index.json: ours builds the index
        _copy_set(rt, prefix, index, prefix + "-noindex", data["bytes"], index_json=False)
    logs = scratch / "logs"
    logs.mkdir()
    env = _env()
    common = {"endpoint": rt.storage.endpoint_url, "prefix": prefix, "workers": workers, "batch": int(opts["batch"])}
    ours = {**common, "cache_dir": str(scratch / "cache-ours"), "max_bytes": None}
    peers, why = _peers_python(opts)
    train_cfg = config_file(rt, scratch, opts, prefix)

    def one(row: str, rep: int) -> dict:
        """One row, once: its own fresh cache (cold is cold in every repetition)."""
        name = f"{row}-rep{rep}"
        shutil.rmtree(scratch / "cache-ours", ignore_errors=True)
        if row == "ours":
            return _phases(name, [_ours_cmd({**ours, "phases": ["ours_cold", "ours_warm"]})], env, rt, logs)
        if row == "ours_index":
            # read_index saves the index it builds beside the set: each repetition starts without it
            _drop(prefix + "-noindex/index.json", rt.storage)
            args = {**ours, "prefix": prefix + "-noindex", "build_index": True, "phases": ["ours_cold_after_index"]}
            return _phases(name, [_ours_cmd(args)], env, rt, logs)
        if row.startswith("train_"):
            return train_row(row, rep, train_cfg, opts, env, rt, scratch, logs)
        if row == "ours2":  # two training ranks on this node, the same decode processes in all; cold,
            # then the warm epoch that two_workers_vs_one compares with ours warm (warm with warm)
            per = max(1, workers // 2)
            return _phases(name, [_ours_cmd({**ours, "phases": ["ours_2_workers_cold", "ours_2_workers"], "rank": r,
                                             "world_size": 2,
                                             "workers": per}) for r in range(2)], env, rt, logs)
        if peers is None:
            return {"error": why}
        args = {**common, "scratch": str(scratch / "peers")}
        out = _phases(name, [[peers, "-m", "benchmarks.image_peers", row, json.dumps(args)]], env, rt, logs)
        if row in ("streaming", "litdata"):  # a peer's converted copy and cache: made again next repetition
            _drop(prefix + ("-mds" if row == "streaming" else "-litdata"), rt.storage)
            shutil.rmtree(scratch / "peers" / ("mds-cache" if row == "streaming" else "litdata-cache"),
                          ignore_errors=True)
        return out

    # the rows interleaved, repetition by repetition, their order rotated each time: a load that
    # drifts moves every row alike, and no row always runs first or after the same one
    runs: dict[str, list[dict]] = {row: [] for row in ROWS if row in opts["rows"]}
    for rep in range(reps):
        _say(f"bench images: repetition {rep + 1} of {reps}")
        for row in rotated(list(runs), rep):
            runs[row].append(one(row, rep))
        shutil.rmtree(scratch / "peers", ignore_errors=True)  # decode reads local's files: both done
    rows = {row: median_row(each) for row, each in runs.items()}
    ran = [k for k, v in rows.items() if not k.startswith("ours") and set(v) - {"error", "reps"}]
    if reps == 1 and "ours" in rows and ran:  # one repetition: ours again after the peers brackets them
        rows["ours_end"] = _phases("ours_end", [_ours_cmd({**ours, "phases": ["ours_warm_end"]})], env, rt, logs)
    if any(r.startswith("train_") for r in runs):  # the runs' pixels and checkpoints: not the set's to persist
        from workflows.config import load_config

        _drop(load_config(train_cfg).uri("processed"), rt.storage)
        _drop(load_config(train_cfg).uri("runs"), rt.storage)
    persist = _persist_cost(rt, scratch)
    _drop(prefix, rt.storage)
    _drop(prefix + "-noindex", rt.storage)
    return {"set": data, "workers": workers, "batch_size": int(opts["batch"]), "repetitions": reps, "rows": rows,
            "persist": persist, "peer_persistent_workers": True, **_ratios(rows),
            "largest_set_bytes": _largest(data["bytes"]), "goals": GOALS}


def rotated(rows: list[str], rep: int) -> list[str]:
    """The rows' order in repetition `rep`: shifted by `rep`, with decode kept right after local
    (it reads the files local wrote)."""
    groups = [[r] for r in rows if r != "decode"]
    for g in groups:
        if g == ["local"] and "decode" in rows:
            g.append("decode")
    if "decode" in rows and "local" not in rows:
        groups.append(["decode"])
    k = rep % len(groups) if groups else 0
    return [r for g in groups[k:] + groups[:k] for r in g]


def median_row(each: list[dict]) -> dict:
    """One row's repetitions -> per phase, the figures of its median repetition (by images/s, or
    seconds where a phase has no rate: a conversion), and every repetition's rate, time and 1-min
    load beside them (`reps`). A repetition that failed is named in `error`."""
    import statistics

    out: dict = {}
    for phase in [ph for ph in dict.fromkeys(k for r in each for k in r) if ph != "error"]:
        done = [r[phase] for r in each if phase in r]
        key = "images_per_s" if all("images_per_s" in f for f in done) else "seconds"
        mid = statistics.median_low([f[key] for f in done])
        out[phase] = {**next(f for f in done if f[key] == mid),
                      "reps": [{k: f.get(k) for k in ("images_per_s", "seconds", "load_1min")} for f in done]}
    errors = [f"repetition {i + 1}: {r['error']}" for i, r in enumerate(each) if "error" in r]
    if errors:  # the same failure in every repetition (no peers' venv, say): said once
        same = len(errors) == len(each) and len({r["error"] for r in each}) == 1
        out["error"] = each[0]["error"] if same else "; ".join(errors)
    return out


def _ips(rows: dict, row: str, phase: str) -> float | None:
    return rows.get(row, {}).get(phase, {}).get("images_per_s")


def _ratios(rows: dict) -> dict:
    """Each figure the median of its repetitions. With one repetition (older results), ours warm is
    the mean of its pass before the peers and the one after them (`ours_end`), bracketing them in time.
    Cold, where the index-build row ran: ours pays the index build too, so its cold rate is images over
    (index build + first epoch) seconds, against each peer's whole cold pass (first batch included)."""
    warm, cold = _ips(rows, "ours", "ours_warm"), _ips(rows, "ours", "ours_cold")
    end = _ips(rows, "ours_end", "ours_warm_end")
    if warm and end:
        warm = (warm + end) / 2
    peer_warm = {p: v for p, ph in PEER_PHASES.items() if (v := _ips(rows, p, ph))}
    build, first = (rows.get("ours_index", {}).get(ph, {}) for ph in ("ours_index_build", "ours_cold_after_index"))
    with_index = bool(build.get("seconds") and first.get("images"))
    indexed = rows.get("ours", {}).get("ours_cold", {}).get("images_per_s_whole_pass")  # a set with index.json
    if with_index:
        cold = first["images"] / (build["seconds"] + first["seconds"])
    rate = "images_per_s_whole_pass" if with_index else "images_per_s"
    peer_cold = {p: v for p, ph in COLD_PEER_PHASES.items() if (v := rows.get(p, {}).get(ph, {}).get(rate))}
    peer_whole = {p: v for p, ph in COLD_PEER_PHASES.items()
                  if (v := rows.get(p, {}).get(ph, {}).get("images_per_s_whole_pass"))}
    local, two = _ips(rows, "local", "local_dataloader"), _ips(rows, "ours2", "ours_2_workers")
    # a two-rank pass that read from the store (results from before that row ran cold then warm, when
    # each repetition emptied the cache before its one pass) is compared with ours cold
    two_cold = (rows.get("ours2", {}).get("ours_2_workers", {}).get("store_get_bytes") or 0) > 0
    two_vs = _ips(rows, "ours", "ours_cold") if two_cold else warm
    step, ray_data = _ips(rows, "train_stream", "train_stream"), _ips(rows, "train_ray_data", "train_ray_data")
    decode = _ips(rows, "decode", "decode_limit")

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    best_warm = max(peer_warm, key=peer_warm.__getitem__) if peer_warm else None
    best_cold = max(peer_cold, key=peer_cold.__getitem__) if peer_cold else None
    r = {"best_peer_warm": best_warm, "best_peer_cold": best_cold,
         "warm_vs_best_peer": ratio(warm, peer_warm.get(best_warm)) if best_warm else None,
         "cold_vs_best_peer": ratio(cold, peer_cold.get(best_cold)) if best_cold else None,
         "warm_vs_local_dataloader": ratio(warm, local), "two_workers_vs_one": ratio(two, two_vs),
         "warm_vs_decode_limit": ratio(warm, decode), "cold_includes_index_build": with_index,
         "train_step_vs_loader": ratio(step, warm), "ray_data_train_step_vs_loader": ratio(ray_data, warm),
         "ours_cold_images_per_s": round(cold, 1) if cold else None,
         # the index is built once per set and saved beside it (as the peers convert once): every later
         # cold reader, on any machine, reads a set that has it
         "cold_indexed_vs_best_peer": ratio(indexed, max(peer_whole.values())) if indexed and peer_whole else None}
    r["goals_met"] = {k: (r[k] is not None and r[k] >= g) for k, g in GOALS.items()}
    return r


def _persist_cost(rt, scratch: Path) -> dict:
    """What keeping the set costs: the endpoint writing its objects to its data dir (as every command's
    runtime does at its end) and a new endpoint restoring them (as at its start)."""
    from workflows.storage.embedded import EmbeddedS3

    t0 = time.perf_counter()
    written = rt.embedded.persist()
    persist_s = time.perf_counter() - t0
    data_dir = rt.embedded.data_dir
    on_disk = sum(f.stat().st_size for f in (data_dir / "objects").iterdir())
    copy = scratch / "s3-restore"  # hard links: the same files, restored by a second endpoint
    shutil.copytree(data_dir, copy, copy_function=os.link, ignore=shutil.ignore_patterns("lock", "endpoint.json"))
    t0 = time.perf_counter()
    second = EmbeddedS3(str(copy))
    second.start()
    restore_s = time.perf_counter() - t0
    second._release()  # nothing changed: no second persist
    shutil.rmtree(copy, ignore_errors=True)
    return {"objects_written": written, "bytes_on_disk": on_disk, "persist_s": round(persist_s, 1),
            "restore_s": round(restore_s, 1), "data_dir": "<scratch>/s3"}


def markdown(r: dict) -> str:
    from benchmarks.images_report import markdown as render

    return render(r)


if __name__ == "__main__":
    from benchmarks.record import main

    main("images")

"""Images delivered to a training loop: our StreamLoader beside MosaicML Streaming, LitData,
WebDataset, a local-disk torch DataLoader and the decode limit, on one machine, in one run, from
the same shards behind the same S3 endpoint (the embedded one: moto over HTTP, in its own process,
counting the bytes it serves).

    workflows bench images                      # the rows, on a 1 GB set
    workflows bench images --tag scale --set bench.scale=1GB,5GB,27GB   # ours as the data grows

The set is written by `workflows data synth-images` (ImageNet-like JPEGs in ~128 MB tar shards).
Every row runs in its own process (ours: workflows.bench.image_rows, in this venv; the peers:
workflows.bench.image_peers, in the peers' venv, `make bench-peers`) and applies the same
transform with the same code (workflows.preprocess.images: decode, RandomResizedCrop(224, scale
(0.08, 1)), flip, uint8 CHW), batches of 256, the same number of decode processes
(`bench.workers`, 2). Per phase, this process measures what the row cannot claim for itself:
bytes the endpoint served (its own counters), and the peak memory of the row's process tree
(PSS summed over the processes, sampled every 0.25 s: shared pages counted once; RSS summed beside
it). The row reports images, images/s (steady: after its first batch) and the time to the first
batch. Cold: an empty local cache; warm: the next epoch in the same process.

Options (`--set bench.KEY=VALUE`): size (1GB), workers (2), classes (100), rows (all, or a comma
list of ours,ours2,streaming,litdata,webdataset,local,decode), peers_python (default
.venv-peers/bin/python, else $WORKFLOWS_BENCH_PEERS_PYTHON), scale (sizes: runs ours only, one
cold epoch per size with the cache capped below the set, `cache.max_bytes` or scale_cache_bytes),
scratch (a directory on the disk that holds the set twice over), shard_bytes (128MB), scale_distinct
(1GB painted once; every scale set is server-side copies of those shards under new names),
scale_cache_bytes (900MB, or cache.max_bytes), scale_max_images (30000 images of each epoch; empty: all),
plot (docs/images/images_scale.png: the scale curve).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from workflows.errors import UserError

GOALS = {"warm_vs_best_peer": 1.0, "cold_vs_best_peer": 0.9, "warm_vs_local_dataloader": 0.9,
         "two_workers_vs_one": 0.9}
SCALE_GOALS = {"images_per_s_vs_smallest": 0.9, "peak_pss_bytes": 6 * 2**30}
PLOT = Path("docs/images/images_scale.png")  # the scale section embeds it (relative to docs/)
OPTIONS = {"size": "1GB", "workers": "2", "classes": "100", "rows": "all", "peers_python": "", "scale": "",
           "scale_cache_bytes": "", "scratch": "", "shard_bytes": "128MB", "scale_distinct": "1GB",
           "scale_max_images": "30000", "plot": str(PLOT)}
ROWS = ("ours", "ours2", "streaming", "litdata", "webdataset", "local", "decode", "ours_end")
PEER_PHASES = {"streaming": "streaming_warm", "litdata": "litdata_warm", "webdataset": "webdataset"}
COLD_PEER_PHASES = {"streaming": "streaming_cold", "litdata": "litdata_cold", "webdataset": "webdataset"}
ROOT = Path(__file__).resolve().parents[2]  # the tree the rows import workflows from


def _options(overrides: list[str]) -> tuple[dict, list[str]]:
    opts, rest = dict(OPTIONS), []
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
                return _scale(rt, scratch, opts, sizes)
            return _rows(rt, scratch, opts, size)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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
            "mean_image_bytes": round(total / images), "store_rss_bytes": psutil.Process(store_pid).memory_info().rss,
            "spool_dir": spool, "spool_disk_bytes_approx": free_before - shutil.disk_usage(spool).free}


def _copy_set(rt, src: str, src_index: dict, dst: str, size: int) -> dict:
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
    shards, todo, total = [], [], 0
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
    write_json(join(dst, "index.json"), index, rt.storage)
    return {**_describe(index, rt.embedded._proc.pid, spool, free_before),
            "copy_s": round(time.perf_counter() - t0, 1)}


def _drop(uri: str, ctx) -> None:
    from workflows.storage.uri import filesystem

    fs, path = filesystem(uri, ctx)
    if fs.exists(path):
        fs.rm(path, recursive=True)


# -- running rows -------------------------------------------------------------------------------
class _Memory:
    """Peak memory of process trees, sampled in a thread: PSS and RSS summed over the trees."""

    def __init__(self, roots: list[int], store_pid: int | None):
        self.roots, self.store_pid = roots, store_pid
        self.peak_pss = self.peak_rss = self.store_peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        import psutil

        pss = rss = 0
        for root in self.roots:
            try:
                top = psutil.Process(root)
                procs = [top, *top.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    m = p.memory_full_info()
                    pss, rss = pss + m.pss, rss + m.rss
                except psutil.Error:
                    pass
        self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
        if self.store_pid:
            try:
                self.store_peak_rss = max(self.store_peak_rss, psutil.Process(self.store_pid).memory_info().rss)
            except psutil.Error:
                pass

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def _read_until(proc, prefix: str) -> str | None:
    """The next line of `proc` starting with `prefix` (other output, a library's, is skipped)."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    return None


def _phases(name: str, cmds: list[list[str]], env: dict, rt, log_dir: Path) -> dict:
    """Run one row (one or several processes in lock step) through its phases; -> {phase: figures}.
    A failed row keeps the phases it finished and says why in `error`."""
    from workflows.storage.embedded import endpoint_traffic

    url, store_pid = rt.storage.endpoint_url, rt.embedded._proc.pid
    logs = [open(log_dir / f"{name}-{i}.log", "w") for i in range(len(cmds))]
    procs = [subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                              cwd=ROOT) for c, log in zip(cmds, logs, strict=True)]
    out: dict = {}
    try:
        while True:
            names = [_read_until(p, "@phase ") for p in procs]
            if all(n is None for n in names):
                break
            if len(set(names)) != 1:
                raise RuntimeError(f"the row's processes are out of step: {names}")
            phase = names[0]
            _say(f"bench images: {phase} ...")
            before = endpoint_traffic(url)
            with _Memory([p.pid for p in procs], store_pid) as mem:
                for p in procs:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                results = [_read_until(p, "@result ") for p in procs]
            after = endpoint_traffic(url)
            if any(r is None for r in results):
                break
            parts = [json.loads(r) for r in results]
            merged = _merge(parts)
            get = after["bytes_out"].get("GET", 0) - before["bytes_out"].get("GET", 0)
            merged.update(store_get_bytes=get, peak_pss_bytes=mem.peak_pss, peak_rss_bytes=mem.peak_rss,
                          store_peak_rss_bytes=mem.store_peak_rss, processes=len(procs),
                          load_1min=round(os.getloadavg()[0], 2))
            out[phase] = merged
            _say(f"bench images: {phase}: {merged.get('images_per_s', '-')} images/s, "
                 f"{get / 1e6:.0f} MB from the store, peak PSS {mem.peak_pss / 2**30:.2f} GiB")
        for p in procs:
            p.wait(timeout=600)
    except Exception as e:  # a row that breaks is reported, the others still run
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if any(codes) and "error" not in out:
        lines = [ln.strip() for ln in (log_dir / f"{name}-{codes.index(next(c for c in codes if c))}.log")
                 .read_text(errors="replace").splitlines() if ln.strip()]
        # the exception's own line (the last "XxxError: ..." one), then the log's last lines
        raised = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", ln)][-1:]
        out["error"] = f"exit {codes}: " + " | ".join([*lines[-6:], *raised])
    if "error" in out:
        _say(f"bench images: row {name} failed: {out['error']}")
    return out


def _merge(parts: list[dict]) -> dict:
    """Several ranks' figures of one phase: images and images/s summed, times the slowest rank's."""
    if len(parts) == 1:
        return parts[0]
    merged = {k: v for k, v in parts[0].items() if not isinstance(v, int | float)}
    for k in ("images", "images_per_s", "images_per_s_whole_pass"):
        if all(k in p for p in parts):
            merged[k] = round(sum(p[k] for p in parts), 1)
    for k in ("seconds", "first_batch_s"):
        if all(k in p for p in parts):
            merged[k] = max(p[k] for p in parts)
    merged["ranks"] = parts
    return merged


def _peers_python(opts: dict) -> tuple[str | None, str]:
    """The peers' venv python, or None and why."""
    if opts["peers_python"]:
        if Path(opts["peers_python"]).exists():
            return opts["peers_python"], ""
        return None, f"bench.peers_python={opts['peers_python']}: not found (make bench-peers creates .venv-peers)"
    for candidate in (os.environ.get("WORKFLOWS_BENCH_PEERS_PYTHON", ""), str(ROOT / ".venv-peers" / "bin" / "python")):
        if candidate and Path(candidate).exists():
            return candidate, ""
    return None, "no peers venv: run `make bench-peers` (or --set bench.peers_python=PATH)"


def _ours_cmd(args: dict) -> list[str]:
    return [sys.executable, "-m", "workflows.bench.image_rows", json.dumps(args)]


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORKFLOWS_VERBOSE", None)
    return env


# -- the rows -----------------------------------------------------------------------------------
def _rows(rt, scratch: Path, opts: dict, size: int) -> dict:
    workers = int(opts["workers"])
    prefix = rt.cfg.uri("bench", "images", "set")
    _say(f"bench images: writing a {size / 1e9:.1f} GB set to {prefix}")
    data = _make_set(rt, prefix, size, opts)
    data.pop("index")
    logs = scratch / "logs"
    logs.mkdir()
    env, rows = _env(), {}
    common = {"endpoint": rt.storage.endpoint_url, "prefix": prefix, "workers": workers}
    if "ours" in opts["rows"] or "ours2" in opts["rows"]:
        ours = {**common, "cache_dir": str(scratch / "cache-ours"), "max_bytes": None}
        rows["ours"] = _phases("ours", [_ours_cmd({**ours, "phases": ["ours_cold", "ours_warm"]})], env, rt, logs)
        if "ours2" in opts["rows"]:  # two training ranks on this node, the same decode processes in all
            per = max(1, workers // 2)
            cmds = [_ours_cmd({**ours, "phases": ["ours_2_workers"], "rank": r, "world_size": 2, "workers": per})
                    for r in range(2)]
            rows["ours2"] = _phases("ours2", cmds, env, rt, logs)
    peers, why = _peers_python(opts)
    for row in ("streaming", "litdata", "webdataset", "local", "decode"):
        if row not in opts["rows"]:
            continue
        if peers is None:
            rows[row] = {"error": why}
            continue
        args = {**common, "scratch": str(scratch / "peers")}
        cmd = [peers, "-m", "workflows.bench.image_peers", row, json.dumps(args)]
        rows[row] = _phases(row, [cmd], env, rt, logs)
        if row in ("streaming", "litdata"):  # a peer's converted copy and cache: not needed again
            _drop(prefix + ("-mds" if row == "streaming" else "-litdata"), rt.storage)
            shutil.rmtree(scratch / "peers" / ("mds-cache" if row == "streaming" else "litdata-cache"),
                          ignore_errors=True)
    shutil.rmtree(scratch / "peers", ignore_errors=True)
    ran = [k for k, v in rows.items() if k not in ("ours", "ours2") and set(v) - {"error"}]
    if "ours" in rows and ran:  # ours again after the peers: the load drifts
        ours = {**common, "cache_dir": str(scratch / "cache-ours"), "max_bytes": None}
        rows["ours_end"] = _phases("ours_end", [_ours_cmd({**ours, "phases": ["ours_warm_end"]})], env, rt, logs)
    persist = _persist_cost(rt, scratch)
    _drop(prefix, rt.storage)
    return {"set": data, "workers": workers, "batch_size": 256, "rows": rows, "persist": persist,
            **_ratios(rows), "largest_set_bytes": _largest(data["bytes"]), "goals": GOALS}


def _ips(rows: dict, row: str, phase: str) -> float | None:
    return rows.get(row, {}).get(phase, {}).get("images_per_s")


def _ratios(rows: dict) -> dict:
    """Ours warm is the mean of its pass before the peers and the one after them, which brackets
    the peers in time on a machine whose load drifts."""
    warm, cold = _ips(rows, "ours", "ours_warm"), _ips(rows, "ours", "ours_cold")
    end = _ips(rows, "ours_end", "ours_warm_end")
    if warm and end:
        warm = (warm + end) / 2
    peer_warm = {p: v for p, ph in PEER_PHASES.items() if (v := _ips(rows, p, ph))}
    peer_cold = {p: v for p, ph in COLD_PEER_PHASES.items() if (v := _ips(rows, p, ph))}
    local, two = _ips(rows, "local", "local_dataloader"), _ips(rows, "ours2", "ours_2_workers")
    decode = _ips(rows, "decode", "decode_limit")

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    best_warm = max(peer_warm, key=peer_warm.get) if peer_warm else None
    best_cold = max(peer_cold, key=peer_cold.get) if peer_cold else None
    r = {"best_peer_warm": best_warm, "best_peer_cold": best_cold,
         "warm_vs_best_peer": ratio(warm, peer_warm.get(best_warm)) if best_warm else None,
         "cold_vs_best_peer": ratio(cold, peer_cold.get(best_cold)) if best_cold else None,
         "warm_vs_local_dataloader": ratio(warm, local), "two_workers_vs_one": ratio(two, warm),
         "warm_vs_decode_limit": ratio(warm, decode)}
    r["goals_met"] = {k: (r[k] is not None and r[k] >= g) for k, g in GOALS.items()}
    return r


def _largest(this_run: int) -> int:
    """The largest set measured: this run's, or the scale run's stored beside it (images-scale.json)."""
    from workflows.bench import RESULTS_DIR

    try:
        scale = json.loads((RESULTS_DIR / "images-scale.json").read_text())
        return max(this_run, int(scale["largest_set_bytes"]))
    except (OSError, ValueError, KeyError):
        return this_run


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


# -- the scale curve ----------------------------------------------------------------------------
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


# -- report -------------------------------------------------------------------------------------
def _spool(s: dict) -> str:
    n = s["spool_disk_bytes_approx"]
    if n < s["bytes"] / 2:  # free space also moves with what the machine's other sessions write
        return "its disk use, read from free space, was swamped by other sessions' writes on this shared disk"
    return f"about {n / 1e9:.1f} GB of disk, read from free space, approximate on a shared disk"


def _load(r: dict) -> str:
    la = r["machine"]["load_average"]
    return f"{la['before']} before, {la['after_15min']} over the last 15 min"


def _limit(r: dict) -> str:
    n = r.get("max_images")
    return f"each epoch measured over its first {n} images (all of them where the set has fewer)" if n else \
        "each epoch measured whole"


def _painted(r: dict) -> str:
    b = r["painted"]
    return (f"{b['images']} images ({b['bytes'] / 1e9:.2f} GB) were painted once by synth-images in "
            f"{b['generate_s']} s; "
            "each set is server-side copies of those shards under new names, written, read and deleted in turn (the "
            "bytes fetched, cached and decoded cost the same whether images repeat; painting 27 GB needs CPU the "
            "shared machine lacks).")


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n is not None else "-"


def _mb(n) -> str:
    return f"{n / 1e6:.0f} MB" if n is not None else "-"


LABELS = {"ours_cold": "ours (StreamLoader), cold", "ours_warm": "ours, warm",
          "ours_2_workers": "ours, 2 training ranks (1 decode process each), summed",
          "streaming_cold": "MosaicML Streaming (MDS), cold", "streaming_warm": "MosaicML Streaming, warm",
          "litdata_cold": "LitData, cold", "litdata_warm": "LitData, warm",
          "webdataset": "WebDataset, tars streamed from S3", "local_dataloader": "torch DataLoader, local files",
          "decode_limit": "decode limit: N processes decoding local files",
          "ours_warm_end": "ours, warm, again after the peers"}
CONVERSIONS = {"streaming": "streaming_convert", "litdata": "litdata_convert", "local": "local_convert"}


def markdown(r: dict) -> str:
    return _scale_markdown(r) if "points" in r else _rows_markdown(r)


def _rows_markdown(r: dict) -> str:
    s, rows = r["set"], r["rows"]
    lines = []
    for row in [r for r in ROWS if r in rows]:  # stored with sorted keys: the report's own order
        phases = rows[row]
        conv = phases.get(CONVERSIONS.get(row, ""), {}).get("seconds")
        for phase in [p for p in LABELS if p in phases]:
            f = phases[phase]
            lines.append(f"| {LABELS.get(phase, phase)} | {f.get('images_per_s', '-')} | "
                         f"{f'{conv:.0f} s' if conv is not None else '-'} | {_mb(f.get('store_get_bytes'))} | "
                         f"{_gib(f.get('peak_pss_bytes'))} ({_gib(f.get('peak_rss_bytes'))}) | "
                         f"{f.get('first_batch_s', '-')} s | {f.get('load_1min', '-')} |")
        if "error" in phases:
            why = phases["error"].rsplit(" | ", 1)[-1].strip()[:300].replace("|", "/")  # the exception's line
            lines.append(f"| {row}: **failed**: {why} | | | | | | |")
    met = r["goals_met"]

    def goal(k: str) -> str:
        v = r.get(k)
        return f"| `{k}` | {v if v is not None else '-'} | >= {GOALS[k]} ({'met' if met[k] else '**not met**'}) |"

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

| row | images/s | conversion | bytes from the store | peak memory PSS (RSS) | first batch | load (1 min) |
| --- | --- | --- | --- | --- | --- | --- |
{table}

| ratio | value | goal |
| --- | --- | --- |
{goal("warm_vs_best_peer")}
{goal("cold_vs_best_peer")}
{goal("warm_vs_local_dataloader")}
{goal("two_workers_vs_one")}
| `warm_vs_decode_limit` | {r.get("warm_vs_decode_limit")} | |

Ours warm in the ratios: the mean of its pass before the peers and the one after them.

Best peer: {r.get("best_peer_warm")} (warm), {r.get("best_peer_cold")} (cold); WebDataset has no local cache and counts
as both. `largest_set_bytes`: {r["largest_set_bytes"] / 1e9:.1f} GB (the scale run below).

The embedded store: moto keeps each object over ~5 MB in a spooled temp file ({s["spool_dir"]}, deleted-on-close files:
they show in `df`, not `du`), so a set larger than memory fits if that disk has room; its process held
{s["store_rss_bytes"] / 2**20:.0f} MiB RSS after the {s["bytes"] / 1e9:.1f} GB upload ({_spool(s)}). Persisting it
(each command's runtime does at its end): {p["persist_s"]} s to write {p["objects_written"]} objects,
{p["bytes_on_disk"] / 1e9:.2f} GB, into its data dir; a new endpoint restores them at start in {p["restore_s"]} s, so the
data dir holds a second copy and every start re-uploads it to moto.
"""  # noqa: E501 (markdown table rows: one line each)


def _scale_markdown(r: dict) -> str:
    lines = []
    for p in r["points"]:
        s, f = p["set"], p.get("ours_cold", {})
        c = f.get("cache", {})
        lines.append(f"| {s['bytes'] / 1e9:.1f} GB ({s['images']} images) | {p['cache_max_bytes'] / 1e9:.1f} GB | "
                     f"{f.get('images_per_s', '-')} | {p.get('images_per_s_vs_smallest', '-')} | "
                     f"{_gib(f.get('peak_pss_bytes'))} ({_gib(f.get('peak_rss_bytes'))}) | "
                     f"{_mb(f.get('store_get_bytes'))} | {c.get('evictions', '-')} | "
                     f"{s['copy_s']} s | {_gib(f.get('store_peak_rss_bytes'))} | {f.get('load_1min', '-')} |"
                     + (f" failed: {p['error'][:200]}" if "error" in p else ""))
    met = r["goals_met"]
    table = "\n".join(lines)
    return f"""## Images: cost as the data grows

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs, load average {_load(r)}, shared machine).
Ours only: one cold epoch per set size, {r["workers"]} decode processes, the shard cache capped below the set
(`cache.max_bytes`) so that eviction runs; {_limit(r)}. Ray: {r["ray"]}. {_painted(r)}

| set | cache cap | images/s | vs the smallest | peak memory PSS (RSS) | bytes from the store | evictions | copied in | store process peak RSS | load (1 min) |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
{table}

The images/s swing with the shared machine's load (last column: the 1-minute load average at the end of each
epoch, on 2 cores), not with the set's size; memory, bytes fetched and evictions are what the size could move.
Goals: images/s within 10% of the smallest set's at every size ({"met" if met["images_per_s_vs_smallest"] else "**not met**"});
peak memory <= 6 GiB PSS summed ({"met" if met["peak_pss_bytes"] else "**not met**"}).

![images/s and peak memory by set size](images/images_scale.png)
"""  # noqa: E501 (markdown table rows: one line each)

"""object_store_outage: the endpoint goes away —
- killed: the embedded endpoint's process is SIGKILLed, then every data-path call runs against
  its (now closed) port, in parallel, with the config's default retries: each must raise a
  UserError naming the URI or the endpoint, within a bound, and never hang;
- mid-transfer: the proxy dies (listener closed, open connections reset) while a ShardCache
  download and a registry.fetch are streaming through it: they must fail the same way and leave
  no cache entry, no temp file and no half-downloaded model directory behind;
- a warm shard (cached, its version known from an earlier listing) is still readable;
- write_bytes_atomic to a local path, SIGKILLed at random moments: the target is the old bytes
  or the new ones, never a partial file.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from reliability import make_row
from reliability.object_store_common import BUCKET, _put_fixture, _repo_root, _sha
from workflows.errors import UserError

MP = mp.get_context("fork")
OUTAGE_BOUND_S = 60.0


def object_store_outage(workdir: Path, seed: int = 0, bound_s: float = OUTAGE_BOUND_S, atomic_kills: int = 4) -> dict:
    from reliability.fault_proxy import FaultProxy
    from workflows.config import StorageConfig
    from workflows.storage.cache import ShardCache
    from workflows.storage.cache_dir import uri_prefix
    from workflows.storage.embedded import EmbeddedS3
    from workflows.storage.uri import StorageContext

    workdir = Path(workdir)
    rng = random.Random(seed)
    t_start = time.time()
    retries = StorageConfig().retries  # the config's default
    results: list[dict] = []  # {op, case, outcome, seconds, message}
    lost_notes: list[str] = []
    lost = 0
    with EmbeddedS3(str(workdir / "s3")) as s3:
        s3.ensure_bucket(BUCKET)
        direct = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True, retries=retries)
        objects = _put_fixture(direct.boto3_client(), rng)
        big = rng.randbytes(2 << 20)
        direct.boto3_client().put_object(Bucket=BUCKET, Key="big/shard.bin", Body=big)
        cfg = _registry_cfg(s3.url, workdir)
        _register_fake_model(cfg, direct, workdir, rng)

        # a warm shard, its version known from a listing made while the store was up
        warm_key = "raw/part-00.jsonl"
        head = direct.boto3_client().head_object(Bucket=BUCKET, Key=warm_key)
        warm = (f"s3://{BUCKET}/{warm_key}", head["ETag"].strip('"'), head["ContentLength"])
        cache_dir = workdir / "cache"
        ShardCache(str(cache_dir), direct).fetch(*warm)

        # 1. mid-transfer: the proxy (the endpoint, as the client sees it) dies under a download;
        #    both cases at once, each behind its own proxy
        downs: list[threading.Event] = []
        midway: dict[str, bool] = {}

        def mid_transfer(what: str, delay: float, down: threading.Event) -> dict:
            proxy = FaultProxy(s3.url, seed=seed, throttle_bytes_per_s=256 * 1024)
            proxy_url = proxy.start()
            ctx = StorageContext(endpoint_url=proxy_url, region="us-east-1", embedded=True, retries=retries)
            if what == "ShardCache.fetch":
                uri = f"s3://{BUCKET}/big/shard.bin"
                fn = lambda: ShardCache(str(cache_dir), ctx).fetch(uri)  # noqa: E731
            else:
                uri = "s3://workflows/models/m"
                fn = lambda: _registry_fetch(cfg, ctx)  # noqa: E731

            def outage():
                # evidence that the outage lands mid-transfer: the download's temp file/dir exists
                if what == "ShardCache.fetch":
                    midway[what] = bool(list(cache_dir.glob("*.tmp-*")))
                else:
                    models = Path(cfg.cache.resolved_dir()) / "models"
                    midway[what] = models.exists() and any(p.name.startswith(".") for p in models.iterdir())
                proxy.outage()
                down.set()

            timer = threading.Timer(delay, outage)
            timer.start()
            try:
                return _timed(what, "mid-transfer", fn, bound_s, [uri, proxy_url])
            finally:
                timer.join()
                proxy.stop()

        pool = ThreadPoolExecutor(max_workers=2)
        futs = []
        for what in ("ShardCache.fetch", "registry.fetch"):
            downs.append(threading.Event())
            futs.append(pool.submit(mid_transfer, what, 1.0 + rng.uniform(0, 1.0), downs[-1]))
        # 2. killed: once both proxies are down (their clients now retry against closed ports),
        #    SIGKILL the endpoint's process; every call then runs against its closed port
        for d in downs:
            d.wait(60)
        endpoint = s3._proc
        assert endpoint is not None  # this process spawned it (a fresh data dir)
        endpoint.send_signal(signal.SIGKILL)
        endpoint.wait(30)
        dead = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True, retries=retries)
        dead_results = _dead_endpoint_ops(dead, cfg, workdir, warm, bound_s)
        results.extend(f.result() for f in futs)
        pool.shutdown()
        # nothing half-written: a failed download leaves no entry, no temp file, no model
        # directory; one that completed before the outage (possible on a fast machine) is exact
        big_prefix = uri_prefix(f"s3://{BUCKET}/big/shard.bin")
        leftovers = [p for p in cache_dir.glob(big_prefix + "*") if not p.name.endswith(".lock")]
        if results[0]["outcome"] != "ok" and leftovers:
            lost += 1
            lost_notes.append(f"a failed ShardCache download left {[p.name for p in leftovers]}")
        elif results[0]["outcome"] == "ok" and _sha(Path(results[0]["value"]).read_bytes()) != _sha(big):
            lost += 1
            lost_notes.append("a ShardCache download that survived the outage holds other bytes")
        models_dir = Path(cfg.cache.resolved_dir()) / "models"
        entries = [p.name for p in models_dir.iterdir()] if models_dir.exists() else []
        if results[1]["outcome"] != "ok" and entries:
            lost += 1
            lost_notes.append(f"a failed registry.fetch left {entries} in {models_dir}")
        for r in results[:2]:
            if r["outcome"] == "ok":
                r["outcome"] = "completed before the outage"  # not what this case is for: reported, not failed
        results.extend(dead_results)
        # warm data from the cache is still there, and exact
        warm_read = next(r for r in results if r["op"] == "ShardCache.fetch (warm, version known)")
        if warm_read["outcome"] == "ok" and warm_read.get("value") != objects[warm_key]:
            lost += 1
            lost_notes.append("the warm cached shard read back other bytes")
        s3._proc = None  # already dead: nothing to wait on, nor to persist from it
        if s3.owner:
            s3._release()  # what leaving the block would do, less persist()
    atomic = _atomic_local_kills(workdir, rng, atomic_kills)
    lost += atomic["partial"]
    if atomic["partial"]:
        lost_notes.append(f"{atomic['partial']} partial target file(s) after SIGKILLed write_bytes_atomic")

    failed_ops = [r for r in results if r["outcome"] not in ("user_error", "ok", "completed before the outage")]
    survived = len(results) - len(failed_ops) + atomic["kills"] - atomic["partial"]
    slowest = max(results, key=lambda r: r["seconds"])
    parts = [
        f"{r['op']} [{r['case']}"
        f"{', temp file present at the outage' if midway.get(r['op']) and r['case'] == 'mid-transfer' else ''}]: "
        f"{r['outcome']} in {r['seconds']:.1f}s"
        for r in results
    ]
    detail = (
        f"StorageContext(retries={retries}, the default), bound {bound_s:.0f}s per call; "
        f"slowest {slowest['op']} [{slowest['case']}] {slowest['seconds']:.1f}s; "
        + "; ".join(parts)
        + f"; write_bytes_atomic to a local file SIGKILLed {atomic['kills']}x: {atomic['partial']} partial targets, "
        f"{atomic['debris']} temp files left beside it"
    )
    if failed_ops:
        detail += (
            f"; {len(failed_ops)} calls did not raise a UserError naming the URI/endpoint (the CLI prints "
            "anything else as a traceback): " + " | ".join(f"{r['op']}: {r['message'][:120]}" for r in failed_ops[:3])
        )
    if lost_notes:
        detail += "; LOST: " + " | ".join(lost_notes)
    return make_row(
        "object_store_outage",
        injected=3 + atomic["kills"],
        survived=survived,
        failed=len(failed_ops),
        allowed_failures=0,
        lost=lost,
        detail=detail,
        seconds=round(time.time() - t_start, 1),
        ops=[{k: v for k, v in r.items() if k != "value"} for r in results],
        atomic_local=atomic,
        failures=[f"{r['outcome']}: {r['op']} [{r['case']}]" for r in failed_ops],
    )


def _registry_cfg(endpoint_url: str, workdir: Path):
    from workflows.config import load_config

    return load_config(
        _repo_root() / "configs" / "quickstart.yaml",
        [
            "storage.embedded.enabled=false",
            f"storage.endpoint_url={endpoint_url}",
            f"cache.dir={workdir}/model-cache",
            f"output_dir={workdir}/runs",
        ],
    )


def _register_fake_model(cfg, ctx, workdir: Path, rng: random.Random) -> None:
    """A model version as the registry stores it (bytes only: registry.fetch does not parse them)."""
    from workflows import registry

    ctx.boto3_client().create_bucket(Bucket="workflows")
    src = workdir / "artifact"
    src.mkdir()
    (src / "model.safetensors").write_bytes(rng.randbytes(2 << 20))
    (src / "config.json").write_text("{}")
    registry.register(cfg, ctx, str(src), "m", {"labels": ["a", "b"], "text_columns": ["text"]})


def _registry_fetch(cfg, ctx):
    from workflows import registry

    return registry.fetch(cfg, ctx, "m")


def _dead_endpoint_ops(ctx, cfg, workdir: Path, warm: tuple, bound_s: float) -> list[dict]:
    from workflows import registry
    from workflows.preprocess.sources import list_shards
    from workflows.storage.cache import ShardCache
    from workflows.storage.uri import check_bucket, download_dir, read_json, write_bytes_atomic, write_json

    cache = ShardCache(str(workdir / "cache"), ctx)
    cfg = cfg.model_copy(deep=True)
    cfg.storage.endpoint_url = ctx.endpoint_url
    (workdir / "dl").mkdir(exist_ok=True)
    u = f"s3://{BUCKET}"
    ops = {
        "check_bucket": (lambda: check_bucket(f"{u}/x", ctx), f"{u}/x"),
        "list_shards": (lambda: list_shards(f"{u}/raw/", ctx), f"{u}/raw/"),
        "ShardCache.fetch": (lambda: cache.fetch(f"{u}/raw/part-01.jsonl"), f"{u}/raw/part-01.jsonl"),
        "ShardCache.fetch (version known)": (
            lambda: cache.fetch(f"{u}/raw/part-02.jsonl", "0" * 32, 10),
            f"{u}/raw/part-02.jsonl",
        ),
        "ShardCache.fetch (warm, version known)": (lambda: Path(cache.fetch(*warm)).read_bytes(), warm[0]),
        "read_json": (lambda: read_json(f"{u}/docs/a.json", ctx), f"{u}/docs/a.json"),
        "write_json": (lambda: write_json(f"{u}/docs/b.json", {"a": 1}, ctx), f"{u}/docs/b.json"),
        "write_bytes_atomic": (lambda: write_bytes_atomic(f"{u}/blobs/c.bin", b"x" * 1000, ctx), f"{u}/blobs/c.bin"),
        "download_dir": (lambda: download_dir(f"{u}/models/m/v1", ctx, str(workdir / "dl")), f"{u}/models/m/v1"),
        "registry.resolve": (lambda: registry.resolve(cfg, ctx, "m"), "s3://workflows/models"),
    }
    out = []
    with ThreadPoolExecutor(max_workers=len(ops)) as pool:  # in parallel: each waits out its own retries
        futures = {
            name: pool.submit(_timed, name, "endpoint killed", fn, bound_s, [uri, ctx.endpoint_url])
            for name, (fn, uri) in ops.items()
        }
        for fut in futures.values():
            out.append(fut.result())
    for r in out:  # only the warm read may succeed: served from the cache, no store request needed
        if r["outcome"] == "ok" and r["op"] != "ShardCache.fetch (warm, version known)":
            r["outcome"] = "returned without the store"  # cannot be right with the endpoint dead
    return out


def _timed(op: str, case: str, fn, bound_s: float, names: list[str]) -> dict:
    """Run fn in a thread; classify: ok, user_error (a UserError naming one of `names`), unclear
    (another exception, or a UserError that names neither), hang (still running after bound_s)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t0 = time.perf_counter()
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(bound_s)
    took = time.perf_counter() - t0
    if th.is_alive():
        return {
            "op": op,
            "case": case,
            "outcome": "hang",
            "seconds": round(took, 1),
            "message": f"still running after {bound_s:.0f}s",
        }
    err = box.get("error")
    if err is None:
        return {
            "op": op,
            "case": case,
            "outcome": "ok",
            "seconds": round(took, 1),
            "message": "",
            "value": box.get("value"),
        }
    msg = f"{type(err).__name__}: {err}"
    named = any(n and n in str(err) for n in names)
    if isinstance(err, UserError):
        outcome = "user_error" if named else "UserError naming neither the URI nor the endpoint"
    else:
        outcome = "not a UserError"
    return {"op": op, "case": case, "outcome": outcome, "seconds": round(took, 1), "message": msg[:300]}


def _atomic_child(path: str, data: bytes) -> None:
    from workflows.storage.uri import StorageContext, write_bytes_atomic

    write_bytes_atomic(path, data, StorageContext())


def _atomic_local_kills(workdir: Path, rng: random.Random, kills: int) -> dict:
    """SIGKILL write_bytes_atomic (32 MiB to a local file that already holds older bytes)."""
    d = workdir / "atomic"
    d.mkdir()
    target = d / "state.bin"
    old = rng.randbytes(1 << 20)
    new = rng.randbytes(32 << 20)
    target.write_bytes(old)
    ok = {_sha(old), _sha(new)}
    partial = 0
    for _ in range(kills):
        child = MP.Process(target=_atomic_child, args=(str(target), new))
        child.start()
        deadline = time.time() + 30
        while not list(d.glob("*.tmp-*")) and child.is_alive() and time.time() < deadline:
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.05))
        child.kill()  # SIGKILL
        child.join()
        if not target.exists() or _sha(target.read_bytes()) not in ok:
            partial += 1
        target.write_bytes(old)
    debris = len([p for p in d.iterdir() if re.search(r"\.tmp-", p.name)])
    return {"kills": kills, "partial": partial, "debris": debris}

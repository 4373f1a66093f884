"""object_store_faults and object_store_outage: the data path against a misbehaving S3 endpoint.

object_store_faults: the embedded endpoint (moto over HTTP) behind the fault proxy, which answers
~20% of requests with 503 SlowDown and delays or resets (before / in the middle of the response)
some more; the platform's own data-path calls go through it with `StorageContext(retries=N)`:
list_shards, ShardCache.fetch (boto3/s3transfer), s3fs reads (read_json, open/cat, download_dir
as registry.fetch uses it), write_json / write_bytes_atomic, check_bucket. Each result is checked
against what was put into the store directly (not through the proxy): `survived` = completed
with the right data, `failed` = raised, `lost` = returned or stored WRONG data. The full run
(`make reliability`) adds `workflows preprocess` and `workflows train` in new processes with the
proxy as their endpoint: Ray Data reads, the shard cache, Ray Train's checkpoint uploads and the
registry all go through the faults; afterwards every checkpoint in the store must be complete.

object_store_outage: the endpoint goes away —
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

import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from reliability import make_row
from workflows.errors import UserError

BUCKET = "reliability"
MP = mp.get_context("fork")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _put_fixture(client, rng: random.Random, shards: int = 6, size: int = 200_000) -> dict[str, bytes]:
    """Raw JSONL shards and a small model version laid out as the registry writes it."""
    objects = {}
    for i in range(shards):
        lines, n = [], 0
        while n < size:
            line = json.dumps({"text": rng.randbytes(40).hex(), "label": f"c{i % 3}"}) + "\n"
            lines.append(line)
            n += len(line)
        objects[f"raw/part-{i:02d}.jsonl"] = "".join(lines).encode()
    objects["models/m/v1/model.safetensors"] = rng.randbytes(300_000)
    objects["models/m/v1/config.json"] = b'{"hidden_size": 8}'
    objects["models/m/v1/tokenizer.json"] = rng.randbytes(50_000)
    for key, data in objects.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=data)
    return objects


# -- object_store_faults ----------------------------------------------------------------------
def object_store_faults(workdir: Path, seed: int = 0, retries: int = 10, rounds: int = 2, full: bool = False) -> dict:
    """`full` (not --fast) adds real `workflows preprocess` and `workflows train` runs through the proxy."""
    cli = full
    from reliability.fault_proxy import FaultProxy
    from workflows.preprocess.sources import list_shards
    from workflows.storage.cache import ShardCache
    from workflows.storage.embedded import EmbeddedS3
    from workflows.storage.uri import (
        StorageContext,
        check_bucket,
        download_dir,
        filesystem,
        read_json,
        write_bytes_atomic,
        write_json,
    )

    workdir = Path(workdir)
    rng = random.Random(seed)
    t_start = time.time()
    outcomes: dict[str, list[int]] = {}  # op -> [survived, failed, lost]
    errors: list[str] = []

    def op(name: str, fn, check) -> None:
        tally = outcomes.setdefault(name, [0, 0, 0])
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - counted and reported
            tally[1] += 1
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
            return
        if check(result):
            tally[0] += 1
        else:
            tally[2] += 1
            errors.append(f"{name}: returned wrong data")

    with EmbeddedS3(str(workdir / "s3")) as s3:
        s3.ensure_bucket(BUCKET)
        direct = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        client = direct.boto3_client()
        objects = _put_fixture(client, rng)
        raw = {k: v for k, v in objects.items() if k.startswith("raw/")}
        etags = {
            o["Key"]: o["ETag"].strip('"') for o in client.list_objects_v2(Bucket=BUCKET, Prefix="raw/")["Contents"]
        }
        expected_listing = sorted((f"s3://{BUCKET}/{k}", len(v), etags[k]) for k, v in raw.items())

        def stored(key: str) -> bytes:
            return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

        with FaultProxy(
            s3.url, seed=seed, slowdown=0.2, slow=0.05, reset_before=0.05, reset_mid=0.05, slow_s=(0.2, 1.0)
        ) as proxy:
            ctx = StorageContext(endpoint_url=proxy.url, region="us-east-1", embedded=True, retries=retries)
            for r in range(rounds):
                op(
                    "list_shards",
                    lambda: list_shards(f"s3://{BUCKET}/raw/", ctx),
                    lambda res: sorted((s.uri, s.size, s.version) for s in res[0]) == expected_listing,
                )
                op("check_bucket", lambda: check_bucket(f"s3://{BUCKET}/x", ctx), lambda res: True)
                cache = ShardCache(str(workdir / f"cache-{r}"), ctx, chunk_size=64 * 1024)
                for key, data in raw.items():
                    uri = f"s3://{BUCKET}/{key}"
                    # as Ray read tasks do (version and size from the listing) and as a bare fetch does (stat first)
                    args = (uri, etags[key], len(data)) if r % 2 else (uri,)
                    op("ShardCache.fetch", lambda: Path(cache.fetch(*args)).read_bytes(), lambda got, d=data: got == d)
                    op("s3fs read", lambda: _cat(filesystem(uri, ctx)), lambda got, d=data: got == d)
                for k in range(4):
                    doc = {"round": r, "k": k, "pad": rng.randbytes(2000).hex()}
                    uri = f"s3://{BUCKET}/docs/{r}-{k}.json"
                    op(
                        "write_json",
                        lambda: write_json(uri, doc, ctx),
                        lambda _, u=uri, d=doc: json.loads(stored(u.split("/", 3)[3])) == d,
                    )
                    op("read_json", lambda: read_json(uri, ctx), lambda got, d=doc: got == d)
                blob = rng.randbytes(256 * 1024)
                key = f"blobs/{r}.bin"
                op(
                    "write_bytes_atomic",
                    lambda: write_bytes_atomic(f"s3://{BUCKET}/{key}", blob, ctx),
                    lambda _, k=key, b=blob: stored(k) == b,
                )
                dest = workdir / f"model-{r}"
                dest.mkdir()
                model = {k.rsplit("/", 1)[1]: v for k, v in objects.items() if k.startswith("models/m/v1/")}
                op(
                    "download_dir",
                    lambda: download_dir(f"s3://{BUCKET}/models/m/v1", ctx, str(dest)),
                    lambda _, d=dest, m=model: {p.name: p.read_bytes() for p in d.iterdir()} == m,
                )
            stages = {}
            if cli:  # preprocess first: train reuses its materialized dataset
                for stage, through in (("preprocess", _preprocess_through), ("train", _train_through)):
                    stages[stage] = result = through(proxy, s3, workdir)
                    tally = outcomes.setdefault(f"workflows {stage} (CLI)", [0, 0, 0])
                    tally[0 if result["ok"] else 2 if result["lost"] else 1] += 1
                    if not result["ok"]:
                        errors.append(f"workflows {stage}: {result['error']}")
            counts = dict(proxy.counts)
    survived = sum(t[0] for t in outcomes.values())
    failed = sum(t[1] for t in outcomes.values())
    lost = sum(t[2] for t in outcomes.values())
    per_op = ", ".join(f"{name} {t[0]}/{sum(t)}" for name, t in outcomes.items())
    faults = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("slowdown", "slow", "reset_before", "reset_mid"))
    detail = (
        f"{counts.get('requests', 0)} requests through the proxy, faults injected: {faults} "
        f"(503 SlowDown with S3's XML body; resets are TCP RSTs); StorageContext(retries={retries}); "
        f"correct: {per_op}"
    )
    for stage, result in stages.items():
        detail += f"; CLI {stage} through the proxy: {result['summary']}"
    if errors:
        detail += "; errors: " + " | ".join(errors[:6])
    injected = sum(counts.get(k, 0) for k in ("slowdown", "slow", "reset_before", "reset_mid"))
    return make_row(
        "object_store_faults",
        injected=injected,
        survived=survived,
        failed=failed,
        allowed_failures=0,
        lost=lost,
        detail=detail,
        failures=errors,
        proxy=counts,
        per_op={k: dict(zip(("survived", "failed", "lost"), v)) for k, v in outcomes.items()},
        seconds=round(time.time() - t_start, 1),
    )


def _cat(fs_path) -> bytes:
    fs, path = fs_path
    with fs.open(path, "rb") as f:
        return f.read()


def _cli_through(proxy, workdir: Path, command: str,
                 extra: Sequence[str] = ()) -> tuple[subprocess.CompletedProcess[str], float, Path]:
    """`workflows COMMAND` (tiny quickstart) in a new process, its object store behind the proxy:
    the embedded endpoint is turned off in the config and the proxy given as storage.endpoint_url
    (with the embedded endpoint on, runtime() would point the stage at the endpoint itself).
    Returns (completed process, seconds, the run's summary folder)."""
    import sys

    from tests.helpers import tiny_overrides

    tmp = workdir / "cli"
    overrides = [
        *tiny_overrides(tmp),
        "storage.embedded.enabled=false",
        "data.write_builtin=true",
        f"storage.endpoint_url={proxy.url}",
        "storage.retries=10",
        *extra,
    ]
    args = [sys.executable, "-m", "workflows", command, "--config", "configs/quickstart.yaml"]
    for o in overrides:
        args += ["--set", o]
    ray_tmp = _short_tmp()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "embedded", "AWS_SECRET_ACCESS_KEY": "embedded", "RAY_TMPDIR": ray_tmp}
    t0 = time.time()
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=_repo_root(), env=env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return res, time.time() - t0, tmp / "runs" / "quickstart"


def _exit_error(res, took: float) -> dict:
    return {
        "ok": False,
        "lost": False,
        "summary": f"exit {res.returncode} after {took:.0f}s",
        "error": (res.stderr.strip().splitlines() or ["?"])[-1][:300],
    }


def _preprocess_through(proxy, s3, workdir: Path) -> dict:
    s3.ensure_bucket("workflows")
    res, took, runs = _cli_through(proxy, workdir, "preprocess")
    summary_path = runs / "preprocess.json"
    if res.returncode != 0 or not summary_path.exists():
        return _exit_error(res, took)
    summary = json.loads(summary_path.read_text())
    counts = (summary.get("dataset") or summary).get("counts") or {}
    expected = 4 * 40  # 4 classes x data.builtin_rows_per_class
    if sum(counts.values()) != expected:
        return {
            "ok": False,
            "lost": True,
            "summary": f"exit 0 in {took:.0f}s but {counts} rows, not {expected}",
            "error": f"processed {sum(counts.values())} rows, expected {expected}",
        }
    return {"ok": True, "lost": False, "summary": f"exit 0 in {took:.0f}s, {expected} rows processed {counts}"}


def _train_through(proxy, s3, workdir: Path, epochs: int = 2) -> dict:
    """`workflows train` through the proxy: the workers read the processed shards (shard cache),
    Ray Train uploads each epoch's sharded checkpoint, the best one is exported and registered.
    Then, over a direct connection: every checkpoint folder is complete (each file each rank
    wrote, with its size, per train_state.json) and the registered weights load."""
    from workflows.storage.uri import StorageContext
    from workflows.train.checkpoint import STATE_FILE, missing

    res, took, runs = _cli_through(proxy, workdir, "train", [f"train.epochs={epochs}"])
    summary_path = runs / "train.json"
    if res.returncode != 0 or not summary_path.exists():
        return _exit_error(res, took)
    summary = json.loads(summary_path.read_text())
    history, registered = summary["train"]["history"], summary.get("registered") or {}
    client = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True).boto3_client()
    bucket, _, run_key = summary["train"]["run_uri"].removeprefix("s3://").partition("/")
    listing: dict[str, dict[str, int]] = {}  # checkpoint folder -> file name -> size
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=run_key + "/"):
        for o in page.get("Contents", []):
            folder, _, name = o["Key"][len(run_key) + 1 :].partition("/")
            if folder.startswith("checkpoint_") and name:  # not Ray's checkpoint_manager_snapshot.json file
                listing.setdefault(folder, {})[name] = o["Size"]
    problems = []
    for folder, files in sorted(listing.items()):
        state = None
        if STATE_FILE in files:
            body = client.get_object(Bucket=bucket, Key=f"{run_key}/{folder}/{STATE_FILE}")["Body"].read()
            state = json.loads(body)
        absent = missing(files, state)
        if absent:
            problems.append(f"{folder}: {', '.join(absent)} missing or cut short")
    weights = None
    if registered:
        from safetensors.torch import load

        rbucket, _, rkey = registered["uri"].removeprefix("s3://").partition("/")
        blob = client.get_object(Bucket=rbucket, Key=f"{rkey}/model.safetensors")["Body"].read()
        weights = sum(t.numel() for t in load(blob).values())
    if len(history) != epochs or len(listing) < 1 or not registered:
        problems.append(
            f"{len(history)} epoch(s) of {epochs}, {len(listing)} checkpoint(s), "
            f"registered: {registered.get('name')}:v{registered.get('version')}"
        )
    text = (
        f"exit 0 in {took:.0f}s, {len(history)} epochs, {len(listing)} complete checkpoint(s) in the store, "
        f"registered {registered.get('name')}:v{registered.get('version')} ({weights} weights load)"
    )
    if problems:
        return {"ok": False, "lost": True, "summary": text, "error": "; ".join(problems)[:300]}
    return {"ok": True, "lost": False, "summary": text}


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def _short_tmp() -> str:
    """Ray's session directory for a child run: short (AF_UNIX paths are limited), and separate."""
    import tempfile

    return tempfile.mkdtemp(prefix="wfrel-", dir="/tmp")


# -- object_store_outage ----------------------------------------------------------------------
OUTAGE_BOUND_S = 60.0


def object_store_outage(workdir: Path, seed: int = 0, bound_s: float = OUTAGE_BOUND_S, atomic_kills: int = 4) -> dict:
    from reliability.fault_proxy import FaultProxy
    from workflows.config import StorageConfig
    from workflows.storage.cache import ShardCache, _uri_prefix
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
        big_prefix = _uri_prefix(f"s3://{BUCKET}/big/shard.bin")
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

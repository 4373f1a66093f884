"""object_store_faults: the embedded endpoint (moto over HTTP) behind the fault proxy, which answers
~20% of requests with 503 SlowDown and delays or resets (before / in the middle of the response)
some more; the platform's own data-path calls go through it with `StorageContext(retries=N)`:
list_shards, ShardCache.fetch (boto3/s3transfer), s3fs reads (read_json, open/cat, download_dir
as registry.fetch uses it), write_json / write_bytes_atomic, check_bucket. Each result is checked
against what was put into the store directly (not through the proxy): `survived` = completed
with the right data, `failed` = raised, `lost` = returned or stored WRONG data. The full run
(`make reliability`) adds `workflows preprocess` and `workflows train` in new processes with the
proxy as their endpoint: Ray Data reads, the shard cache, Ray Train's checkpoint uploads and the
registry all go through the faults; afterwards every checkpoint in the store must be complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from reliability import make_row
from reliability.object_store_common import BUCKET, _put_fixture, _repo_root


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


def _short_tmp() -> str:
    """Ray's session directory for a child run: short (AF_UNIX paths are limited), and separate."""
    import tempfile

    return tempfile.mkdtemp(prefix="wfrel-", dir="/tmp")

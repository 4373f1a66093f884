"""cache_download_kill: SIGKILL a process at random points of shard downloads into a ShardCache.

Two slow sources, so that a kill lands inside a download:
- `slowfile://` — local files through an fsspec filesystem that sleeps on every read (the
  streamed path of ShardCache: fsspec open + read loop);
- `s3://` through the fault proxy with a per-response bandwidth cap (the s3transfer path:
  parallel ranged GETs into one temp file).
Every round downloads a shard nobody has cached yet in a forked child and SIGKILLs it at a
seeded random moment: before, during or just after the download. In some rounds a second process
is already waiting for the same shard (blocked on the entry's lock) and must take over.

Then, and once more at the end with checksums verified on every hit:
- every entry a reader would accept (sidecar present, size right) must hold exactly the source
  bytes (sha256) — `lost` counts those that do not, and reads that return other bytes;
- a fresh reader must get exactly the source bytes — `failed` counts reads that raise.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random
import time
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from reliability import make_row
from workflows.storage.atomic import atomic_write
from workflows.storage.cache import ShardCache
from workflows.storage.cache_dir import uri_prefix
from workflows.storage.uri import StorageContext, filesystem

MP = mp.get_context("fork")  # children inherit the imports: cheap on a small, busy machine
SHARD_BYTES = 1 << 20
CHUNK = 64 * 1024


class SlowLocalFileSystem(LocalFileSystem):
    """Local files, `slowfile:///path`, with a sleep on every read (set `delay_s` in the process
    that should be slow; it is 0 elsewhere, so verifying reads are fast)."""

    protocol = ("slowfile",)
    delay_s = 0.0

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        f = super()._open(path, mode, block_size, **kwargs)
        return _SlowReader(f, type(self).delay_s) if "r" in mode and type(self).delay_s else f


class _SlowReader:
    def __init__(self, f, delay: float):
        self._f, self._delay = f, delay

    def read(self, n=-1):
        time.sleep(self._delay)
        return self._f.read(n)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


fsspec.register_implementation("slowfile", SlowLocalFileSystem, clobber=True)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _child_fetch(directory: str, ctx: StorageContext, uri: str, version, size, delay: float, out: str | None) -> None:
    """In a forked child: fetch `uri` into the cache; write the bytes' sha256 to `out` if given."""
    SlowLocalFileSystem.delay_s = delay
    path = ShardCache(directory, ctx, chunk_size=CHUNK).fetch(uri, version, size)
    if out:
        atomic_write(out, sha_file(path))


def cache_download_kill(workdir: Path, seed: int = 0, local_kills: int = 14, s3_kills: int = 6) -> dict:
    from reliability.fault_proxy import FaultProxy
    from workflows.storage.embedded import EmbeddedS3

    workdir = Path(workdir)
    rng = random.Random(seed)
    directory = workdir / "cache"
    src_dir = workdir / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    with EmbeddedS3(str(workdir / "s3")) as s3:
        s3.ensure_bucket("reliability")
        direct = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        client = direct.boto3_client()
        with FaultProxy(s3.url, seed=seed, throttle_bytes_per_s=1024 * 1024, chunk=16 * 1024) as proxy:
            slow_ctx = StorageContext(endpoint_url=proxy.url, region="us-east-1", embedded=True)
            shards: list[dict] = []  # uri, sha, canonical, ctx for the killed child, version/size or None
            for i in range(local_kills + 1):  # +1: calibration
                data = random.Random(seed * 1000 + i).randbytes(SHARD_BYTES + i)
                p = src_dir / f"shard-{i:03d}.bin"
                p.write_bytes(data)
                shards.append({"uri": f"slowfile://{p}", "sha": sha256(data), "kind": "local", "delay": 0.01})
            listing = {}
            for i in range(s3_kills + 1):
                data = random.Random(seed * 1000 + 500 + i).randbytes(SHARD_BYTES + i)
                key = f"shards/shard-{i:03d}.bin"
                listing[key] = client.put_object(Bucket="reliability", Key=key, Body=data)["ETag"].strip('"')
                shards.append({"uri": f"s3://reliability/{key}", "sha": sha256(data), "kind": "s3", "delay": 0.0,
                               # every other s3 round passes the listing's version and size, as Ray read tasks do
                               "version": listing[key] if i % 2 else None, "size": len(data) if i % 2 else None})
            for s in shards:
                fs, path = filesystem(s["uri"], direct)
                s["canonical"] = fs.unstrip_protocol(path)
                s["child_ctx"] = slow_ctx if s["kind"] == "s3" else StorageContext()
                s["read_ctx"] = direct if s["kind"] == "s3" else StorageContext()
            by_canonical = {s["canonical"]: s["sha"] for s in shards}
            local = [s for s in shards if s["kind"] == "local"]
            remote = [s for s in shards if s["kind"] == "s3"]

            stats = {"kills": 0, "before": 0, "mid_download": 0, "between_rename_and_sidecar": 0, "after": 0,
                     "waiters": 0, "waiter_ok": 0, "reads": 0, "reads_ok": 0, "corrupt_entries": 0, "corrupt_reads": 0,
                     "read_errors": 0, "rounds_ok": 0}
            errors: list[str] = []
            durations = {}
            for group in (local, remote):  # calibration: one un-killed download per source, timed
                s = group.pop(0)           # from its temp file's appearance to its sidecar's
                durations[s["kind"]] = _calibrate(s, directory)
            rounds = [*local, *remote]
            rng.shuffle(rounds)
            for i, s in enumerate(rounds):
                _kill_round(i, s, directory, rng, durations[s["kind"]], by_canonical, stats, errors)
            # the end: a reader that re-hashes every hit, and verify() of every entry
            checking = ShardCache(str(directory), direct, verify_checksums=True, chunk_size=CHUNK)
            for s in shards:
                _read(checking, s, stats, errors)
                try:
                    if not checking.verify(s["uri"]):
                        errors.append(f"verify({s['uri']}) is False right after a fetch")
                except Exception as e:  # noqa: BLE001 - counted, reported
                    errors.append(f"verify({s['uri']}): {type(e).__name__}: {e}")
            stats["corrupt_entries"] += _scan_entries(directory, by_canonical, errors)
            debris = sorted(p.name for p in directory.glob("*.tmp-*"))
            injected_proxy = dict(proxy.counts)
    lost = stats["corrupt_entries"] + stats["corrupt_reads"]
    failed = stats["read_errors"] + (stats["waiters"] - stats["waiter_ok"])
    detail = (
        f"{stats['kills']} SIGKILLs over {len(local) + len(remote)} downloads ({len(local)} slowfile://, "
        f"{len(remote)} s3:// via a 1 MiB/s proxy, {CHUNK // 1024} KiB chunks, 1 MiB shards): "
        f"{stats['mid_download']} mid-download (temp file left), {stats['before']} before it began, "
        f"{stats['between_rename_and_sidecar']} between data rename and sidecar, {stats['after']} after it completed; "
        f"{stats['waiters']} rounds had a second process waiting on the entry's lock "
        f"({stats['waiter_ok']} got exact bytes); "
        f"{stats['reads_ok']}/{stats['reads']} later reads exact (sha256), the last pass with verify_checksums; "
        f"{stats['corrupt_entries']} corrupt entries visible to readers; {len(debris)} temp files left at the end"
    )
    if errors:
        detail += "; errors: " + " | ".join(errors[:5])
    return make_row(
        "cache_download_kill",
        injected=stats["kills"],
        survived=stats["rounds_ok"],
        failed=failed,
        allowed_failures=0,
        lost=lost,
        detail=detail,
        stats=stats,
        failures=errors,
        seconds=round(time.time() - t_start, 1),
        download_window_s={k: round(v, 2) for k, v in durations.items()},
        proxy=injected_proxy,
    )


def _calibrate(s: dict, directory: Path) -> float:
    prefix = uri_prefix(s["canonical"])
    child = MP.Process(
        target=_child_fetch,
        args=(str(directory), s["child_ctx"], s["uri"], s.get("version"), s.get("size"), s["delay"], None),
    )
    child.start()
    deadline = time.time() + 120
    while not list(directory.glob(prefix + "*.tmp-*")) and child.is_alive() and time.time() < deadline:
        time.sleep(0.002)
    t0 = time.perf_counter()
    while not list(directory.glob(prefix + "*.json")) and child.is_alive() and time.time() < deadline:
        time.sleep(0.002)
    window = time.perf_counter() - t0
    child.join(120)
    return max(window, 0.05)


def _kill_round(
    i: int, s: dict, directory: Path, rng: random.Random, duration: float, by_canonical: dict, stats: dict, errors: list
) -> None:
    prefix = uri_prefix(s["canonical"])
    with_waiter = i % 4 == 3
    # most kills: at a random point of the download window (and a little after it); the others
    # at a random moment from the child's start (imports, stat, locking, or the download)
    wait_for_tmp = with_waiter or rng.random() < 0.8
    delay = rng.uniform(0, 1.1 * duration) if wait_for_tmp else rng.uniform(0, duration)
    child = MP.Process(
        target=_child_fetch,
        args=(str(directory), s["child_ctx"], s["uri"], s.get("version"), s.get("size"), s["delay"], None),
    )
    child.start()
    waiter = None
    out = directory.parent / f"waiter-{i}.sha"
    if wait_for_tmp:
        deadline = time.time() + 60
        while not list(directory.glob(prefix + "*.tmp-*")) and time.time() < deadline and child.is_alive():
            time.sleep(0.002)
    if with_waiter:  # blocks on the entry's lock, held by the child that is about to die
        waiter = MP.Process(
            target=_child_fetch,
            args=(str(directory), s["child_ctx"], s["uri"], s.get("version"), s.get("size"), s["delay"], str(out)),
        )
        waiter.start()
    time.sleep(delay)
    child.kill()  # SIGKILL
    child.join()
    stats["kills"] += 1
    before = (stats["reads_ok"], stats["waiter_ok"], stats["corrupt_entries"])
    names = [p.name for p in directory.glob(prefix + "*")]
    if waiter is None:  # what the kill left, before anyone else touched the entry
        if any(n.endswith(".json") for n in names):
            stats["after"] += 1
        elif any(".data.tmp-" in n for n in names):
            stats["mid_download"] += 1
        elif any(n.endswith(".data") or ".meta.tmp-" in n for n in names):
            stats["between_rename_and_sidecar"] += 1
        else:
            stats["before"] += 1
    else:
        stats["mid_download"] += 1  # killed after its temp file appeared (the waiter may clean up at once)
    stats["corrupt_entries"] += _scan_entries(directory, by_canonical, errors)
    if waiter is not None:
        stats["waiters"] += 1
        waiter.join(120)
        if waiter.is_alive():
            waiter.kill()
            errors.append(f"waiter for {s['uri']} hung")
        elif out.exists() and out.read_text() == s["sha"]:
            stats["waiter_ok"] += 1
        elif out.exists():
            stats["corrupt_reads"] += 1
            errors.append(f"waiter for {s['uri']} read other bytes")
        else:
            errors.append(f"waiter for {s['uri']} exited {waiter.exitcode}")
    _read(ShardCache(str(directory), s["read_ctx"], chunk_size=CHUNK), s, stats, errors)
    after = (stats["reads_ok"], stats["waiter_ok"], stats["corrupt_entries"])
    if after[0] == before[0] + 1 and after[1] == before[1] + (waiter is not None) and after[2] == before[2]:
        stats["rounds_ok"] += 1  # this kill survived: every later read exact, nothing corrupt visible


def _read(cache: ShardCache, s: dict, stats: dict, errors: list) -> None:
    stats["reads"] += 1
    try:
        got = sha_file(cache.fetch(s["uri"]))
    except Exception as e:  # noqa: BLE001 - counted, reported
        stats["read_errors"] += 1
        errors.append(f"read {s['uri']}: {type(e).__name__}: {e}")
        return
    if got == s["sha"]:
        stats["reads_ok"] += 1
    else:
        stats["corrupt_reads"] += 1
        errors.append(f"read {s['uri']}: other bytes than the source")


def _scan_entries(directory: Path, by_canonical: dict, errors: list) -> int:
    """Entries a reader would accept as present (sidecar + data of the sidecar's size) whose
    bytes differ from the source: what the cache would serve as good."""
    import json

    bad = 0
    for meta_path in directory.glob("*.json"):
        try:
            meta = json.loads(meta_path.read_bytes())
            data = meta_path.with_suffix(".data")
            if data.stat().st_size != meta["size"]:
                continue  # a reader re-downloads it
            digest = sha_file(data)
        except (FileNotFoundError, ValueError):
            continue  # removed meanwhile, or a sidecar mid-rename (never: it is renamed whole)
        if digest != by_canonical.get(meta["uri"]) or digest != meta["sha256"]:
            bad += 1
            errors.append(f"corrupt entry {meta_path.name} for {meta['uri']}")
    return bad

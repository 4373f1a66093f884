"""Load generation for `workflows bench serve`: one aiohttp client process, many connections."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time

LOAD_REQUESTS = int(os.environ.get("WORKFLOWS_BENCH_SERVE_REQUESTS", "10000"))


def load(
    url: str,
    rows: list[dict],
    n: int,
    concurrency: int,
    stop: threading.Event | None = None,
    record: list | None = None,
) -> dict:
    return asyncio.run(load_async(url, rows, n, concurrency, stop, record))


async def load_async(url, rows, n, concurrency, stop, record) -> dict:
    import aiohttp

    latencies: list[float] = []
    errors: dict[str, int] = {}
    counter = iter(range(n))
    text_cols = [c for c in rows[0] if c != "label"] if rows else []

    async def worker(session):
        for i in counter:
            if stop is not None and stop.is_set():
                return
            row = rows[i % len(rows)]
            body = {"instances": [{c: row[c] for c in text_cols if c in row} or row]}
            t0 = time.perf_counter()
            version = None
            try:
                async with session.post(f"{url}/predict", json=body) as resp:
                    raw = await resp.read()
                    ok = resp.status == 200
                    key = str(resp.status)
                if ok and record is not None:
                    version = json.loads(raw).get("version")
            except aiohttp.ClientError as e:
                ok, key = False, type(e).__name__
            t1 = time.perf_counter()
            if ok:
                latencies.append(t1 - t0)
            else:
                errors[key] = errors.get(key, 0) + 1
            if record is not None:
                record.append((t1, ok, version))

    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    lat = sorted(latencies)

    def pct(p):
        return round(1000 * lat[min(len(lat) - 1, int(p * len(lat)))], 2) if lat else None

    return {
        "requests": len(lat) + sum(errors.values()),
        "ok": len(lat),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "concurrency": concurrency,
        "seconds": round(wall, 2),
        "rps": round(len(lat) / wall, 1),
        "p50_ms": pct(0.5),
        "p95_ms": pct(0.95),
        "p99_ms": pct(0.99),
    }


def get_p50_ms(url: str, n: int) -> float:
    """p50 of `n` sequential GETs (the first 20 are warm-up): the request path with no model in it."""
    return asyncio.run(get_p50_ms_async(url, n))


async def get_p50_ms_async(url: str, n: int) -> float:
    import aiohttp

    times = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for _ in range(n):
            t0 = time.perf_counter()
            async with session.get(url) as resp:
                await resp.read()
                resp.raise_for_status()
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[20:])


# -- in-process baselines ---------------------------------------------------------------------


POINTS = ((1, 60), (32, 320))  # (concurrency, requests) per rep: short runs, many reps, against drift


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def compare(serve_url: str, peer_url: str, rows: list[dict], reps: int = 5) -> dict:
    """A Serve URL against the peer's with the same client and rows, alternating point by point
    (concurrency 1, then 32, `reps` times) so that load from elsewhere on the machine falls on both
    alike; each figure is the median over the reps."""
    runs: dict = {name: {c: [] for c, _ in POINTS} for name in ("serve", "peer")}
    for rep in range(reps):
        for c, n in POINTS:
            order = (("serve", serve_url), ("peer", peer_url))
            for name, url in order if rep % 2 == 0 else order[::-1]:
                runs[name][c].append(load(url, rows, n, c))
    out: dict = {}
    for name, by_c in runs.items():
        out[name] = {
            str(c): {"rps": _median([r["rps"] for r in rs]), "p50_ms": _median([r["p50_ms"] for r in rs]),
                     "p95_ms": _median([r["p95_ms"] for r in rs]), "errors": sum(r["errors"] for r in rs)}
            for c, rs in by_c.items()
        }
    s, p = out["serve"], out["peer"]
    out["serve_vs_peer_throughput"] = round(s["32"]["rps"] / p["32"]["rps"], 3) if p["32"]["rps"] else None
    both = s["1"]["p50_ms"] is not None and p["1"]["p50_ms"] is not None
    out["p50_over_peer_ms"] = round(s["1"]["p50_ms"] - p["1"]["p50_ms"], 2) if both else None
    out["reps"] = reps
    return out

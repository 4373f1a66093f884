"""Where `workflows bench serve`'s CPU goes: CPU seconds of this process and every process it started
(Ray's, the peer's), summed by the part of the serving stack each process is, per answered request."""

from __future__ import annotations

import os

from workflows.bench.serve_load import load


def process_group(name: str, cmdline: list[str], pid: int) -> str:
    """Which part of the serving stack a process of this benchmark's tree is, from its title."""
    title = " ".join(cmdline) or name
    if pid == os.getpid():
        return "client (aiohttp, this process)"
    for key, group in (("ServeReplica", "Serve replica"), ("serve_peer", "peer (FastAPI + uvicorn)"),
                       ("HAProxyManager", "HAProxy manager actor"), ("ProxyActor", "Serve proxy actor"),
                       ("ServeController", "Serve controller"), ("haproxy", "HAProxy"),
                       ("raylet", "Ray core (raylet, GCS)"), ("gcs_server", "Ray core (raylet, GCS)"),
                       ("log_monitor", "Ray log monitor"), ("dashboard", "Ray dashboard and agents"),
                       ("DashboardAgent", "Ray dashboard and agents"), ("RuntimeEnvAgent", "Ray dashboard and agents")):
        if key in title:
            return group
    return "other Ray processes"


def _cpu_snapshot() -> dict[int, tuple[str, float]]:
    import psutil

    me = psutil.Process()
    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = (process_group(p.name(), p.cmdline(), p.pid), t.user + t.system)
        except psutil.Error:
            pass
    return out


def cpu_by_group(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two snapshots, summed by process group (a process that started in
    between counts from zero; one that ended is lost)."""
    out: dict[str, float] = {}
    for pid, (group, t) in after.items():
        spent = t - before[pid][1] if pid in before else t
        out[group] = out.get(group, 0.0) + max(0.0, spent)
    return out


def cpu_per_request(url: str, rows: list[dict], n: int, concurrency: int) -> dict:
    """CPU milliseconds per answered request that this process and every process it started (Ray's,
    the peer) spend while `n` requests run at `concurrency`: where a server's time goes, whatever
    else runs on the machine (CPU time, unlike req/s, is not taken by other tenants)."""
    before = _cpu_snapshot()
    got = load(url, rows, n, concurrency)
    spent = cpu_by_group(before, _cpu_snapshot())
    ok = max(1, got["ok"])
    groups = {g: round(1000 * v / ok, 3) for g, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v > 0}
    return {"requests": got["ok"], "rps": got["rps"], "total": round(sum(groups.values()), 2), "groups": groups}

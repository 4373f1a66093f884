"""The rows' processes of `python -m benchmarks.images`: run one row's processes through the phase
protocol (benchmarks.image_peers), counting the store's bytes and the process trees' memory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.images_common import ROOT, _say


# -- running rows -------------------------------------------------------------------------------
def cache_disk_bytes(cache_dir: str, pids: list[int]) -> int:
    """Disk blocks the cache holds: its files, plus files evicted (unlinked) while a process of
    `pids` still has them open, which stay on disk until closed (read from /proc/PID/fd: psutil's
    open_files leaves deleted files out). Each inode counted once."""
    seen: dict[tuple[int, int], int] = {}
    root = os.path.realpath(cache_dir)
    try:
        entries = list(os.scandir(root))
    except OSError:
        entries = []
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if e.is_file(follow_symlinks=False):
            seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(root + "/") and target.endswith(" (deleted)"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
            except OSError:
                continue
    return sum(seen.values())


class _Memory:
    """Peak memory of process trees, sampled in a thread: PSS and RSS summed over the trees; with
    `cache_dir`, the peak disk the cache held too (cache_disk_bytes over the trees' processes)."""

    def __init__(self, roots: list[int], store_pid: int | None, cache_dir: str | None = None):
        self.roots, self.store_pid, self.cache_dir = roots, store_pid, cache_dir
        self.peak_pss = self.peak_rss = self.store_peak_rss = self.peak_cache_disk = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        import psutil

        pss = rss = 0
        pids: list[int] = []
        for root in self.roots:
            try:
                top = psutil.Process(root)
                procs = [top, *top.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                pids.append(p.pid)
                try:
                    m = p.memory_full_info()
                    pss, rss = pss + m.pss, rss + m.rss
                except psutil.Error:
                    pass
        self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
        if self.cache_dir:
            self.peak_cache_disk = max(self.peak_cache_disk, cache_disk_bytes(self.cache_dir, pids))
        if self.store_pid:
            try:
                self.store_peak_rss = max(self.store_peak_rss, psutil.Process(self.store_pid).memory_info().rss)
            except psutil.Error:
                pass

    def _loop(self) -> None:
        # why adaptive: reading PSS walks each process's page tables (smaps_rollup); over a Ray
        # Train tree of a dozen large processes one sample costs tens of ms of CPU, which every 0.25 s
        # would take a sizeable share of a 2-core machine from the run being measured. The pause
        # keeps the sampler under ~5% of one core.
        pause = 0.25
        while not self._stop.wait(pause):
            t0 = time.perf_counter()
            self._sample()
            pause = max(0.25, 20 * (time.perf_counter() - t0))

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


def _phases(name: str, cmds: list[list[str]], env: dict, rt, log_dir: Path, cache_dir: str | None = None) -> dict:
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
            with _Memory([p.pid for p in procs], store_pid, cache_dir) as mem:
                for p in procs:
                    assert p.stdin is not None  # opened with stdin=PIPE
                    p.stdin.write("go\n")
                    p.stdin.flush()
                results = [_read_until(p, "@result ") for p in procs]
            after = endpoint_traffic(url)
            if any(r is None for r in results):
                break
            parts = [json.loads(r) for r in results if r is not None]  # none is, after the check above
            merged = _merge(parts)
            get = after["bytes_out"].get("GET", 0) - before["bytes_out"].get("GET", 0)
            merged.update(store_get_bytes=get, peak_pss_bytes=mem.peak_pss, peak_rss_bytes=mem.peak_rss,
                          store_peak_rss_bytes=mem.store_peak_rss, processes=len(procs),
                          load_1min=round(os.getloadavg()[0], 2))
            if cache_dir:
                merged["peak_cache_disk_bytes"] = mem.peak_cache_disk
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
    return [sys.executable, "-m", "benchmarks.image_rows", json.dumps(args)]


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORKFLOWS_VERBOSE", None)
    return env



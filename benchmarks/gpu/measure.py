"""One prepared GPU measurement: every step in its own process under its own time limit, each
result written as `OUT/gpu-STEP.json` as it completes (benchmarks/gpu/run.sh, `make bench-gpu`).

    python -m benchmarks.gpu.measure --out DIR                 # on a CUDA machine: the real sizes
    python -m benchmarks.gpu.measure --out DIR --smoke         # every step at toy size on the CPU

A step that fails or runs past its limit is recorded (status "failed" / "timeout", with what it had
measured and the end of its output) and the next step runs. The GPU machine has no Ray or pydantic:
run.sh unpacks them from .gpu-carry/ (benchmarks.gpu.ray_pack, .carry) onto PYTHONPATH. The default
steps' limits add up to 570 s, inside one 10-minute call; a step that fails is rerun alone (`--steps`) in a
call of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from workflows.storage.atomic import atomic_write

STEPS = ("pipeline", "lm", "resnet", "classify", "chat", "generate")
# what one call runs (--steps' default): every step but generate, whose decode-step goals wait on the chat
# engine's static cache (README); their limits add up to 570 s, inside one 10-minute call with Ray's unpacking
DEFAULT_STEPS = ("pipeline", "lm", "resnet", "classify", "chat")
LIMITS = {"pipeline": 200, "lm": 90, "resnet": 130, "classify": 60, "chat": 90, "generate": 90}
PREPARED = ".gpu-prep"  # make bench-gpu-prepare's folder, carried to the device (gitignored)
# toy sizes, but a loaded 2-core machine imports torch slowly
SMOKE_LIMITS = {"pipeline": 400, "lm": 300, "resnet": 300, "classify": 300, "chat": 300, "generate": 300}


def environment(smoke: bool) -> dict:
    """Versions from the installed packages' metadata; the device from torch only in a real run (a smoke
    run skips the import here: each step imports torch itself, and on a loaded CPU an import takes long)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    info: dict = {"python": platform.python_version(), "cpus": os.cpu_count(), "device": "cpu", "cuda": None}
    for name in ("torch", "transformers"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    if not smoke:
        import torch

        info.update(cuda=torch.version.cuda, device=torch.cuda.get_device_name(0))
    return info


def run_step(step: str, out_dir: Path, smoke: bool, limit: float, env_info: dict, data: str | None) -> dict:
    """Run one step in a process group of its own; kill the group at `limit`. Returns its record."""
    path = out_dir / f"gpu-{step}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.gpu.steps", step, "--out", str(path)]
    cmd += ["--smoke"] if smoke else []
    cmd += ["--data", data] if data else []
    log = out_dir / f"gpu-{step}.log"
    t0 = time.time()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                os.killpg(proc.pid, signal.SIGKILL)  # its compile workers and loader processes too
            proc.wait()
            rc = None
    measured = json.loads(path.read_text()) if path.exists() else {}
    tail = log.read_text(errors="replace")[-2000:]
    status = "ok" if rc == 0 else "timeout" if rc is None else "failed"
    record = {
        "benchmark": "gpu", "step": step, "status": status, "smoke": smoke, "limit_s": limit,
        "seconds": round(time.time() - t0, 1), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": env_info, "command": " ".join(["python -m benchmarks.gpu.steps", *cmd[3:]]),
        "error": None if status == "ok" else (f"ran past its {limit:g} s limit" if rc is None
                                              else f"exit {rc}: " + last_line(tail)),
        **measured,
    }
    if status != "ok":
        record["output_tail"] = tail
    atomic_write(path, json.dumps(record, indent=2, sort_keys=True))
    return record


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.measure", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default: $OUT)")
    ap.add_argument("--smoke", action="store_true", help="every step at toy size on the CPU")
    ap.add_argument("--steps", help=f"comma-separated, of {', '.join(STEPS)} (default: {','.join(DEFAULT_STEPS)}; "
                    "a smoke run: all)")
    ap.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS", help="another time limit")
    ap.add_argument("--shards", help="resnet: a prepared local shard directory (index.json), else synthesized")
    ap.add_argument("--prepared", default=PREPARED if os.path.isdir(PREPARED) else None,
                    help=f"classify, generate, chat: the folder `make bench-gpu-prepare` wrote (default: {PREPARED} "
                    "where it exists; a smoke run makes a toy one)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if not a.out:
        print("bench gpu: no results folder: pass --out DIR or set OUT", file=sys.stderr)
        return 2
    steps = [s for s in (a.steps or ",".join(STEPS if a.smoke else DEFAULT_STEPS)).split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        print(f"bench gpu: --steps {','.join(unknown)}: not a step; use {', '.join(STEPS)}", file=sys.stderr)
        return 2
    limits: dict[str, float] = dict(SMOKE_LIMITS if a.smoke else LIMITS)
    for item in a.limit:
        key, _, value = item.partition("=")
        if key not in limits or not value.replace(".", "", 1).isdigit():
            print(f"bench gpu: --limit {item!r}: use STEP=SECONDS with a step of {', '.join(STEPS)}", file=sys.stderr)
            return 2
        limits[key] = float(value)
    if not a.smoke and not cuda_available():
        print("bench gpu: no CUDA device here (torch.cuda.is_available() is False); "
              "SMOKE=1 / --smoke runs the steps at toy size on the CPU", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env_info = environment(a.smoke)
    print(f"bench gpu: {', '.join(steps)} on {env_info['device']}{' (smoke)' if a.smoke else ''} -> {out}", flush=True)
    failed = 0
    for step in steps:
        data = a.shards if step == "resnet" else None if a.smoke else a.prepared
        r = run_step(step, out, a.smoke, limits[step], env_info, data)
        failed += r["status"] != "ok"
        print(f"bench gpu: {step}: {r['status']} in {r['seconds']} s" + (f" ({r['error']})" if r["error"] else ""),
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

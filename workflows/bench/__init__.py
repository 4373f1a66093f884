"""`workflows bench NAME`: measures your own config, cluster and registered model on the path you run, and
prints what it measured (JSON; `--out FILE` keeps it):
- data: the shard cache and Ray Data reads;
- train: Ray Train against a plain loop, FSDP2 against DDP;
- tune: ASHA against FIFO on your search space;
- serve: your Serve deployment under load, against a plain FastAPI peer;
- lm: the training loop's tokens/s and MFU on your GPUs;
- generate: your chat model's continuous batching against one request at a time and static batching.
The project's own measurements, and docs/BENCHMARKS.md that reports them, live in the repository's
benchmarks/ (not installed).
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable

from workflows.errors import UserError

BENCHMARKS = {"data": "workflows.bench.data", "train": "workflows.bench.train", "tune": "workflows.bench.tune",
              "serve": "workflows.bench.serve", "lm": "workflows.bench.lm", "generate": "workflows.bench.generate"}


def run_benchmark(name: str, config: str | None, overrides: list[str], command: str) -> dict:
    """Run benchmark `name` on `config` (default: its own) and return what it measured."""
    if name == "gpu":
        raise UserError("bench gpu runs without Ray on a CUDA machine, from a checkout: `make bench-gpu` "
                        "(benchmarks/gpu/README.md)")
    if name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS))}")
    return measure(importlib.import_module(BENCHMARKS[name]).run, name, config, overrides, command)


def measure(run: Callable[[str | None, list[str]], dict], name: str, config: str | None, overrides: list[str],
            command: str) -> dict:
    """`run(config, overrides)` with what says where and when it ran: the command, the time, the machine."""
    load_before = round(os.getloadavg()[0], 2)  # a busy machine shifts absolute figures (not ratios)
    result = run(config, overrides)
    load = {"before": load_before, "after_15min": round(os.getloadavg()[2], 2)}
    return {"benchmark": name, "command": command, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {**machine(), "load_average": load}, **result}


def machine() -> dict:
    import platform

    import torch

    info = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info

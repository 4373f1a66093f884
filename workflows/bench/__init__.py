"""Benchmarks: `workflows bench NAME` writes benchmarks/results/NAME.json and a section of docs/BENCHMARKS.md.

Two kinds, decided in #38 from what each measures:
- user commands (USER_BENCHMARKS): the user's own config, cluster and registered model on the path they
  run: data (the shard cache and Ray Data reads), train (Ray Train against a plain loop, FSDP2 against
  DDP), tune (ASHA against FIFO on their search space), serve (their Serve deployment under load,
  against a plain FastAPI peer), lm (the training loop's tokens/s and MFU on their GPUs), generate (their
  chat model's continuous batching against one request at a time and static batching);
- the project's harness (HARNESS_BENCHMARKS): claims about the project itself: quickstart and digits
  (the shipped configs' pipeline against their plain-PyTorch work), madewithml (a reference F1),
  serve-levers (Serve's flags against the peer), shuffle and images (peers from `make bench-peers`'s
  .venv-peers). They stay commands here because docs/BENCHMARKS.md records them as `workflows bench
  NAME` and `--render` rebuilds its sections from this registry. The GPU measurement, never one of
  these commands, lives outside the package: benchmarks/gpu/ (`make bench-gpu`).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import time
from pathlib import Path

from workflows.bench.results import DOC, RESULTS_DIR, write_doc_section
from workflows.errors import UserError
from workflows.storage.atomic import atomic_write

USER_BENCHMARKS = {"data": "workflows.bench.data", "train": "workflows.bench.train", "tune": "workflows.bench.tune",
                   "serve": "workflows.bench.serve", "lm": "workflows.bench.lm", "generate": "workflows.bench.generate"}
HARNESS_BENCHMARKS = {"quickstart": "workflows.bench.quickstart", "digits": "workflows.bench.digits",
                      "madewithml": "workflows.bench.madewithml", "serve-levers": "workflows.bench.serve_levers",
                      "shuffle": "workflows.bench.shuffle", "images": "workflows.bench.images"}
BENCHMARKS = {**USER_BENCHMARKS, **HARNESS_BENCHMARKS}


def run_benchmark(name: str, config: str | None, overrides: list[str], argv: list[str], tag: str | None = None,
                  results_dir: str | Path = RESULTS_DIR, doc: str | Path = DOC) -> dict:
    """Run benchmark `name`; write `results_dir/NAME[-TAG].json` and its section of `doc`.

    A tag keeps a variant (another size, another cluster) beside the default run instead of over it.
    """
    if name == "gpu":
        raise UserError("bench gpu runs without Ray on a CUDA machine: `make bench-gpu` (benchmarks/gpu/README.md); "
                        "`workflows bench gpu --render` writes its section from the stored gpu-*.json")
    if name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS))}")
    if tag is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,39}", tag):
        raise UserError(f"--tag {tag!r}: lower-case letters, digits and '-' (it names a file)")
    key = f"{name}-{tag}" if tag else name
    module = importlib.import_module(BENCHMARKS[name])
    load_before = round(os.getloadavg()[0], 2)  # a busy machine shifts absolute figures (not ratios)
    result = module.run(config, overrides)
    command = "workflows " + " ".join(shlex.quote(a) for a in argv[1:])
    load = {"before": load_before, "after_15min": round(os.getloadavg()[2], 2)}
    result = {"benchmark": name, "tag": tag, "command": command,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {**machine(), "load_average": load}, **result}
    results_dir, doc = Path(results_dir), Path(doc)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{key}.json"
    text = json.dumps(result, indent=2, sort_keys=True)
    atomic_write(path, text)
    result = json.loads(text)  # the doc renders what was stored, as `--render` will later
    write_doc_section(key, section_body(module, result), doc)
    print(f"results written to {path} and {doc}")
    return result


def section_body(module, result: dict) -> str:
    body = module.markdown(result)
    if result.get("tag"):  # the section's heading names its variant
        body = re.sub(r"^(## .*)$", rf"\1 ({result['tag']})", body, count=1, flags=re.M)
    return body


def render(name: str, results_dir: str | Path = RESULTS_DIR, doc: str | Path = DOC) -> list[Path]:
    """Rewrite `doc`'s sections from the stored results of benchmark `name` ("all": every one, tags
    included) without running anything: after a change to a benchmark's report, or to check that
    the doc is what its results say."""
    if name not in ("all", "gpu") and name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; available: all, gpu, {', '.join(sorted(BENCHMARKS))}")
    paths = []
    if name in ("all", "gpu"):  # run on a GPU machine by benchmarks/gpu/run.sh; "not lent yet" without results
        from workflows.bench import gpu_doc  # a member: gpu_doc imports bench.results, not this registry

        paths += gpu_doc.render(results_dir, Path(doc))
        if name == "gpu":
            return paths
    for path in sorted(Path(results_dir).glob("*.json")):
        result = json.loads(path.read_text())
        bench = result.get("benchmark")
        if bench in BENCHMARKS and name in ("all", bench):
            key = f"{bench}-{result['tag']}" if result.get("tag") else bench
            write_doc_section(key, section_body(importlib.import_module(BENCHMARKS[bench]), result), Path(doc))
            paths.append(path)
    if not paths:
        raise UserError(f"no stored results for {name!r} in {results_dir}")
    return paths


def machine() -> dict:
    import platform

    import torch

    info = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info

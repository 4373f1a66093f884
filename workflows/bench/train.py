"""Training throughput on one node: the layout `train.num_workers: auto` chooses against the others, what
Ray Train costs over a plain PyTorch loop, and FSDP2 against DDP.

On the quickstart config (same model, same processed rows, the same global batch: the config's
train.batch_size), four runs, each a fresh process against one fresh embedded store (preprocessed once
beforehand, not timed):

- the plain loop without Ray (`python -m workflows.train.standalone`), one process, every core's thread;
- Ray Train with train.num_workers auto (`workflows.train.layout`: on one node, one worker with the
  node's CPUs, a thread each);
- Ray Train, WORKERS workers x 1 CPU, FSDP2, batch / WORKERS per worker (`workflows.train.trainer.fit`);
- the same with DDP.

Epoch time is measured inside the loop (loop.train_epoch: the steps, including waiting for
batches; no startup, no evaluation); the wall time of each process (interpreter, object store,
Ray start-up, model load, evaluation, checkpoints, shutdown) is reported beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROCESS_START = time.time()
GOAL_RATIO = 1.10
WORKERS = 2  # the several-workers layout on one node
EPOCHS = 2
MIN_EPOCH_SECONDS = 20


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _timed(cmd: list[str]) -> tuple[float, list[float]]:
    load = os.getloadavg()[0]
    t0 = time.time()
    subprocess.run(cmd, check=True)
    return time.time() - t0, [round(load, 2), round(os.getloadavg()[0], 2)]


def _summary(result: dict, wall: float, load: list[float]) -> dict:
    h = result["history"]
    epoch_s = [r["epoch_seconds"] for r in h]
    samples = [r["samples"] for r in h]
    return {
        "epoch_seconds": [round(s, 2) for s in epoch_s],
        "mean_epoch_seconds": round(sum(epoch_s) / len(epoch_s), 2),
        "samples_per_epoch": samples[0],
        "samples_per_s": round(sum(samples) / sum(epoch_s), 2),
        "steps_per_epoch": h[0]["steps"],
        "final_train_loss": round(h[-1]["train_loss"], 4),
        "final_val_f1": round(h[-1]["val_f1"], 4),
        "wall_seconds": round(wall, 1),
        "load_average_before_after": load,
        **{k: result[k] for k in ("world_size", "strategy", "batch_size", "torch_threads", "fit_seconds",
                                  "startup_seconds") if k in result},
    }


def run(config: str | None, overrides: list[str]) -> dict:
    from workflows.config import load_config

    config = config or "quickstart"
    cfg = load_config(config, overrides)
    batch, cores = cfg.train.batch_size, os.cpu_count() or 1
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        base = [f"storage.embedded.data_dir={tmp}/s3", f"output_dir={tmp}/runs", f"cache.dir={tmp}/cache",
                "tune.enabled=false", "serve.enabled=false", f"train.epochs={EPOCHS}", *overrides]
        print("bench train: preprocessing (not timed)", file=sys.stderr, flush=True)
        subprocess.run([py, "-m", "workflows", "preprocess", "--config", config, *_sets(base)], check=True)

        several = ["train.num_workers=" + str(WORKERS), "train.cpus_per_worker=1",
                   f"train.batch_size={max(1, batch // WORKERS)}"]
        child = [py, "-m", "workflows.bench.train", "--config", config]
        plan = [
            ("plain", [py, "-m", "workflows.train.standalone", "--config", config,
                       *_sets([*base, f"train.torch_threads={cores}"])]),
            ("ray_auto", [*child, *_sets([*base, "train.num_workers=auto"])]),
            ("ray_fsdp", [*child, *_sets([*base, *several, "train.strategy=fsdp"])]),
            ("ray_ddp", [*child, *_sets([*base, *several, "train.strategy=ddp"])]),
        ]
        runs: dict[str, dict] = {}
        for name, cmd in plan:
            out = Path(tmp) / f"{name}.json"
            print(f"bench train: {name}", file=sys.stderr, flush=True)
            wall, load = _timed([*cmd, "--output", str(out)])
            runs[name] = _summary(json.loads(out.read_text()), wall, load)

    plain, auto, fsdp, ddp = runs["plain"], runs["ray_auto"], runs["ray_fsdp"], runs["ray_ddp"]
    ray_vs_plain = auto["mean_epoch_seconds"] / plain["mean_epoch_seconds"]
    fsdp_vs_ddp = fsdp["mean_epoch_seconds"] / ddp["mean_epoch_seconds"]
    auto_vs_several = auto["mean_epoch_seconds"] / min(fsdp["mean_epoch_seconds"], ddp["mean_epoch_seconds"])
    return {
        "config": config,
        "epochs": EPOCHS,
        "train_rows": plain["samples_per_epoch"],
        "ray_workers": WORKERS,
        "batch_per_worker": max(1, batch // WORKERS),
        "global_batch": batch,
        "auto_layout": f"{auto.get('world_size')} worker(s) x {auto.get('torch_threads')} thread(s)",
        "runs": runs,
        "ray_vs_plain_epoch_ratio": round(ray_vs_plain, 3),
        "ray_vs_plain_wall_ratio": round(auto["wall_seconds"] / plain["wall_seconds"], 3),
        "auto_vs_several_workers_epoch_ratio": round(auto_vs_several, 3),
        "fsdp_vs_ddp_ratio": round(fsdp_vs_ddp, 3),
        "fsdp_vs_ddp_wall_ratio": round(fsdp["wall_seconds"] / ddp["wall_seconds"], 3),
        "goal_ratio": GOAL_RATIO,
        "ray_vs_plain_meets_goal": ray_vs_plain <= GOAL_RATIO,
        "auto_is_fastest": auto_vs_several <= 1.0,
        "fsdp_vs_ddp_meets_goal": fsdp_vs_ddp <= GOAL_RATIO,
        "epochs_at_least_20s": min(min(r["epoch_seconds"]) for r in runs.values()) >= MIN_EPOCH_SECONDS,
    }


def _ray_child(argv: list[str]) -> None:
    """One Ray Train run in this process: `python -m workflows.bench.train --config C [--set k=v] --output F`."""
    import argparse

    from workflows.config import load_config
    from workflows.runtime import runtime
    from workflows.train.layout import resolved
    from workflows.train.local_run import runs_here
    from workflows.train.standalone import find_dataset
    from workflows.train.trainer import fit

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    with runtime(cfg) as rt:
        data = find_dataset(cfg, rt.storage)
        fit_start = time.time()
        asked, cfg = cfg, resolved(cfg)[0]  # what fit runs: train.num_workers auto chosen for this cluster
        out = fit(asked, rt.storage, data, run_prefix=f"bench-{cfg.train.strategy}")
    result = {
        "history": out.history,
        "fit_seconds": round(out.seconds, 2),
        "world_size": cfg.train.max_workers,
        "strategy": cfg.train.strategy,
        "batch_size": cfg.train.batch_size,
        "torch_threads": cfg.train.torch_threads or max(1, int(cfg.train.cpus_per_worker)),
        "startup_seconds": round(fit_start - PROCESS_START, 2),  # before fit: interpreter, store, ray.init
        "runner": "one Ray actor" if runs_here(asked, cfg, None) else "Ray Train",
    }
    Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    _ray_child(sys.argv[1:])

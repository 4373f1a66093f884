"""The training rows of `python -m benchmarks.images`: images/s delivered into the training step of a
real training run on the bench's tar set, behind the same endpoint. Each run is `fit`
(workflows.train.trainer: Ray Train, the product's trainer) in a process of its own, as `bench train`
runs it (workflows.bench.train's child), with `model.name_or_path: pooled_linear` (a linear
classifier over pooled pixels; batches reach the step as uint8 and it pools before it normalizes:
next to no compute), so that the input pipeline sets the rate.

- train_stream: `train.loader: stream`, `model.options.image_input: raw`: the tars read through the shard
  cache, decoded and cropped in `bench.workers` loader processes (as the "ours" loader rows).
- train_ray_data: the defaults, `train.loader: ray_data` over the preprocessed 224 px pixels
  (`model.options.image_input: pixels`, crop and flip in the training collate); the preprocessing that
  makes those pixels, timed each repetition, is the row's conversion.

Two epochs per run, one Ray Train worker: the first fills the cache (and builds the raw set's
sample index), the second is the measured one. Its rate is the one the trainer reports after the
first step (loop.train_epoch: samples_per_s_after_first_step), as the loader rows' after their first
batch; the whole epoch's rate and the run's start-up are kept beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.images_common import ROOT, _drop, _say

MODEL = "pooled_linear"
EPOCHS = 2  # the first fills the cache; the second is measured
VAL_ROWS = 64  # validation is not measured: a few rows keep it short
LABELS = {
    "train_stream": "workflows train (Ray Train, 1 worker, {model}), loader stream, image_input raw: tars through "
                    "the shard cache, {workers} decode process(es); images/s into the step, warm epoch",
    "train_ray_data": "workflows train defaults (Ray Train, 1 worker, {model}), loader ray_data over the stored "
                      "224 px pixels, crop and flip in the collate; images/s into the step, warm epoch",
}
SETTINGS = {"train_stream": {"loader": "stream", "image_input": "raw"},
            "train_ray_data": {"loader": "ray_data", "image_input": "pixels"}}
KEYS = {"loader": "train.loader", "image_input": "model.options.image_input"}  # SETTINGS' config keys


def config_file(rt, scratch: Path, opts: dict, prefix: str) -> Path:
    """The training runs' config: the bench's set as an image dataset, its store and a cache of
    the runs' own (emptied before each run: its first epoch is cold, its second warm)."""
    cfg = {
        "name": "bench-images-train",
        "storage": {"root": rt.cfg.storage.root,
                    "embedded": {"enabled": True, "data_dir": rt.cfg.storage.embedded.data_dir}},
        "data": {"source": f"{prefix}/*.tar", "format": "tar"},
        "model": {"task": "image_classification", "name_or_path": MODEL, "options": {"image_size": 224}},
        "train": {"num_workers": 1, "cpus_per_worker": 1, "epochs": EPOCHS, "batch_size": int(opts["batch"]),
                  "loader_workers": int(opts["workers"]), "max_val_rows": VAL_ROWS, "lr": 1e-3},
        "cache": {"dir": str(scratch / "cache-train")},
        "output_dir": str(scratch / "runs"),
        "tracking": {"enabled": False}, "tune": {"enabled": False}, "serve": {"enabled": False},
    }
    path = scratch / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _child(cmd: list[str], env: dict, log: Path, rt) -> tuple[float, dict]:
    """Run one child to its end, sampling its process tree's memory (Ray's processes included)."""
    from benchmarks.images_proc import _Memory

    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        with _Memory([proc.pid], rt.embedded._proc.pid) as mem:
            code = proc.wait(timeout=3600)
    if code:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        raise RuntimeError(f"exit {code}: " + " | ".join(lines[-6:]))
    return time.perf_counter() - t0, {"peak_pss_bytes": mem.peak_pss, "peak_rss_bytes": mem.peak_rss}


def _load(path: Path):
    from workflows.config import load_config

    return load_config(path)


def _preprocess(path: Path, env: dict, rt, log: Path) -> dict:
    """`workflows preprocess` of the set to stored 224 px pixels, from nothing: what the defaults cost first."""
    _drop(_load(path).uri("processed"), rt.storage)
    seconds, mem = _child([sys.executable, "-m", "workflows", "preprocess", "--config", str(path)], env, log, rt)
    return {"phase": "train_ray_data_preprocess", "seconds": round(seconds, 1), **mem,
            "load_1min": round(os.getloadavg()[0], 2)}


def train_row(row: str, rep: int, path: Path, opts: dict, env: dict, rt, scratch: Path, logs: Path) -> dict:
    """One training row, once: -> {phase: figures} as the loader rows report theirs, or `error`."""
    from workflows.errors import UserError
    from workflows.train.standalone import find_dataset

    name = f"{row}-rep{rep}"
    out: dict[str, Any] = {}
    try:
        if row == "train_ray_data":
            out["train_ray_data_preprocess"] = _preprocess(path, env, rt, logs / f"{name}-preprocess.log")
        else:
            try:  # the raw row reads val (and the split's keys) from the processed set: made once if missing
                find_dataset(_load(path), rt.storage)
            except UserError:
                _preprocess(path, env, rt, logs / f"{name}-preprocess.log")
        shutil.rmtree(scratch / "cache-train", ignore_errors=True)
        result = scratch / f"{name}.json"
        sets = [a for k, v in SETTINGS[row].items() for a in ("--set", f"{KEYS[k]}={v}")]
        cmd = [sys.executable, "-m", "workflows.bench.train", "--config", str(path), *sets, "--output", str(result)]
        _say(f"bench images: {row} (a training run) ...")
        wall, mem = _child(cmd, env, logs / f"{name}.log", rt)
        out[row] = summarize(row, json.loads(result.read_text()), wall, mem, opts)
        _say(f"bench images: {row}: {out[row]['images_per_s']} images/s into the step")
    except Exception as e:  # a row that breaks is reported, the others still run
        out["error"] = f"{type(e).__name__}: {e}"
        _say(f"bench images: row {name} failed: {out['error']}")
    return out


def summarize(row: str, result: dict, wall: float, mem: dict, opts: dict) -> dict:
    """A run's history -> its measured (last, warm) epoch's figures, the first (cold) epoch's beside."""
    h = result["history"]
    if len(h) < EPOCHS:
        raise RuntimeError(f"{row}: {len(h)} epoch(s) recorded of {EPOCHS}")
    warm, cold = h[-1], h[0]
    rate = warm.get("samples_per_s_after_first_step") or 0.0
    if not warm.get("samples_after_first_step") or rate <= 0:
        raise RuntimeError(f"{row}: the warm epoch had no step after its first ({warm.get('steps')} step(s) of "
                           f"{warm.get('samples')} images): a larger set or a smaller bench.batch")
    return {"phase": row, "label": LABELS[row].format(model=MODEL, workers=opts["workers"]),
            "images": warm["samples"], "images_per_s": round(rate, 1),
            "images_per_s_whole_pass": round(warm["samples_per_s"], 1),
            "first_batch_s": round(warm["first_step_seconds"], 3), "seconds": round(warm["epoch_seconds"], 3),
            "data_wait_s": round(warm["data_wait_seconds"], 2), "steps": warm["steps"],
            "cold_epoch": {"images": cold["samples"], "images_per_s": round(cold["samples_per_s_after_first_step"], 1),
                           "seconds": round(cold["epoch_seconds"], 2)},
            "fit_seconds": result.get("fit_seconds"), "startup_seconds": result.get("startup_seconds"),
            "process_seconds": round(wall, 1), "model": MODEL, "loader_workers": int(opts["workers"]),
            **SETTINGS[row], **mem, "processes": "the run's process tree, Ray's included, over the whole run",
            "load_1min": round(os.getloadavg()[0], 2)}

"""The image task's model.options.image_input raw vs pixels under train.loader=stream (Ray Train, the
config's workers): images/s of training and val F1 per run, on digits and on a small photo-like set written by
synth-images; runs in the order given (interleave them, A B A, so that the shared machine's drift
hits both alike). Usage:
    python benchmarks/image_input.py WORKDIR EPOCHS SETS RUNS
SETS: digits,photos; RUNS: e.g. pixels,raw,pixels (raw0: raw with train.loader_workers=0).
One JSON line per run, also appended to WORKDIR/image_input.jsonl."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from workflows.config import load_config
from workflows.pipeline.stages import stage_preprocess
from workflows.preprocess.synth_images import SynthSpec, parse_size, synth_images
from workflows.runtime import runtime
from workflows.train.trainer import fit

ROOT = Path(__file__).resolve().parent.parent
SETS = {
    "digits": [],  # configs/digits.yaml as it is: 32 px, crops of 0.7-1.0, no flip
    "photos": ["data.source=s3://workflows/synth/photos/", "data.builtin=null", "data.format=tar",
               "model.options.image_size=64", "model.options.augment.flip=true",
               "model.options.augment.crop_scale=[0.35,1.0]", "model.options.augment.crop_ratio=[0.75,1.33]",
               "train.batch_size=16"],
}


def main(work: Path, epochs: int, sets: list[str], runs: list[str]) -> None:
    base = [f"storage.embedded.data_dir={work}/s3", f"output_dir={work}/runs", f"cache.dir={work}/cache",
            "preprocess.concurrency=1", "tracking.enabled=false", "tune.enabled=false", "serve.enabled=false",
            f"train.epochs={epochs}", "train.loader=stream", "train.checkpoint_select=last"]
    for name in sets:
        extra = SETS[name]
        cfg = load_config(ROOT / "configs" / "digits.yaml", [*base, *extra])
        with runtime(cfg) as rt:
            if name == "photos":
                synth_images("s3://workflows/synth/photos/", parse_size("40MB"), rt.storage,
                             SynthSpec(classes=4, seed=0, shard_bytes=parse_size("8MB")), None, say=print)
            data = stage_preprocess(rt)
            for k, run in enumerate(runs):
                image_input, workers = run.rstrip("0"), (0 if run.endswith("0") else None)
                sets = [*base, *extra, f"model.options.image_input={image_input}"]
                if workers is not None:
                    sets.append(f"train.loader_workers={workers}")
                run_cfg = load_config(ROOT / "configs" / "digits.yaml", sets)
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                out = fit(run_cfg, rt.storage, data, run_prefix=f"{name}-{k}-{image_input}")
                h = out.history
                processes = run_cfg.train.decode_workers(image_input == "raw")
                row = {"set": name, "input": image_input, "loader_workers": processes,
                       "train_images": data.counts["train"], "images_per_s": round(
                           sum(e["samples_per_s"] for e in h) / len(h), 1),
                       "val_f1": round(h[-1]["val_f1"], 4), "seconds": round(time.perf_counter() - t0, 1),
                       "load_1min": round(load, 2)}
                print(json.dumps(row), flush=True)
                with open(work / "image_input.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4].split(","))

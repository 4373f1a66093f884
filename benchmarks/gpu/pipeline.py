"""The GPU measurement's product-path step (issue #62, item 6): `workflows pipeline` through Ray Train on
one GPU for the quickstart, digits and chat configs, each registered score set against the CPU figure,
and the Ray Train path's samples/s against the torchrun path's on the same device and data.

    python -m benchmarks.gpu.pipeline prepare --out .gpu-prep     # here (part of make bench-gpu-prepare)

Every run, here and there, has one storage root on local disk (no embedded S3: moto is not on the device),
no tracking, no tuning and no serving (`COMMON`): the registered model of `train.checkpoint_select=last`
and the held-out evaluation are what is compared. The configs' own settings otherwise, on one worker
(one GPU there; its global batch is then the same here), with `RUNS`' changes:
- quickstart: the raw shards this machine built (the quickstart data comes from its installed libraries'
  docstrings, which differ there) and MiniLM with bf16-rounded weights (fp32 weights are over what
  travels), both in the prepared folder; 1,024 training rows, 1 epoch;
- digits: built there as here (scikit-learn's bundled digits);
- chat: built there as here (a seeded synthetic set); the base is SmolLM2's tokenizer with a small random
  Llama (seed 0; SmolLM2's weights do not travel), so the figures show that both paths train the same,
  not what SmolLM2 learns.

`prepare` runs the same step on this CPU and stores its figures (`cpu-pipeline.json`); on the device the
step reads them. Goals: each registered val score and held-out score within 0.01 of the CPU figure (chat:
exact match within 0.05, and its val loss), Ray Train's samples/s at least 0.9x torchrun's. SMOKE: one
config (digits) at toy size on the CPU, compared with itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workflows.errors import UserError

COMMON = ["storage.embedded.enabled=false", "tracking.enabled=false", "tune.enabled=false", "serve.enabled=false",
          "train.num_workers=1", "train.checkpoint_select=last"]
RUNS: dict[str, list[str]] = {
    "quickstart": ["data.builtin=null", "train.epochs=1", "train.max_train_rows=1024"],
    "digits": ["data.write_builtin=true"],
    # uncompiled: conversations differ in length (a compiled run recompiles for the first new one)
    "chat": ["data.write_builtin=true", "train.compile=false"],
}
SMOKE_RUNS = {"digits": ["data.write_builtin=true", "train.epochs=1", "train.max_train_rows=128",
                         "train.max_val_rows=64"]}
CHAT_ARCH: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=512,
                                 rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
CPU_FIGURES = "cpu-pipeline.json"
QUICKSTART_RAW = "quickstart-raw"
GOAL_SCORE_DELTA, GOAL_CHAT_EXACT_DELTA, GOAL_RAY_VS_TORCHRUN = 0.01, 0.05, 0.9


def run_sets(config: str, prep: Path, work: Path, gpu: bool, runs: dict[str, list[str]]) -> list[str]:
    """The --set list of one config's runs (the pipeline's and torchrun's), under `work`."""
    sets = [*COMMON, *runs[config], f"storage.root={work}/store", f"output_dir={work}/runs", f"cache.dir={work}/cache",
            f"train.use_gpu={str(gpu).lower()}", f"train.cpus_per_worker={min(8, os.cpu_count() or 1)}"]
    if config == "quickstart":
        model = work / "minilm"
        if not model.exists():
            from benchmarks.gpu.classify import convert_model

            convert_model(prep / "minilm-bf16", model, "float32")
        sets += [f"data.source={prep / QUICKSTART_RAW}/", f"model.name_or_path={model}",
                 f"preprocess.tokenizer={model}"]
    else:
        sets += [f"data.source={work}/raw/{config}/"]
    if config == "chat":
        from benchmarks.gpu.chat import SMOLLM2, base_model, load_carried_tokenizer

        base = work / "chat-base"
        if not base.exists():
            tok = load_carried_tokenizer(prep / SMOLLM2)
            base_model(base, {**CHAT_ARCH, "vocab_size": len(tok)}, tok)
        sets += [f"model.name_or_path={base}"]
    return sets


def command(args: list[str], sets: list[str], log: Path) -> None:
    """Run `python -m ARGS --set ...`, its output into `log`; a failure names the log's last lines."""
    with open(log, "wb") as f:
        done = subprocess.run([sys.executable, "-m", *args, *[a for s in sets for a in ("--set", s)]],
                              stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        lines = log.read_text(errors="replace").strip().splitlines()
        said = [ln for ln in lines if ln.startswith("error:")]  # a UserError's one line, else the end
        raise UserError(f"{' '.join(args[:4])}: exit {done.returncode}: " + " | ".join(said or lines[-5:]))


def epoch_rate(history: list[dict]) -> dict:
    """The last epoch's throughput figures."""
    last = history[-1] if history else {}
    return {k: round(float(last.get(k) or 0.0), 2) for k in ("samples_per_s", "samples_per_s_after_first_step",
                                                              "epoch_seconds", "data_wait_seconds")}


def run_config(config: str, prep: Path, work: Path, gpu: bool, runs: dict[str, list[str]]) -> dict:
    """One config's pipeline (Ray Train) and its torchrun run on the processed dataset the pipeline made."""
    from workflows.config import load_config
    from workflows.tasks import get_task

    work.mkdir(parents=True, exist_ok=True)
    sets = run_sets(config, prep, work, gpu, runs)
    metric = get_task(load_config(config, sets)).score[0]
    t0 = time.time()
    command(["workflows", "pipeline", "--config", config], sets, work / "pipeline.log")
    wall = time.time() - t0
    summary = json.loads(next((work / "runs").glob("*/pipeline.json")).read_text())
    history = json.loads(Path(summary["train"]["run"].removeprefix("file://"), "history.json").read_text()) \
        if Path(summary["train"]["run"].removeprefix("file://"), "history.json").exists() else []
    best = summary["train"]["best_metrics"]
    out: dict = {"config": config, "metric": metric, "val_score": round(float(best[metric]), 4),
                 "heldout": {k: round(float(v), 4) if isinstance(v, float) else v
                             for k, v in summary["evaluate"]["headline"].items()},
                 "model": f"{summary['model']['name']}:v{summary['model']['version']}",
                 "ray_train": {**epoch_rate(history), "epochs": len(history)}, "pipeline_seconds": round(wall, 1),
                 "stage_seconds": summary.get("seconds", {})}
    if config == "quickstart" and gpu:  # the registered model's Predictor (serving's and evaluation's), fp32, bf16
        out["predictor"] = predictor_rates(Path(summary["model"]["uri"].removeprefix("file://")),
                                           Path(summary["dataset"]["uri"].removeprefix("file://")))
    if config == "chat":
        out["val_exact_match"] = round(float(best.get("val_exact_match", 0.0)), 4)
        out["val_loss"] = round(float(best["val_loss"]), 4)
    t0 = time.time()
    # the same settings: standalone finds the processed dataset the pipeline made (its version, under the root)
    torchrun = ["torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "workflows.train.standalone",
                "--config", config, "--output", str(work / "standalone.json")]
    command(torchrun, sets, work / "torchrun.log")
    standalone = json.loads((work / "standalone.json").read_text())
    out["torchrun"] = {**epoch_rate(standalone["history"]), "epochs": len(standalone["history"]),
                       "seconds": round(time.time() - t0, 1)}
    # the steady rates (after each epoch's first step: the compiler's, a cold loader's) of the last epoch
    key = "samples_per_s_after_first_step"
    rate = out["torchrun"][key]
    out["ray_vs_torchrun"] = round(out["ray_train"][key] / rate, 3) if rate else None
    return out


PREDICTOR_ROWS = 8192  # the test split repeated to this many rows: a pass of a few seconds on a GPU, not 0.1
GOAL_PREDICTOR_BF16 = 1.0


def predictor_rates(model_dir: Path, dataset: Path) -> dict:
    """Rows/s of the text Predictor over the held-out split (repeated to PREDICTOR_ROWS), fp32 then bf16
    (weights converted once, when it loads), and the F1 of each."""
    import pandas as pd

    from benchmarks.gpu.classify import score_predictor

    test = pd.concat(pd.read_parquet(f) for f in sorted((dataset / "split=test").glob("*.parquet")))
    test = pd.concat([test] * -(-PREDICTOR_ROWS // max(len(test), 1)), ignore_index=True)
    rates = {}
    for precision in ("fp32", "bf16"):
        r = score_predictor(model_dir, test, precision)
        r.pop("predictor")
        rates[precision] = r
    fp32, bf16 = rates["fp32"]["rows_per_s"], rates["bf16"]["rows_per_s"]
    return {**rates, "bf16_vs_fp32": round(bf16 / fp32, 3) if fp32 else None, "goal_bf16_vs_fp32": GOAL_PREDICTOR_BF16,
            "bf16_f1_delta": round(rates["bf16"]["f1"] - rates["fp32"]["f1"], 4)}


def compare(run: dict, cpu: dict | None) -> dict:
    """The run's scores against the CPU figure's, and whether each goal is met."""
    if cpu is None:
        return {"cpu": None}
    delta = {"val_score": round(run["val_score"] - cpu["val_score"], 4),
             "heldout": round(run["heldout"]["value"] - cpu["heldout"]["value"], 4)}
    if run["config"] == "chat":
        goal = abs(delta["heldout"]) <= GOAL_CHAT_EXACT_DELTA
        delta["val_loss_rel"] = round((run["val_loss"] - cpu["val_loss"]) / max(abs(cpu["val_loss"]), 1e-9), 4)
    else:
        goal = abs(delta["val_score"]) <= GOAL_SCORE_DELTA and abs(delta["heldout"]) <= GOAL_SCORE_DELTA
    speed = run.get("ray_vs_torchrun")
    return {"cpu": {k: cpu[k] for k in ("val_score", "heldout", "ray_train") if k in cpu}, "delta_vs_cpu": delta,
            "scores_goal_met": goal, "speed_goal_met": speed is not None and speed >= GOAL_RAY_VS_TORCHRUN}


def step_pipeline(smoke: bool, emit, data: str | None) -> None:
    """Each config through `workflows pipeline` (Ray Train), then torchrun on its data, against the CPU."""
    import torch

    gpu = torch.cuda.is_available()
    runs = SMOKE_RUNS if smoke else RUNS
    with tempfile.TemporaryDirectory(prefix="gpu-pipeline-") as tmp:
        prep = Path(data) if data else (Path(tmp) / "prep" if smoke else None)
        if prep is None or (not smoke and not (prep / CPU_FIGURES).exists()):
            raise UserError(f"pipeline: {f'--prepared {prep}: no {CPU_FIGURES}' if prep else 'no prepared folder'}; "
                            "run `make bench-gpu-prepare` here and carry the folder it writes")
        cpu = json.loads((prep / CPU_FIGURES).read_text()) if (prep / CPU_FIGURES).exists() else {}
        import ray

        out: dict = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "ray": ray.__version__,
                     "common_sets": COMMON, "runs": {}, "goals": {"score_delta": GOAL_SCORE_DELTA,
                                                                  "chat_exact_match_delta": GOAL_CHAT_EXACT_DELTA,
                                                                  "ray_vs_torchrun": GOAL_RAY_VS_TORCHRUN},
                     "cpu_source": cpu.get("source")}
        for config in runs:
            r = run_config(config, prep, Path(tmp) / config, gpu, runs)
            out["runs"][config] = {**r, **compare(r, (cpu.get("runs") or {}).get(config) if not smoke else r)}
            emit(out)


def prepare(out: Path) -> dict:
    """Into `out` (the prepared folder): the quickstart's raw shards as this machine builds them, then the
    step run on this CPU, its figures as cpu-pipeline.json (needs minilm-bf16/ and smollm2/ there:
    benchmarks.gpu.classify's and .generate's prepare, run first by make bench-gpu-prepare)."""
    from workflows.preprocess import quickstart_data
    from workflows.storage.uri import StorageContext

    out = out.resolve()
    for need in ("minilm-bf16", "smollm2"):
        if not (out / need).exists():
            raise UserError(f"{out / need} is missing: run `python -m benchmarks.gpu.classify prepare` first")
    raw = out / QUICKSTART_RAW
    shutil.rmtree(raw, ignore_errors=True)
    quickstart_data.write_shards(quickstart_data.build(800), str(raw), StorageContext())
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gpu-pipeline-cpu-") as tmp:
        runs = {config: run_config(config, out, Path(tmp) / config, False, RUNS) for config in RUNS}
    figures = {"runs": runs,
               "source": f"this step on this machine's CPU, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s"}
    (out / CPU_FIGURES).write_text(json.dumps(figures, indent=2))
    return figures


def main(argv: list[str] | None = None) -> int:
    from benchmarks.gpu.classify import prepare_main

    return prepare_main("benchmarks.gpu.pipeline", "bench gpu prepare (pipeline)", prepare,
                        lambda out, f: f"{out / CPU_FIGURES} written ({f['source']}): " + ", ".join(
                            f"{c} {r['metric']} {r['val_score']}" for c, r in f["runs"].items()), argv)


if __name__ == "__main__":
    raise SystemExit(main())

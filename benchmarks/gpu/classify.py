"""The GPU measurement's classification step, and the prepare step it needs (run here, on CPU).

    python -m benchmarks.gpu.classify prepare --out .gpu-prep   # make bench-gpu-prepare

The device cannot rebuild the quickstart data (it is made from this machine's installed libraries'
docstrings) and MiniLM's fp32 weights (~90 MB) are over the 64 MB that travels, so `prepare` writes
into a gitignored, carried folder: the quickstart's processed dataset (parquet of token ids, from
the real `workflows preprocess`), a bf16 safetensors copy of MiniLM with its tokenizer files
(~45 MB), and the CPU figure: the torchrun path's held-out F1 after training on the same data, from
the same bf16-rounded weights, with the same settings (`cpu.json`).

On the device (`classify`): the bf16 copy is widened to fp32 again (both runs start from the same
weights), the torchrun path trains it (bf16 autocast on the GPU), its held-out F1 set against
the CPU figure; the checkpoint is exported as the pipeline exports it and the text Predictor scores
the test split in fp32 and bf16 (rows/s, F1 delta), and predicts batched (32 rows a call) against
unbatched (one row a call). SMOKE: a toy BERT and a few hundred toy rows made on the spot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workflows.errors import UserError

# the same training settings here (the CPU figure) and on the device; a few hundred steps at most
TRAIN_SETS = ["storage.embedded.enabled=false", "tracking.enabled=false", "train.epochs=1", "train.batch_size=32",
              "train.max_train_rows=2048", "train.checkpoint_select=last"]
SMOKE_SETS = ["train.max_train_rows=64", "train.max_val_rows=32", "evaluate.batch_size=16"]
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
GOAL_F1_DELTA, GOAL_BATCHED = 0.01, 4.0


def convert_model(src: str | Path, dst: str | Path, dtype: str) -> None:
    """`src`'s safetensors weights cast to `dtype` ("bfloat16" / "float32") with its config and
    tokenizer files, into `dst` (written to a temp name, then renamed)."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    if not (src / "model.safetensors").exists():
        raise UserError(f"{src}: no model.safetensors (run `make bench-gpu-prepare`)")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
             for k, v in load_file(src / "model.safetensors").items()}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    for name in MODEL_FILES:
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def local_copy(processed: Path, dst: Path, tokenizer: str) -> Path:
    """The processed dataset copied with its manifest's tokenizer pointing at `tokenizer` (the
    device has no packaged MiniLM; this machine's path means nothing there)."""
    if not (processed / "manifest.json").exists():
        raise UserError(f"{processed}: no manifest.json (run `make bench-gpu-prepare`)")
    shutil.copytree(processed, dst)
    m = json.loads((dst / "manifest.json").read_text())
    (dst / "manifest.json").write_text(json.dumps({**m, "tokenizer": tokenizer, "uri": str(dst)}))
    return dst


def train_torchrun(data: Path, model: Path, work: Path, sets: list[str], gpu: bool) -> dict:
    """The torchrun path (one process) on `data` from `model`: its summary (history, samples/s)."""
    summary, ckpt = work / "standalone.json", work / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "workflows.train.standalone", "--config", "quickstart", "--data", str(data),
           "--output", str(summary), "--checkpoint-dir", str(ckpt)]
    for s in [*TRAIN_SETS, *sets, f"model.name_or_path={model}", f"preprocess.tokenizer={model}",
              f"train.use_gpu={str(gpu).lower()}", f"output_dir={work}/runs"]:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    return json.loads(summary.read_text())


def f1_of(summary: dict) -> float:
    return round(float(summary["history"][-1]["val_f1"]), 4)


def export(data_dir: Path, model: Path, ckpt: Path, out: Path) -> Path:
    """The last epoch's checkpoint as the pipeline's serving artifact (the text task's export)."""
    from workflows.config import load_config
    from workflows.storage.uri import StorageContext
    from workflows.tasks import get_task
    from workflows.train.checkpoint import consolidated_model_state
    from workflows.train.standalone import find_dataset

    cfg = load_config("quickstart", [*TRAIN_SETS, f"model.name_or_path={model}", f"preprocess.tokenizer={model}"])
    data = find_dataset(cfg, StorageContext(), str(data_dir))
    state = consolidated_model_state(str(sorted(ckpt.glob("epoch_*"))[-1]))
    get_task(cfg).serving.export(state, data, str(out), {"bench": "gpu classify"})
    return out


def score_predictor(model_dir: Path, test, precision: str) -> dict:
    """Rows/s and weighted F1 of the Predictor over the test split (64 rows a batch, after a warm-up)."""
    import torch
    from sklearn.metrics import f1_score

    from workflows.tasks.text.predictor import TextPredictor

    p = TextPredictor(str(model_dir), precision=precision)
    columns = {c: test[c].astype(str).tolist() for c in p.text_columns}
    p.probabilities({c: v[:64] for c, v in columns.items()})  # warm-up: kernels, allocator
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    probs = p.probabilities(columns)
    sync()
    seconds = time.perf_counter() - t0
    predicted = [p.labels[i] for i in probs.argmax(-1)]
    f1 = f1_score(test[p.card.label_column].astype(str), predicted, average="weighted")
    return {"rows_per_s": round(len(test) / seconds, 1), "f1": round(float(f1), 4), "rows": len(test), "predictor": p}


def batched_vs_unbatched(p, rows: list[dict], batch: int = 32) -> dict:
    """In-process predict(): `batch` rows a call against one row a call, rows/s of each."""
    def rate(size: int) -> float:
        p.predict(rows[:size])  # warm-up at this shape
        t0 = time.perf_counter()
        for i in range(0, len(rows), size):
            p.predict(rows[i: i + size])
        return len(rows) / (time.perf_counter() - t0)

    one, many = rate(1), rate(batch)
    return {"unbatched_rows_per_s": round(one, 1), f"batched{batch}_rows_per_s": round(many, 1),
            "batched_vs_unbatched": round(many / one, 2), "batch": batch, "rows": len(rows)}


def step_classify(smoke: bool, emit, data: str | None) -> None:
    """Train (torchrun path, bf16 autocast on the GPU) and score the Predictor (fp32, bf16, batched)."""
    import glob

    import pandas as pd
    import torch

    gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="gpu-classify-") as tmp:
        work = Path(tmp)
        prep = Path(data) if data else (smoke_prepare(work / "prep") if smoke else None)
        if prep is None or not (prep / "cpu.json").exists():
            where = f"--prepared {prep}: no cpu.json there" if prep else "no prepared folder (.gpu-prep/ is absent)"
            raise UserError(f"classify: {where}; run `make bench-gpu-prepare` here and carry the folder it writes")
        cpu = json.loads((prep / "cpu.json").read_text())
        model = work / "minilm"
        convert_model(prep / "minilm-bf16", model, "float32")
        processed = local_copy(prep / "processed", work / "processed", str(model))
        out: dict = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "model": cpu["model"],
                     "precision": "bf16 autocast" if gpu else "fp32", "train_settings": TRAIN_SETS,
                     "cpu_f1": cpu["f1"], "cpu_f1_source": cpu["source"], "goal_f1_delta": GOAL_F1_DELTA,
                     "goal_batched_vs_unbatched": GOAL_BATCHED}
        summary = train_torchrun(processed, model, work, cpu.get("sets", []), gpu)
        last = summary["history"][-1]
        out.update(train_f1=f1_of(summary), train_samples_per_s=round(last["samples_per_s"], 1),
                   train_rows=summary["train_rows"], train_seconds=summary["train_seconds"])
        out["f1_delta_vs_cpu"] = round(out["train_f1"] - cpu["f1"], 4)
        emit(out)

        artifact = export(processed, model, work / "ckpt", work / "model")
        test = pd.concat(pd.read_parquet(f) for f in sorted(glob.glob(str(processed / "split=test" / "*.parquet"))))
        fp32 = score_predictor(artifact, test, "fp32")
        predictor = fp32.pop("predictor")
        out["predictor"] = {"fp32": fp32}
        emit(out)
        bf16 = score_predictor(artifact, test, "bf16")
        bf16.pop("predictor")
        out["predictor"]["bf16"] = bf16
        out["predictor_bf16_f1_delta"] = round(bf16["f1"] - fp32["f1"], 4)
        emit(out)
        rows = test[predictor.text_columns].astype(str).to_dict("records")[: 16 if smoke else 1024]
        out["in_process"] = {"precision": "fp32", **batched_vs_unbatched(predictor, rows)}
        emit(out)


def smoke_prepare(dst: Path) -> Path:
    """A toy prepared folder, as `prepare` lays it out: a 2-layer BERT with a word-level vocabulary,
    a few hundred rows of two labels; cpu.json says it is no measurement."""
    import numpy as np
    import pandas as pd
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    words = [f"w{i}" for i in range(40)]
    vocab = dst / "vocab"
    vocab.mkdir(parents=True)
    (vocab / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tok = BertTokenizerFast(str(vocab / "vocab.txt"))
    tok.save_pretrained(vocab)
    model = BertForSequenceClassification(BertConfig(vocab_size=len(words) + 5, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64))
    model.save_pretrained(vocab)
    convert_model(vocab, dst / "minilm-bf16", "bfloat16")
    rng = np.random.default_rng(0)
    frames = []
    for split, n in (("train", 128), ("val", 32), ("test", 32)):
        labels = rng.integers(0, 2, n)
        texts = [" ".join(rng.choice(words[:20] if y else words[20:], 6)) for y in labels]
        frames.append((split, pd.DataFrame({"text": texts, "label": [f"l{y}" for y in labels],
                                            "input_ids": [np.asarray(tok(t)["input_ids"], np.int32) for t in texts],
                                            "label_id": labels.astype(np.int64), "split": split})))
    processed = dst / "processed"
    for split, frame in frames:
        (processed / f"split={split}").mkdir(parents=True)
        frame.to_parquet(processed / f"split={split}" / "part-0.parquet")
    manifest = {"uri": str(processed), "version": "smoke", "labels": ["l0", "l1"], "label_column": "label",
                "files": {s: [f"split={s}/part-0.parquet"] for s, _ in frames},
                "counts": {s: len(f) for s, f in frames},
                "label_counts": {s: f["label"].value_counts().to_dict() for s, f in frames}, "source": "smoke",
                "text_columns": ["text"], "tokenizer": "minilm", "max_length": 16}
    (processed / "manifest.json").write_text(json.dumps(manifest))
    (dst / "cpu.json").write_text(json.dumps({"f1": 0.0, "model": "toy BERT (smoke)", "sets": SMOKE_SETS,
                                             "source": "none: a smoke run measures nothing"}))
    return dst


def preprocessed_copy(config: str, work: Path, dst: Path) -> None:
    """The real `workflows preprocess --config CONFIG` against a fresh embedded store under `work`
    (Ray runs here, not on the device), its processed dataset copied to the local folder `dst`."""
    from benchmarks.pipeline_run import fresh_overrides
    from workflows.config import load_config
    from workflows.runtime import runtime
    from workflows.storage.uri import filesystem

    sets = fresh_overrides(work)
    cmd = [sys.executable, "-m", "workflows", "preprocess", "--config", config]
    for attempt in range(3):  # Ray's node start gives up after 30 s, which a loaded machine can exceed
        done = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], check=attempt == 2)
        if done.returncode == 0:
            break
    cfg = load_config(config, sets)
    stage = json.loads((work / "runs" / cfg.name / "preprocess.json").read_text())
    with runtime(cfg, ray_needed=False) as rt:
        fs, path = filesystem(stage["dataset"]["uri"], rt.storage)
        fs.get(path.rstrip("/") + "/", str(dst) + "/", recursive=True)


def prepare(out: Path) -> dict:
    """The carried folder: processed split (the real `workflows preprocess`), bf16 MiniLM, CPU F1."""
    from workflows.preprocess.encoding import packaged_minilm

    out = out.resolve()
    with tempfile.TemporaryDirectory(prefix="gpu-prepare-") as tmp:
        work = Path(tmp)
        staged = work / "prep"
        preprocessed_copy("quickstart", work, staged / "processed")
        convert_model(packaged_minilm(), staged / "minilm-bf16", "bfloat16")
        # the generate step's: SmolLM2-135M-Instruct's tokenizer and config, from the packaged GGUF
        from benchmarks.gpu.generate import PREPARED as SMOLLM2
        from benchmarks.gpu.generate import prepare as prepare_generate

        try:
            prepare_generate(staged / SMOLLM2)
        except UserError as e:  # the generate step then detokenizes with a toy tokenizer, and says so
            print(f"bench gpu prepare: generate: {e}; its step will use a toy tokenizer")
        # the CPU figure: the same training from the same (bf16-rounded) weights, on this machine's CPU
        model = work / "minilm"
        convert_model(staged / "minilm-bf16", model, "float32")
        processed = local_copy(staged / "processed", work / "processed", str(model))
        t0 = time.time()
        summary = train_torchrun(processed, model, work, [], gpu=False)
        cpu = {"f1": f1_of(summary), "model": "all-MiniLM-L6-v2 (bf16-rounded weights)", "sets": [],
               "source": f"torchrun path on this machine's CPU, {summary['train_rows']} training rows, "
                         f"{time.time() - t0:.0f} s, {time.strftime('%Y-%m-%d')}",
               "samples_per_s": round(summary["history"][-1]["samples_per_s"], 1)}
        (staged / "cpu.json").write_text(json.dumps(cpu, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), str(out))
    return cpu


def prepare_main(module: str, what: str, prepare_into, done, argv: list[str] | None = None) -> int:
    """`python -m MODULE prepare [--out DIR]`: run `prepare_into(DIR)`, print `done(DIR, its result)`;
    a user error or a failed command is one line naming `what` was being prepared."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}")
    ap.add_argument("command", choices=["prepare"])
    ap.add_argument("--out", default=".gpu-prep", help="the folder to carry to the device")
    a = ap.parse_args(argv)
    try:
        info = prepare_into(Path(a.out))
    except UserError as e:
        print(f"{what}: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:  # its own output, above, says why
        print(f"{what}: {' '.join(e.cmd[1:5])} ... failed (exit {e.returncode}); nothing written to "
              f"{a.out}", file=sys.stderr)
        return 1
    print(f"{what}: {done(Path(a.out), info)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return prepare_main("benchmarks.gpu.classify", "bench gpu prepare", prepare,
                        lambda out, cpu: f"{out} written; CPU held-out F1 {cpu['f1']} ({cpu['source']})", argv)


if __name__ == "__main__":
    raise SystemExit(main())

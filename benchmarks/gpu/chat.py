"""The GPU measurement's chat fine-tuning step, and the prepare step it needs (run here, on CPU).

    python -m benchmarks.gpu.chat prepare --out .gpu-prep   # make bench-gpu-prepare (after classify's)

`prepare` writes `.gpu-prep/chat-processed/`: the chat config's processed dataset (token ids with
assistant-only labels) from the real `workflows preprocess --config chat` on Ray (SmolLM2-135M-Instruct's
tokenizer and chat template, from the packaged GGUF), re-encoded with the carried tokenizer
(`.gpu-prep/smollm2/`, the generate step's) to check that the two give the same ids.

On the device (`chat`): a model with SmolLM2-135M-Instruct's exact architecture and random weights
(seed 0; the real weights cannot travel, see benchmarks/gpu/generate.py) is saved as safetensors with the
carried tokenizer into a temp folder, and model.name_or_path points at it. The chat config's own LoRA
fine-tuning (r 16, alpha 32, all linear layers; 2 epochs at batch 8, lr 1e-3) then runs three times
from that one init, on the same rows in the same order:

- `lora_bf16`: the torchrun path (`torch.distributed.run --standalone --nproc_per_node=1 -m
  workflows.train.standalone --config chat`, train.use_gpu=true: one GPU process, so bf16 autocast
  around each forward), as a user runs it;
- `lora_fp32`: the same Trainer in this process (standalone's local_input and TorchrunTrainer, as
  benchmarks/gpu/diag_classify.py), autocast off: the fp32 reference. It also records the attention
  implementation the model loaded with and the SDPA calls one forward makes;
- `full_bf16`: the torchrun path with model.options.finetune=full, when the step has time left (SMOKE:
  in this process).

Goals: the bf16 run's val loss within 2% of the fp32 run's, and the loss falling in both. SMOKE: a tiny
Llama, a byte-level BPE tokenizer with a ChatML template and a few dozen rows, made on the spot (no Ray).
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

CHAT_PREP = "chat-processed"  # the folder in .gpu-prep
SMOLLM2 = "smollm2"  # the generate step's: SmolLM2's tokenizer files (benchmarks.gpu.generate.PREPARED)
SEED = 0
# every run, here and there: no object store, no tracking, no checkpoint (no --checkpoint-dir)
BASE_SETS = ["storage.embedded.enabled=false", "tracking.enabled=false"]
SIZES: dict[str, dict[str, Any]] = {
    # the chat config as it ships (epochs 2, batch 8, lr 1e-3, LoRA r 16); the full fine-tune starts only
    # while the step has run less than full_after_s (its limit is 150 s). SMOKE: the full fine-tune in this
    # process (a second torchrun start would double the step's time on a small CPU)
    # uncompiled (train.compile=false): conversations differ in length, and a 2-epoch run would time the
    # compiler; the bf16 run's frozen base is bf16 (the chat task's prepare_model on a GPU)
    "full": dict(sets=["train.compile=false"], full_after_s=80.0, full_torchrun=True),
    "smoke": dict(sets=["train.max_train_rows=32", "train.max_val_rows=8", "evaluate.batch_size=8",
                        "model.options.max_new_tokens=4"], full_after_s=1e9, full_torchrun=False)}
SMOKE_ARCH: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, hidden_act="silu", max_position_embeddings=256,
                                  rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
GOAL_VAL_LOSS_REL = 0.02
CHECK_ROWS = 16  # rows re-encoded with the carried tokenizer


def load_carried_tokenizer(folder: Path):
    """The carried tokenizer (SmolLM2's, saved here by another transformers than the device's, maybe):
    AutoTokenizer, else its tokenizer.json alone with SmolLM2's special tokens and the chat template."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        print(f"chat: AutoTokenizer: {e!r}; reading tokenizer.json alone", flush=True)
        tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>",
                                      pad_token="<|im_end|>", bos_token="<|im_start|>", unk_token="<|endoftext|>")
        tok.chat_template = (folder / "chat_template.jinja").read_text()
        return tok


def base_model(dst: Path, arch: dict, tok) -> Path:
    """A LlamaForCausalLM of `arch` with random weights (seed 0), fp32 safetensors, and `tok`, in
    from_pretrained layout: the chat task's base model (model.name_or_path)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**arch, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                            "pad_token_id": tok.pad_token_id})
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(dst, safe_serialization=True)
    tok.save_pretrained(dst)
    return dst


def stored_conversation(prompt: str, answer: str) -> list[dict]:
    return [*json.loads(prompt), {"role": "assistant", "content": answer}]


def tokenizer_check(processed: Path, tokenizer_dir: Path, rows: int = CHECK_ROWS) -> dict:
    """The first training rows re-encoded by the chat task's encoder with `tokenizer_dir`'s tokenizer:
    how many give the stored input_ids and labels exactly."""
    import glob

    import pyarrow as pa
    import pyarrow.parquet as pq

    from workflows.loader.columns import column_values  # token ids as training reads them
    from workflows.tasks.chat.training.data import ChatEncoder

    manifest = json.loads((processed / "manifest.json").read_text())
    files = sorted(glob.glob(str(processed / "split=train" / "*.parquet")))
    names = ["prompt", "answer", "input_ids", "labels"]
    table = pa.concat_tables(pq.read_table(f, columns=names) for f in files[:4]).slice(0, rows)
    cols = {c: column_values(table.column(c)) for c in names}
    encoder = ChatEncoder(str(tokenizer_dir), int(manifest["max_length"]))
    same, first = 0, None
    for i in range(table.num_rows):
        got = encoder.encode(stored_conversation(str(cols["prompt"][i]), str(cols["answer"][i])))
        ids, stored = ([] if got is None else got["input_ids"].tolist()), [int(t) for t in cols["input_ids"][i]]
        labels = [] if got is None else got["labels"].tolist()
        if ids == stored and labels == [int(t) for t in cols["labels"][i]]:
            same += 1
        elif first is None:  # the first row that differs: where, and the ids around it
            at = next((j for j, (a, b) in enumerate(zip(ids, stored)) if a != b), min(len(ids), len(stored)))
            lo = max(0, at - 3)
            first = {"row": i, "at": at, "stored": stored[lo: at + 5], "encoded": ids[lo: at + 5],
                     "stored_len": len(stored), "encoded_len": len(ids), "labels_differ": ids == stored}
    return {"rows": table.num_rows, "identical": same, **({"first_difference": first} if first else {})}


def config_sets(model_dir: Path, work: Path, gpu: bool, sets: list[str]) -> list[str]:
    return [*BASE_SETS, *sets, f"model.name_or_path={model_dir}", f"train.use_gpu={str(gpu).lower()}",
            f"output_dir={work}/runs", f"cache.dir={work}/cache"]


def train_torchrun(data: Path, model_dir: Path, work: Path, sets: list[str], gpu: bool) -> dict:
    """The torchrun path (one process) with the chat config: its summary (history, train seconds)."""
    work.mkdir(parents=True, exist_ok=True)
    summary = work / "standalone.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "workflows.train.standalone", "--config", "chat", "--data", str(data), "--output", str(summary)]
    for s in config_sets(model_dir, work, gpu, sets):
        cmd += ["--set", s]
    t0 = time.time()
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    return {**json.loads(summary.read_text()), "process_seconds": round(time.time() - t0, 1)}


def count_sdpa(model, batch) -> int:
    """torch's scaled_dot_product_attention calls in one forward of `batch` (transformers' SDPA
    attention calls it through torch.nn.functional each time; eager attention never does)."""
    import torch
    import torch.nn.functional as F

    calls = 0
    orig = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return orig(*args, **kwargs)

    F.scaled_dot_product_attention = counting
    try:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    finally:
        F.scaled_dot_product_attention = orig
    return calls


def train_in_process(data_dir: Path, model_dir: Path, work: Path, sets: list[str], gpu: bool, amp) -> dict:
    """The torchrun path's own parts in this process (find_dataset, local_input, TorchrunTrainer), with
    autocast `amp` (None: fp32): a summary like standalone's, and what the model loaded with."""
    import torch

    from workflows.config import load_config
    from workflows.storage.uri import StorageContext
    from workflows.tasks import get_task
    from workflows.train.standalone import TorchrunTrainer, find_dataset, local_input, read_rows
    from workflows.train.worker_setup import set_torch_threads, torchrun_device

    cfg = load_config("chat", config_sets(model_dir, work, gpu, sets))
    set_torch_threads(cfg.train)  # as standalone.train: one intra-op thread per CPU a worker is given
    storage = StorageContext.from_config(cfg.storage)
    data = find_dataset(cfg, storage, str(data_dir))
    task = get_task(cfg)
    device = torchrun_device(gpu)
    source, total = local_input(cfg, task, data, storage,
                                lambda split, limit: read_rows(data.files[split], storage, task.columns, limit))
    t0 = time.time()
    trainer = TorchrunTrainer(cfg, task, data, device, source, total, None)
    if amp is None:  # fp32: the base as loaded (on a GPU the chat task's prepare_model stores it in bf16)
        task.training.prepare_model = lambda model, device, probe_batches: None  # type: ignore[method-assign]
    trainer.build()
    trainer.amp = amp
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    history = trainer.fit()
    train_seconds = time.time() - started
    model = trainer.model
    batch = {k: v.to(device) for k, v in next(iter(source.val())).items()}
    return {"train_rows": total, "train_seconds": round(train_seconds, 3),
            "process_seconds": round(time.time() - t0, 1), "history": history,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),  # "highest": no TF32 in fp32
            "sdpa_calls_per_forward": count_sdpa(model, batch),
            "layers": int(model.config.num_hidden_layers),
            "trainable_params": sum(t.numel() for t in model.parameters() if t.requires_grad),
            "params": sum(t.numel() for t in model.parameters()),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None}


def mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def run_figures(summary: dict, path: str, precision: str, finetune: str) -> dict:
    """A run's figures from its summary: loss per epoch and per step, val loss, throughput, seconds."""
    h = summary["history"]
    steps = [x for e in h for x in e["step_losses"]]
    k = min(5, max(1, len(steps) // 4))  # the loss falls: the last steps' mean under the first steps'
    out = {"path": path, "precision": precision, "finetune": finetune, "epochs": len(h),
           "train_rows": summary["train_rows"], "steps": len(steps),
           "train_loss": [round(e["train_loss"], 4) for e in h], "val_loss": [round(e["val_loss"], 4) for e in h],
           "val_perplexity": round(h[-1]["val_perplexity"], 2), "val_exact_match": round(h[-1]["val_exact_match"], 4),
           "step_losses": [round(x, 4) for x in steps],
           "first_steps_loss": round(mean(steps[:k]), 4), "last_steps_loss": round(mean(steps[-k:]), 4),
           # the last epoch's: the first holds the first step's kernel selection and allocations
           "tokens_per_s": round(h[-1]["tokens_per_s"], 1), "samples_per_s": round(h[-1]["samples_per_s"], 1),
           "tokens_per_s_by_epoch": [round(e["tokens_per_s"], 1) for e in h],
           "epoch_seconds": [round(e["epoch_seconds"], 2) for e in h],
           "val_seconds": [round(e["val_seconds"], 2) for e in h],
           "train_seconds": summary["train_seconds"], "process_seconds": summary.get("process_seconds")}
    out["loss_falls"] = bool(out["last_steps_loss"] < out["first_steps_loss"]
                             and (len(h) < 2 or out["train_loss"][-1] < out["train_loss"][0]))
    return out


def step_chat(smoke: bool, emit, data: str | None) -> None:
    """LoRA fine-tuning of the chat config on SmolLM2-135M's architecture: the torchrun path in bf16, the
    same Trainer in fp32 from the same init, then a full fine-tune (torchrun, bf16) if time is left."""
    import torch

    from benchmarks.gpu.classify import local_copy
    from benchmarks.gpu.generate import ARCH_KEYS, SMOLLM2_135M, differences
    from workflows.tasks.chat.training.model import attn_implementation

    t_start = time.time()
    p = SIZES["smoke" if smoke else "full"]
    gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="gpu-chat-") as tmp:
        work = Path(tmp)
        prep = Path(data) if data else (smoke_prepare(work / "prep") if smoke else None)
        if prep is None or not (prep / CHAT_PREP / "manifest.json").exists() \
                or not (prep / SMOLLM2 / "tokenizer.json").exists():
            where = f"--prepared {prep}: no {CHAT_PREP}/manifest.json or {SMOLLM2}/tokenizer.json there" if prep \
                else "no prepared folder (.gpu-prep/ is absent)"
            raise UserError(f"chat: {where}; run `make bench-gpu-prepare` here and carry the folder it writes")
        tok = load_carried_tokenizer(prep / SMOLLM2)
        arch = dict(SMOLLM2_135M) if not smoke else {**SMOKE_ARCH, "vocab_size": len(tok)}
        t0 = time.time()
        model_dir = base_model(work / "base", arch, tok)
        processed = local_copy(prep / CHAT_PREP, work / "processed", str(model_dir))
        manifest = json.loads((processed / "manifest.json").read_text())
        out: dict[str, Any] = {
            "device": torch.cuda.get_device_name(0) if gpu else "cpu",
            "model": "SmolLM2-135M-Instruct architecture (LlamaForCausalLM)" if not smoke else "tiny Llama (smoke)",
            "weights": "random, seed 0 (the same init for every run)", "seed": SEED,
            "architecture": {k: arch.get(k) for k in ARCH_KEYS},
            "tokenizer": "SmolLM2-135M-Instruct's (from the packaged GGUF)" if not smoke
            else "byte-level BPE with a ChatML template (smoke)",
            "attn_implementation_chosen": attn_implementation(), "config": "chat",
            "train_settings": [*BASE_SETS, *p["sets"]], "data_counts": manifest["counts"],
            "data_dropped": manifest.get("info", {}).get("dropped"), "max_length": manifest.get("max_length"),
            "goal_val_loss_rel_delta": GOAL_VAL_LOSS_REL, "model_setup_s": round(time.time() - t0, 1), "runs": {}}
        if (prep / SMOLLM2 / "gguf_config.json").exists() and not smoke:
            gguf = json.loads((prep / SMOLLM2 / "gguf_config.json").read_text())
            out["architecture_vs_gguf"] = differences(gguf, arch) or "identical"
        out["tokenizer_check"] = tokenizer_check(processed, model_dir)
        emit(out)
        runs = out["runs"]

        summary = train_torchrun(processed, model_dir, work / "lora_bf16", p["sets"], gpu)
        runs["lora_bf16"] = run_figures(summary, "torchrun (workflows.train.standalone, one process)",
                                        "bf16 autocast" if gpu else "fp32 (no CUDA)", "lora")
        emit(out)

        fp32 = train_in_process(processed, model_dir, work / "lora_fp32", p["sets"], gpu, None)
        runs["lora_fp32"] = run_figures(fp32, "in process (standalone's local_input and TorchrunTrainer)", "fp32",
                                        "lora")
        out.update({k: fp32[k] for k in ("attn_implementation", "sdpa_calls_per_forward", "layers",
                                         "trainable_params", "params", "float32_matmul_precision")})
        runs["lora_fp32"]["peak_memory_gib"] = fp32["peak_memory_gib"]
        b, f = runs["lora_bf16"], runs["lora_fp32"]
        delta = (b["val_loss"][-1] - f["val_loss"][-1]) / f["val_loss"][-1]
        out["bf16_vs_fp32"] = {
            "val_loss_rel_delta": round(delta, 5),
            "train_loss_rel_delta": round((b["train_loss"][-1] - f["train_loss"][-1]) / f["train_loss"][-1], 5),
            "max_step_loss_abs_delta": round(max(abs(x - y) for x, y in zip(b["step_losses"], f["step_losses"])), 4),
            "tokens_per_s_ratio": round(b["tokens_per_s"] / f["tokens_per_s"], 3) if f["tokens_per_s"] else None}
        out["loss_falls"] = b["loss_falls"] and f["loss_falls"]
        out["goal_met"] = bool(abs(delta) <= GOAL_VAL_LOSS_REL and out["loss_falls"])
        emit(out)

        elapsed = time.time() - t_start
        full = [*p["sets"], "model.options.finetune=full"]
        if elapsed < p["full_after_s"] and p["full_torchrun"]:
            summary = train_torchrun(processed, model_dir, work / "full_bf16", full, gpu)
            runs["full_bf16"] = run_figures(summary, "torchrun (workflows.train.standalone, one process)",
                                            "bf16 autocast" if gpu else "fp32 (no CUDA)", "full")
        elif elapsed < p["full_after_s"]:
            summary = train_in_process(processed, model_dir, work / "full_bf16", full, gpu,
                                       torch.bfloat16 if gpu else None)
            runs["full_bf16"] = run_figures(summary, "in process (standalone's local_input and TorchrunTrainer)",
                                            "bf16 autocast" if gpu else "fp32 (no CUDA)", "full")
        else:
            runs["full_bf16"] = {"skipped": f"{elapsed:.0f} s into the step, past {p['full_after_s']:g} s"}
        emit(out)


def smoke_prepare(dst: Path) -> Path:
    """A toy prepared folder, as `prepare` and the generate step lay it out: a byte-level BPE tokenizer with
    a ChatML template (eos = pad = <|im_end|>) in smollm2/, a few dozen of the synthetic instruction rows
    encoded by the chat task's own encode_batch (no Ray) in chat-processed/."""
    import pandas as pd
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from workflows.preprocess import chat_data
    from workflows.tasks.chat.training.data import encode_batch, stored_rows, tokenizer_identity
    from workflows.tasks.chat.training.model import pad_id

    rows = chat_data.build(16)
    texts = [m["content"] for r in rows for m in r["messages"]] + ["user", "assistant", "system"]
    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  bos_token="<|im_start|>")
    tok.chat_template = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                         "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tok_dir = dst / SMOLLM2
    tok.save_pretrained(tok_dir)
    frame = encode_batch(pd.DataFrame({"messages": [r["messages"] for r in rows]}), str(tok_dir), 128, None, 0,
                         0.2, 0.2)
    frame = stored_rows(frame)
    processed = dst / CHAT_PREP
    counts = {}
    for split in ("train", "val", "test"):
        part = frame[frame["split"] == split].drop(columns=["split"])
        counts[split] = len(part)
        (processed / f"split={split}").mkdir(parents=True)
        part.to_parquet(processed / f"split={split}" / "part-0.parquet")
    manifest = {"uri": str(processed), "version": "smoke", "labels": [], "label_column": "answer",
                "files": {s: [f"split={s}/part-0.parquet"] for s in counts}, "counts": counts, "label_counts": {},
                "source": "smoke",
                "task": "chat", "tokenizer": "smoke", "max_length": 128,
                "info": {"model": "tiny (smoke)", "tokenizer": tokenizer_identity(str(tok_dir)), "pad_id": pad_id(tok),
                         "eos_id": tok.eos_token_id, "dropped": {"too_long": 0, "invalid": 0}}}
    (processed / "manifest.json").write_text(json.dumps(manifest))
    return dst


def prepare(out: Path) -> dict:
    """`out`/chat-processed: the real `workflows preprocess --config chat` (Ray, a fresh embedded store and
    model cache in a temp folder), checked against `out`/smollm2's tokenizer (written first if absent)."""
    from benchmarks.gpu.classify import preprocessed_copy
    from benchmarks.gpu.generate import prepare as prepare_generate

    out = out.resolve()
    if not (out / SMOLLM2 / "tokenizer.json").exists():
        prepare_generate(out / SMOLLM2)
    with tempfile.TemporaryDirectory(prefix="gpu-prepare-chat-") as tmp:
        staged = Path(tmp) / CHAT_PREP
        preprocessed_copy("chat", Path(tmp), staged)
        check = tokenizer_check(staged, out / SMOLLM2)
        if check["identical"] != check["rows"]:
            raise UserError(f"{out / SMOLLM2}'s tokenizer encodes {check['rows'] - check['identical']} of "
                            f"{check['rows']} preprocessed chat rows differently (the first: "
                            f"{check.get('first_difference')}); rerun `make bench-gpu-prepare`")
        shutil.rmtree(out / CHAT_PREP, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), str(out / CHAT_PREP))
    manifest = json.loads((out / CHAT_PREP / "manifest.json").read_text())
    return {"counts": manifest["counts"], "dropped": manifest.get("info", {}).get("dropped"), "check": check}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.gpu.classify import prepare_main

    def done(out: Path, info: dict) -> str:
        return (f"{out / CHAT_PREP} written: rows {info['counts']}, dropped {info['dropped']}; the carried tokenizer "
                f"re-encodes {info['check']['identical']}/{info['check']['rows']} rows identically")

    return prepare_main("benchmarks.gpu.chat", "bench gpu prepare chat", prepare, done, argv)


if __name__ == "__main__":
    raise SystemExit(main())

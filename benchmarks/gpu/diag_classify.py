"""Why the classify step trains badly on the GPU: one process, the torchrun path's own parts (local_input,
TorchrunTrainer, validate) on `.gpu-prep/`, without torchrun.

    PYTHONPATH=. python -m benchmarks.gpu.diag_classify --prepared .gpu-prep --out DIR [--budget S] [--no-train]

First forward checks on the freshly built model (no training): the logits of two validation batches
under fp32, bf16 autocast and bf16 weights, with SDPA and eager attention (and, on CUDA, each SDPA
backend alone), against fp32 eager; a padded row against the same row alone; what SDPA is handed
(mask dtype and range, is_causal). Then the training run under each setting (current: bf16 autocast
around the whole fit, SDPA, as before the fix), fp32, the fix (autocast around each forward), and the
outer context without its cast cache: each one's loss curve, val F1 as trained and re-validated in fp32
and per-forward bf16. Writes
diag-classify.json in DIR after each part.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

T0 = time.time()


def sdpa_probe(record: dict):
    """torch's SDPA wrapped: the first call's arguments (dtypes, mask range, is_causal) into `record`."""
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention

    def wrapped(q, k, v, attn_mask=None, *args, **kwargs):
        if not record:
            record.update(q_dtype=str(q.dtype), q_shape=list(q.shape), is_causal=kwargs.get("is_causal"),
                          mask_dtype=None if attn_mask is None else str(attn_mask.dtype),
                          mask_shape=None if attn_mask is None else list(attn_mask.shape))
            if attn_mask is not None and attn_mask.dtype != torch.bool:
                record.update(mask_min=float(attn_mask.min()), mask_max=float(attn_mask.max()),
                              mask_has_inf=bool(torch.isinf(attn_mask).any()))
            elif attn_mask is not None:
                record.update(mask_true_share=float(attn_mask.float().mean()))
        return orig(q, k, v, attn_mask, *args, **kwargs)

    return orig, wrapped


def set_attn(model, impl: str) -> None:
    try:
        model.set_attn_implementation(impl)
    except Exception as e:  # older transformers: the config's attribute
        print(f"diag: set_attn_implementation({impl}): {e!r}; setting config._attn_implementation", flush=True)
        model.config._attn_implementation = impl


def backends(name: str | None):
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name)])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepared", default=".gpu-prep")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=110.0, help="no training run starts after this many seconds")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--variants", default="")
    ap.add_argument("--sets", action="append", default=[])
    a = ap.parse_args()

    import transformers

    from benchmarks.gpu.classify import TRAIN_SETS, convert_model, local_copy
    from workflows.config import load_config
    from workflows.storage.uri import StorageContext
    from workflows.tasks import get_task
    from workflows.train.loop import validate
    from workflows.train.standalone import TorchrunTrainer, find_dataset, local_input, read_rows

    out_path = Path(a.out) / "diag-classify.json"
    Path(a.out).mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    res: dict = {"env": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "device": torch.cuda.get_device_name(0) if gpu else "cpu"},
                 "checks": {}, "variants": {}}

    def emit(msg: str = "") -> None:
        res["elapsed_s"] = round(time.time() - T0, 1)
        out_path.write_text(json.dumps(res, indent=1, default=str))
        if msg:
            print(f"diag [{res['elapsed_s']}s] {msg}", flush=True)

    prep = Path(a.prepared)
    work = Path(tempfile.mkdtemp(prefix="diag-classify-"))
    model_dir = work / "minilm"
    convert_model(prep / "minilm-bf16", model_dir, "float32")
    processed = local_copy(prep / "processed", work / "processed", str(model_dir))
    cpu = json.loads((prep / "cpu.json").read_text())
    sets = [*TRAIN_SETS, *cpu.get("sets", []), *a.sets, f"model.name_or_path={model_dir}",
            f"preprocess.tokenizer={model_dir}", f"train.use_gpu={str(gpu).lower()}", f"output_dir={work}/runs"]
    cfg = load_config("quickstart", sets)
    storage = StorageContext.from_config(cfg.storage)
    data = find_dataset(cfg, storage, str(processed))
    task = get_task(cfg)
    source, total = local_input(cfg, task, data, storage,
                                lambda split, limit: read_rows(data.files[split], storage, task.columns, limit))
    res["cpu_f1"] = cpu["f1"]
    res["labels"] = list(data.labels)
    emit("data read")

    # --- forward checks on the built model (seeded: the one training starts from)
    trainer = TorchrunTrainer(cfg, task, data, device, source, total, None)
    trainer.build()
    model = trainer.model.eval()
    res["optimizer_groups"] = [{"params": len(g["params"]), "lr": g["lr"], "weight_decay": g["weight_decay"],
                                "numel": sum(p.numel() for p in g["params"])} for g in trainer.optimizer.param_groups]
    res["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    val = [{k: v.to(device) for k, v in b.items()} for _, b in zip(range(2), source.val())]

    def amp():
        return torch.autocast(device.type, torch.bfloat16)

    none = contextlib.nullcontext
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)

    feats: list = []

    def logits(m, batch, ctx, impl, backend=None):
        """The logits, with the head's input (the pooled features) appended to `feats`."""
        set_attn(m, impl)
        hook = m.classifier.register_forward_hook(lambda _m, i, _o: feats.append(i[0].detach().float()))
        try:
            with torch.no_grad(), ctx(), backends(backend):
                return m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        finally:
            hook.remove()

    ref = [logits(model, b, none, "eager") for b in val]
    ref_feats = list(feats)
    modes: list[tuple] = [("fp32_sdpa", model, none, "sdpa", None), ("autocast_sdpa", model, amp, "sdpa", None),
             ("autocast_eager", model, amp, "eager", None), ("bf16w_sdpa", bf16_model, none, "sdpa", None),
             ("bf16w_eager", bf16_model, none, "eager", None)]
    if gpu:
        modes += [(f"autocast_sdpa_{b.lower()}", model, amp, "sdpa", b)
                  for b in ("MATH", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "FLASH_ATTENTION")]
        modes += [("fp32_sdpa_efficient_attention", model, none, "sdpa", "EFFICIENT_ATTENTION")]
    import torch.nn.functional as F
    for name, m, ctx, impl, backend in modes:
        record: dict = {}
        orig, wrapped = sdpa_probe(record)
        F.scaled_dot_product_attention = wrapped
        try:
            feats.clear()
            got = [logits(m, b, ctx, impl, backend) for b in val]
            rel = max(float((f - r).norm() / r.norm()) for f, r in zip(feats, ref_feats))
            diff = max(float((g - r).abs().max()) for g, r in zip(got, ref))
            agree = sum(int((g.argmax(-1) == r.argmax(-1)).sum()) for g, r in zip(got, ref))
            # the batch's shortest row alone (no padding) against its padded self
            b = val[0]
            lens = b["attention_mask"].sum(-1)
            i = int(lens.argmin())
            n = int(lens[i])
            alone = logits(m, {"input_ids": b["input_ids"][i:i + 1, :n],
                               "attention_mask": b["attention_mask"][i:i + 1, :n]}, ctx, impl, backend)
            pad_diff = float((alone[0] - got[0][i]).abs().max())
            res["checks"][name] = {"features_rel_diff_vs_fp32_eager": round(rel, 5),
                                   "max_abs_diff_vs_fp32_eager": round(diff, 5),
                                   "argmax_agree": f"{agree}/{sum(len(r) for r in ref)}",
                                   "padded_vs_alone_max_diff": round(pad_diff, 5),
                                   "row_len": n, "batch_width": int(b["attention_mask"].shape[1]), "sdpa": record}
        except Exception as e:
            res["checks"][name] = {"error": repr(e)[:300]}
        finally:
            F.scaled_dot_product_attention = orig
        emit(f"check {name}: {res['checks'][name]}")
    set_attn(model, "sdpa")
    del bf16_model
    if a.no_train:
        return 0

    # --- training runs: "outer" is how standalone.train ran before the fix (one bf16 autocast context
    # around trainer.fit); "per_forward" is the fix (Trainer.amp: autocast around each forward)
    import workflows.train.loop as loop

    variants = {"outer_autocast_sdpa": ("outer", "sdpa"), "fp32_sdpa": ("fp32", "sdpa"),
                "per_forward_autocast_sdpa": ("per_forward", "sdpa"),
                "outer_autocast_nocache_sdpa": ("outer_nocache", "sdpa"),
                "outer_autocast_eager": ("outer", "eager")}
    chosen = [v for v in a.variants.split(",") if v] or list(variants)
    check = loop.check_no_outer_autocast
    for name in chosen:
        if time.time() - T0 > a.budget:
            res["variants"][name] = "skipped: out of time"
            emit(f"{name} skipped")
            continue
        mode, impl = variants[name]
        t = time.time()
        trainer = TorchrunTrainer(cfg, task, data, device, source, total, None)
        trainer.build()
        set_attn(trainer.model, impl)
        outer = {"outer": lambda: torch.autocast(device.type, torch.bfloat16),
                 "outer_nocache": lambda: torch.autocast(device.type, torch.bfloat16, cache_enabled=False)}
        trainer.amp = torch.bfloat16 if mode == "per_forward" else None
        loop.check_no_outer_autocast = (lambda _d: None) if mode in outer else check  # type: ignore[assignment]
        try:
            with outer[mode]() if mode in outer else none():
                h = trainer.fit()[-1]
        finally:
            loop.check_no_outer_autocast = check
        fp32_val = validate(task, trainer.model, source.val(), device, data)
        amp_val = validate(task, trainer.model, source.val(), device, data, torch.bfloat16)
        losses = h["step_losses"]
        res["variants"][name] = {
            "mode": mode, "attn": impl, "train_loss": round(h["train_loss"], 4),
            "val_f1_as_trained": round(h["val_f1"], 4), "val_loss_as_trained": round(h["val_loss"], 4),
            "val_f1_fp32_eval": round(fp32_val["val_f1"], 4),
            "val_f1_bf16_per_forward_eval": round(amp_val["val_f1"], 4),
            "steps": h["steps"], "lr_end": h["lr"], "samples_per_s": round(h["samples_per_s"], 1),
            "loss_curve": [round(x, 3) for x in losses[::4]] + [round(losses[-1], 3)],
            "seconds": round(time.time() - t, 1)}
        emit(f"variant {name}: {res['variants'][name]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

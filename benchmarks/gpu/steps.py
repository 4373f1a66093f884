"""The steps of the GPU measurement (benchmarks.gpu.measure runs each in its own process, with its own
time limit). Each step calls `emit(fields)` whenever a part is measured: the result file is
rewritten then, so a step stopped at its limit keeps what it had measured.

    python -m benchmarks.gpu.steps STEP --out FILE [--smoke] [--data DIR]

The GPU machine has no Ray, pydantic or s3fs of its own: run.sh puts the Ray site it unpacks from .gpu-carry/ on
PYTHONPATH (benchmarks/gpu/README.md), which brings the pipeline step its Ray and every step that loads a config
its pydantic; no step needs s3fs (local storage only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from workflows.errors import UserError
from workflows.storage.atomic import atomic_write

Emit = Callable[[dict], None]
GOAL_MFU_PLAIN = 0.40  # issue #62: GPT-2 124M on one H100/H200, plain (no FSDP); fsdp_vs_plain >= 0.95

# Full size on a GPU; SMOKE: every step at toy size on the CPU, to show the path runs end to end
Sizes = dict[str, dict[str, Any]]  # "full"/"smoke" -> the step's settings
# micro-batch 32: 16 filled 15.8 of an H200's 141 GiB (2026-11-28), a small share of its compute per launch
LM: Sizes = {"full": dict(size="gpt2-124m", seq_len=1024, micro_batch=32, steps=20, warmup=5, compile="inductor"),
             "smoke": dict(size="tiny", seq_len=64, micro_batch=2, steps=2, warmup=1, compile="eager")}
RESNET: Sizes = {"full": dict(arch="resnet50", size=224, batch=256, steps=30, warmup=8, compile="inductor",
                              shard_mb=400, loader_steps=30),
                 "smoke": dict(arch="small_cnn", size=32, batch=4, steps=2, warmup=1, compile="eager",
                               shard_mb=0.4, loader_steps=2)}


def device_name(torch) -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def step_lm(smoke: bool, emit: Emit, data: str | None) -> None:
    """GPT-2 124M, seq 1024, bf16, torch.compile per block, fused AdamW: plain, then FSDP2 on one device."""
    import torch

    from workflows.bench.lm import worker

    p = LM["smoke" if smoke else "full"]
    runs: dict[str, dict] = {}
    for strategy in ("plain", "fsdp"):
        args = argparse.Namespace(size=p["size"], seq_len=p["seq_len"], micro_batch=p["micro_batch"], steps=p["steps"],
                                  warmup=p["warmup"], vocab=50257, activation_checkpointing=False,
                                  strategy=strategy, compile=p["compile"], fused_adamw=True)
        torch._dynamo.reset()  # the second run compiles its own blocks, as a fresh process would
        counters = torch._dynamo.utils.counters
        counters.clear()
        runs[strategy] = worker(args)
        # graphs compiled: a few when the 12 blocks share one; many means recompiles (or eager fallback)
        runs[strategy]["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
        fsdp, plain = runs.get("fsdp"), runs["plain"]
        emit({
            "device": plain["device"], "goal_mfu": GOAL_MFU_PLAIN, "goal_fsdp_vs_plain": 0.95,
            "size": p["size"], "params": plain["params"], "seq_len": p["seq_len"], "micro_batch": p["micro_batch"],
            "compile": p["compile"], "fused_adamw": True,
            "runs": {k: {f: r[f] for f in ("strategy", "precision", "tokens_per_s", "mfu", "steps", "seconds",
                                          "achieved_tflops_per_device", "peak_memory_gib", "last_loss",
                                          "compiled_graphs")}
                     for k, r in runs.items()},
            "tokens_per_s": fsdp["tokens_per_s"] if fsdp else None,
            "mfu": fsdp["mfu"] if fsdp else None,
            "mfu_plain": plain["mfu"],  # the goal's (GOAL_MFU_PLAIN)
            "peak_bf16_tflops": plain["peak_bf16_tflops_per_device"],
            "fsdp_vs_plain": round(fsdp["tokens_per_s"] / plain["tokens_per_s"], 3) if fsdp else None,
        })


def _image_model(arch: str, size: int, device, torch):
    from transformers import AutoModelForImageClassification

    from workflows.tasks.image.models import ARCHITECTURES

    config: Any = ARCHITECTURES[arch](size)  # a transformers PretrainedConfig
    config.num_labels = 100
    torch.manual_seed(0)
    return AutoModelForImageClassification.from_config(config).to(device, memory_format=torch.channels_last)


def step_resnet(smoke: bool, emit: Emit, data: str | None) -> None:
    """ResNet-50 training images/s through the training loop (loop.train_epoch) with bf16 autocast,
    channels_last and torch.compile: synthetic tensors in device memory (compute only), then batches
    from the platform's StreamLoader over local tar shards, decoded in worker processes."""
    import tempfile

    import torch

    from workflows.loader import StreamLoader
    from workflows.preprocess.images import ImageTransform, normalize_pixels
    from workflows.preprocess.synth_images import SynthSpec, synth_images
    from workflows.storage.cache import ShardCache
    from workflows.storage.uri import StorageContext
    from workflows.train.compile import compile_model
    from workflows.train.loop import make_optimizer, make_scheduler, train_epoch

    p = RESNET["smoke" if smoke else "full"]
    if data is not None and not os.path.exists(os.path.join(data, "index.json")):
        raise UserError(f"resnet: --shards {data}: no index.json there (a folder `workflows data synth-images` wrote)")
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    torch.backends.cudnn.benchmark = True
    model = _image_model(p["arch"], p["size"], device, torch)
    params = sum(t.numel() for t in model.parameters())
    compile_model(model, p["compile"])  # as train.compile does: the whole model (its stages differ in shape)
    optimizer = make_optimizer(model, 1e-3, 0.05, fused=True)
    scheduler = make_scheduler(optimizer, 10**6, 0.0)
    amp = torch.bfloat16 if gpu else None  # around each forward (loop.autocast); bf16 matmuls are slow on CPU
    b, s = p["batch"], p["size"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, 3, s, s, generator=g).to(device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 100, (b,), generator=g).to(device)
    synthetic = lambda n: ({"pixel_values": x, "labels": y} for _ in range(n))  # noqa: E731
    out = {"device": device_name(torch), "arch": p["arch"], "params": params, "image_size": s, "batch": b,
           "precision": "bf16 autocast" if gpu else "fp32", "channels_last": True, "compile": p["compile"],
           "goal_compute_images_per_s": 3000, "goal_loader_vs_compute": 0.9, "cpus": os.cpu_count()}
    train_epoch(model, synthetic(p["warmup"]), optimizer, scheduler, device, amp=amp)
    compute = train_epoch(model, synthetic(p["steps"]), optimizer, scheduler, device, amp=amp)
    out["compute_images_per_s"] = round(compute["samples_per_s"], 1)
    out["compute_steps"] = compute["steps"]
    emit(out)

    with tempfile.TemporaryDirectory(prefix="gpu-bench-shards-") as tmp:
        ctx = StorageContext()
        shards = data or os.path.join(tmp, "shards")
        t0 = time.perf_counter()
        if not os.path.exists(os.path.join(shards, "index.json")):
            spec = SynthSpec(classes=100, shard_bytes=max(200_000, int(min(p["shard_mb"], 64) * 1e6)))
            synth_images(shards, int(p["shard_mb"] * 1e6), ctx, spec)
        out["shards_seconds"] = round(time.perf_counter() - t0, 1)
        workers = max(1, (os.cpu_count() or 2) - 1)  # one core stays with the training process
        # pinned batches (the DataLoader's thread) for the copy to the GPU, as train.loader=stream hands them
        loader = StreamLoader(shards, ctx, ShardCache(os.path.join(tmp, "cache"), ctx), ImageTransform(s, seed=0),
                              batch_size=b, num_workers=workers, seed=0, pin_memory=gpu)
        out.update(loader_images=len(loader.index), loader_workers=workers)

        def fed(n: int):
            done, epoch = 0, 0
            while done < n:  # the shards again (another epoch) until n steps are fed
                loader.set_epoch(epoch)
                for batch in loader:
                    if done == n:
                        return
                    # the loader's batch is channels_last, as the synthetic one: the compiled graph's strides
                    images = batch["image"].to(device, non_blocking=True)
                    yield {"pixel_values": normalize_pixels(images), "labels": batch["label"].to(device)}
                    done += 1
                epoch += 1

        try:
            # the loader alone: how fast decoding feeds, the ceiling of the loader-fed figure
            t0, seen = time.perf_counter(), 0
            for batch in fed(p["loader_steps"]):
                seen += len(batch["labels"])
            out["decode_images_per_s"] = round(seen / (time.perf_counter() - t0), 1)
            emit(out)
            graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            # an epoch's short last batch padded to the compiled shape (train.compile's pad_to)
            fed_stats = train_epoch(model, fed(p["loader_steps"]), optimizer, scheduler, device, amp=amp, pad_to=b)
            out["recompiles_in_timed_phase"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - graphs
        finally:
            loader.close()
    out["loader_images_per_s"] = round(fed_stats["samples_per_s"], 1)
    out["loader_data_wait_fraction"] = round(fed_stats["data_wait_seconds"] / max(fed_stats["epoch_seconds"], 1e-9), 3)
    out["loader_vs_compute"] = round(out["loader_images_per_s"] / out["compute_images_per_s"], 3)
    ceiling = min(out["compute_images_per_s"], out["decode_images_per_s"])
    out["loader_vs_ceiling"] = round(out["loader_images_per_s"] / ceiling, 3)  # goal: >= 0.9 x min(compute, decode)
    out["goal_loader_vs_ceiling"] = 0.9
    emit(out)


def step_classify(smoke: bool, emit: Emit, data: str | None) -> None:
    """The quickstart model on the torchrun path in bf16, then the Predictor (benchmarks.gpu.classify)."""
    from benchmarks.gpu.classify import step_classify as run

    run(smoke, emit, data)


def step_generate(smoke: bool, emit: Emit, data: str | None) -> None:
    """The chat engine (continuous batching) on SmolLM2-135M's architecture in bf16, against static batching
    (benchmarks.gpu.generate)."""
    from benchmarks.gpu.generate import step_generate as run

    run(smoke, emit, data)


def step_chat(smoke: bool, emit: Emit, data: str | None) -> None:
    """The chat config's LoRA fine-tuning on SmolLM2-135M's architecture: the torchrun path in bf16 against
    the same Trainer in fp32, then a full fine-tune (benchmarks.gpu.chat)."""
    from benchmarks.gpu.chat import step_chat as run

    run(smoke, emit, data)


def step_pipeline(smoke: bool, emit: Emit, data: str | None) -> None:
    """`workflows pipeline` through Ray Train for the quickstart, digits and chat configs, against the CPU
    figures and the torchrun path (benchmarks.gpu.pipeline)."""
    from benchmarks.gpu.pipeline import step_pipeline as run

    run(smoke, emit, data)


STEPS: dict[str, Callable[[bool, Emit, str | None], None]] = {"pipeline": step_pipeline, "lm": step_lm,
                                                               "resnet": step_resnet,
                                                               "classify": step_classify, "generate": step_generate,
                                                               "chat": step_chat}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.steps")
    ap.add_argument("step", choices=sorted(STEPS))
    ap.add_argument("--out", required=True, help="the step's JSON, rewritten as its parts complete")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--data", help="the step's prepared input (resnet: a shard directory with index.json; "
                    "classify, generate, chat: the folder `make bench-gpu-prepare` wrote)")
    a = ap.parse_args(argv)
    record: dict = {}

    def emit(fields: dict) -> None:
        record.update(fields)
        atomic_write(a.out, json.dumps(record, indent=2, sort_keys=True))

    try:
        STEPS[a.step](a.smoke, emit, a.data)
    except UserError as e:  # bad input: one line, no traceback
        print(f"bench gpu: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

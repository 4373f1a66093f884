"""Causal-LM pretraining throughput: tokens/s and MFU of a GPT-2-class model under FSDP2, no Ray.

    workflows bench lm                       # every GPU of this machine via torchrun, else a CPU run
    torchrun --nproc_per_node=N -m workflows.bench.lm --size gpt2-124m --seq-len 1024 --micro-batch 16

Each rank runs loop.train_epoch (the training loop of every other path: FSDP2 `fully_shard` per
block, bf16 MixedPrecisionPolicy on GPU, AdamW, clipping, warmup) over random token blocks: the
subject is the model step, not the input pipeline, so the data costs nothing here. The first
`--warmup` steps (allocator, kernels' autotuning) are excluded from the measured steps.
MFU = tokens/s x flops/token (6N + 12·L·h·s) / (devices x the device's dense bf16 peak).
Without Ray it runs on any GPU machine (Ray's wheel need not be installed there) and measures
the loop alone; `workflows bench train` measures what Ray Train adds on top.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from workflows.storage.atomic import atomic_write

GOAL_MFU = 0.50
GPU_DEFAULTS = {"size": "gpt2-124m", "seq_len": 1024, "micro_batch": 16, "steps": 30, "warmup": 5}
# No GPU: a size a 2-core machine steps through in a minute, to show the path runs end to end
CPU_DEFAULTS = {"size": "small", "seq_len": 256, "micro_batch": 4, "steps": 10, "warmup": 2}


def synthetic_blocks(steps: int, micro_batch: int, seq_len: int, vocab: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=g)
        yield {"input_ids": ids, "labels": ids.clone()}  # no padding: no mask (lm_collate's batches)


def worker(args: argparse.Namespace) -> dict:
    """One rank: build, shard and step the model; the measured figures (the same on every rank)."""
    import torch
    import torch.distributed as dist

    from workflows.parallel import parallelize, world
    from workflows.tasks.causal_lm.model import build_causal_lm, flops_per_token, mfu, model_shape, peak_flops
    from workflows.tasks.causal_lm.options import SIZES
    from workflows.train.compile import compile_model
    from workflows.train.loop import make_optimizer, make_scheduler, train_epoch
    from workflows.train.worker_setup import join_torchrun_group, torchrun_device

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = torch.cuda.is_available()
    join_torchrun_group(gpu)
    if args.strategy == "fsdp" and not dist.is_initialized():
        # FSDP2 on one device: a one-rank group (parallelize leaves a lone process's model plain)
        dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    if args.strategy == "plain" and world_size > 1:
        raise SystemExit("bench lm: --strategy plain is one device's baseline; run it without torchrun")
    rank, _ = world()
    device = torchrun_device(gpu)
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    lm_cfg = SimpleNamespace(size=args.size, n_layer=None, n_embd=None, n_head=None, seq_len=args.seq_len)
    torch.manual_seed(0)
    model = build_causal_lm(lm_cfg, args.vocab)
    if args.activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # as train.compile does (train/compile.py): per block, before sharding (regional compilation: the
    # blocks share one compiled graph; dynamo leaves FSDP2's hooks out of it), and the loss over the head
    if args.compile != "none":
        compile_model(model, args.compile)
    # "ddp" on one process is the plain model (parallelize)
    model = parallelize(model, "fsdp" if args.strategy == "fsdp" else "ddp", device)
    optimizer = make_optimizer(model, 3e-4, 0.1, fused=args.fused_adamw or None)
    scheduler = make_scheduler(optimizer, args.warmup + args.steps, 0.05)
    params, layers, hidden = model_shape(model)

    data = lambda n, seed: synthetic_blocks(n, args.micro_batch, args.seq_len, args.vocab, seed + rank)  # noqa: E731
    # plain on GPU: bf16 autocast over fp32 weights around each forward (loop.autocast), the precision
    # FSDP2's policy gives the sharded run
    amp = torch.bfloat16 if gpu and args.strategy == "plain" else None
    warm = train_epoch(model, data(args.warmup, 1000), optimizer, scheduler, device, 1.0, amp=amp)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    stats = train_epoch(model, data(args.steps, 0), optimizer, scheduler, device, 1.0, amp=amp)  # ends on .item()
    peak, device_name = peak_flops(device)
    fpt = flops_per_token(params, layers, hidden, args.seq_len)
    tokens_per_s = stats["tokens_per_s"]
    result = {
        "device": device_name,
        "device_type": device.type,
        "world_size": world_size,
        "size": args.size,
        "shape": dict(zip(("n_layer", "n_embd", "n_head"), SIZES[args.size])),
        "params": params,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "global_batch_tokens": args.micro_batch * args.seq_len * world_size,
        "precision": ("fp32" if not gpu else "bf16 (FSDP2 MixedPrecisionPolicy)" if args.strategy == "fsdp"
                      else "bf16 autocast"),
        "strategy": args.strategy,
        "compile": args.compile,
        "fused_adamw": args.fused_adamw,
        "activation_checkpointing": args.activation_checkpointing,
        "warmup_steps": args.warmup,
        "steps": stats["steps"],
        "seconds": round(stats["epoch_seconds"], 3),
        "tokens_per_s": round(tokens_per_s, 1),
        "tokens_per_s_per_device": round(tokens_per_s / world_size, 1),
        "flops_per_token": fpt,
        "achieved_tflops_per_device": round(tokens_per_s * fpt / world_size / 1e12, 3),
        "peak_bf16_tflops_per_device": peak / 1e12 if peak else None,
        "mfu": round(m, 4) if peak and (m := mfu(tokens_per_s, params, layers, hidden, args.seq_len, world_size,
                                                   device)) is not None else None,
        "first_loss": warm["step_losses"][0] if warm["step_losses"] else stats["step_losses"][0],
        "last_loss": stats["step_losses"][-1],
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if gpu else None,
        "torch": torch.__version__,
    }
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from workflows.tasks.causal_lm.options import SIZES

    d = GPU_DEFAULTS
    p = argparse.ArgumentParser(prog="python -m workflows.bench.lm", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default=d["size"], choices=sorted(SIZES))
    p.add_argument("--seq-len", type=int, default=d["seq_len"])
    p.add_argument("--micro-batch", type=int, default=d["micro_batch"], help="sequences per device and step")
    p.add_argument("--steps", type=int, default=d["steps"], help="measured steps")
    p.add_argument("--warmup", type=int, default=d["warmup"], help="steps before measuring")
    p.add_argument("--vocab", type=int, default=50257, help="GPT-2's vocabulary")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--strategy", choices=["fsdp", "plain"], default="fsdp",
                   help="plain: one device without FSDP (bf16 autocast on GPU), the baseline of FSDP's overhead")
    p.add_argument("--compile", choices=["none", "inductor", "eager"], default="none",
                   help="torch.compile each transformer block (eager: tracing only, for CPU smoke runs)")
    p.add_argument("--fused-adamw", action="store_true", help="AdamW's fused kernel")
    p.add_argument("--output", help="write the result JSON here (rank 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = worker(args)
    if int(os.environ.get("RANK", "0")) == 0:
        line = (
            f"bench lm: {result['size']} ({result['params'] / 1e6:.0f}M) seq {result['seq_len']}"
            f" x {result['micro_batch']}"
            f" on {result['world_size']} x {result['device']}: {result['tokens_per_s']:.0f} tokens/s, "
            f"{result['achieved_tflops_per_device']:.1f} TFLOP/s per device, MFU "
            + (f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a (no GPU bf16 peak)")
        )
        print(line, flush=True)
        if args.output:
            atomic_write(args.output, json.dumps(result, indent=2))
    return 0


def run(config: str | None, overrides: list[str]) -> dict:
    """`workflows bench lm`: every local GPU through torchrun; with none, a small CPU run that says so.
    `--set size=gpt2-350m --set micro_batch=8 ...` changes the run's arguments."""
    import torch

    gpus = torch.cuda.device_count()
    defaults = dict(GPU_DEFAULTS if gpus else CPU_DEFAULTS)
    from workflows.errors import UserError
    from workflows.tasks.causal_lm.options import SIZES

    for item in overrides:
        key, _, value = item.partition("=")
        if key not in defaults:
            raise UserError(f"bench lm: unknown setting {key!r}; use {', '.join(defaults)}")
        if key == "size" and value not in SIZES:
            raise UserError(f"bench lm: size {value!r} is not one of {', '.join(SIZES)}")
        if key != "size" and not (value.isdigit() and int(value) > 0):
            raise UserError(f"bench lm: {key} must be a positive integer, got {value!r}")
        defaults[key] = value if key == "size" else int(value)
    procs = max(gpus, 1)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "lm.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={procs}",
            "-m",
            "workflows.bench.lm",
            "--size",
            str(defaults["size"]),
            "--seq-len",
            str(defaults["seq_len"]),
            "--micro-batch",
            str(defaults["micro_batch"]),
            "--steps",
            str(defaults["steps"]),
            "--warmup",
            str(defaults["warmup"]),
            "--output",
            out,
        ]
        t0 = time.time()
        subprocess.run(cmd, check=True)
        result = json.loads(Path(out).read_text())
    result["wall_seconds"] = round(time.time() - t0, 1)
    result["torchrun_command"] = "torchrun " + " ".join(cmd[3:-2])
    result["gpu_available"] = bool(gpus)
    result["goal_mfu"] = GOAL_MFU
    result["meets_goal"] = result["mfu"] is not None and result["mfu"] >= GOAL_MFU
    return result


if __name__ == "__main__":
    from workflows.parallel import exit_rank

    exit_rank(main())

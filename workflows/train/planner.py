"""Memory planner: per-device training memory for DDP and FSDP2, the largest micro-batch that fits,
and the strategy to use (`workflows plan`). The estimate and its derivation are in
workflows/train/memory_estimate.py; what it reads from a model, in workflows/tasks/model_spec.py.

Recommendation: DDP when it fits (one all-reduce of the gradients per step; FSDP moves ~1.5x those
bytes: two all-gathers of the parameters and a reduce-scatter), FSDP otherwise.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from workflows.errors import UserError
from workflows.tasks import get_task
from workflows.tasks.model_spec import ModelSpec
from workflows.train.memory_estimate import (
    ATTENTIONS,
    FRAGMENTATION_MARGIN,
    PRECISIONS,
    RESERVED_BYTES,
    STRATEGIES,
    Estimate,
    GiB,
    estimate,
    max_micro_batch,
    usable_bytes,
)

DEFAULT_DEVICE_MEMORY = "80GiB"


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """'80GiB', '80GB' (10^9), '81920MiB', '1.5TiB', or a number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise UserError(f"invalid memory size {text!r}: use e.g. 80GiB, 40GB, 24576MiB or a number of bytes")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"invalid memory size {text!r}: must be positive")
    return value


def detected_device_memory() -> int | None:
    """Total memory of this machine's first CUDA device, if any."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # noqa: BLE001 - no usable CUDA: fall back to the stated assumption
        pass
    return None


@dataclass
class Plan:
    spec: ModelSpec
    device_memory: int
    device_memory_source: str
    devices: int
    seq_len: int
    micro_batch: int
    device_type: str
    attention: str
    checkpointing: bool
    precisions: dict[str, str]
    estimates: dict[str, Estimate]
    max_micro_batch: dict[str, int]
    recommended: str | None
    reason: str
    config_strategy: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def usable(self) -> int:
        return usable_bytes(self.device_memory)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": asdict(self.spec),
            "inputs": {
                "devices": self.devices,
                "seq_len": self.seq_len,
                "micro_batch": self.micro_batch,
                "device_type": self.device_type,
                "attention": self.attention,
                "activation_checkpointing": self.checkpointing,
                "precision": self.precisions,
                "device_memory": self.device_memory,
                "device_memory_source": self.device_memory_source,
            },
            "margin": {
                "fragmentation_fraction": FRAGMENTATION_MARGIN,
                "reserved_bytes": RESERVED_BYTES,
                "usable_bytes": self.usable,
            },
            "estimates": {
                k: {**e.to_dict(), "fits": e.total <= self.usable, "max_micro_batch": self.max_micro_batch[k]}
                for k, e in self.estimates.items()
            },
            "recommended": self.recommended,
            "reason": self.reason,
            "config_strategy": self.config_strategy,
            "notes": self.notes,
        }


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _what_would_fit(spec: ModelSpec, fsdp_batch: int, fsdp_precision: str, budget: int, devices: int, seq_len: int,
                    micro_batch: int, *, device_type: str, attention: str, checkpointing: bool,
                    accumulation: bool) -> list[str]:
    """When neither strategy fits: what to change, the FSDP micro-batch that fits (`fsdp_batch`, 0 for
    none) first, activation checkpointing where it would make FSDP fit, then bf16 and more devices."""
    tips = []
    if fsdp_batch:
        tips.append(f"a micro-batch of {fsdp_batch} (train.batch_size; train.grad_accum_steps keeps the global batch)")
    if not checkpointing:
        ck = estimate(spec, "fsdp", devices, seq_len, micro_batch, precision=fsdp_precision, device_type=device_type,
                      attention=attention, checkpointing=True, accumulation=accumulation)
        if ck.total <= budget:
            tips.append(f"activation checkpointing ({_gib(ck.total)})")
    if fsdp_precision == "fp32":
        tips.append("bf16 mixed precision")
    tips.append("more devices")
    return tips


def make_plan(
    spec: ModelSpec,
    *,
    devices: int,
    seq_len: int,
    micro_batch: int,
    device_memory: int,
    device_memory_source: str = "given",
    device_type: str = "cuda",
    precision: str = "auto",
    attention: str = "auto",
    checkpointing: bool = False,
    config_strategy: str | None = None,
    accumulation: bool = False,
) -> Plan:
    """Estimates for DDP and FSDP, the largest micro-batch of each, and the recommended strategy.

    precision 'auto' follows parallelize(): bf16 mixed precision for FSDP on CUDA, fp32 otherwise.
    attention 'auto': fused when planning for CUDA and the model uses SDPA/flash attention, else eager.
    """
    if precision not in ("auto", *PRECISIONS):
        raise UserError(f"unknown precision {precision!r}: use auto, {', '.join(PRECISIONS)}")
    if attention not in ("auto", *ATTENTIONS):
        raise UserError(f"unknown attention {attention!r}: use auto, {', '.join(ATTENTIONS)}")
    if precision == "auto":
        precisions = {"ddp": "fp32", "fsdp": "bf16" if device_type == "cuda" else "fp32"}
    else:
        precisions = {k: precision for k in STRATEGIES}
    if attention == "auto":
        attention = "fused" if device_type == "cuda" and spec.attn_implementation != "eager" else "eager"
    common: dict[str, Any] = dict(device_type=device_type, attention=attention, checkpointing=checkpointing,
                                  accumulation=accumulation)
    estimates = {
        k: estimate(spec, k, devices, seq_len, micro_batch, precision=precisions[k], **common) for k in STRATEGIES
    }
    best_b = {
        k: max_micro_batch(spec, k, devices, seq_len, device_memory, precision=precisions[k], **common)
        for k in STRATEGIES
    }
    budget = usable_bytes(device_memory)
    if estimates["ddp"].total <= budget:
        recommended: str | None = "ddp"
        reason = (f"DDP fits ({_gib(estimates['ddp'].total)} of {_gib(budget)} usable) and "
                  "communicates less than FSDP (one all-reduce of the gradients per step)")
    elif estimates["fsdp"].total <= budget:
        recommended = "fsdp"
        reason = (f"DDP needs {_gib(estimates['ddp'].total)} > {_gib(budget)} usable; FSDP "
                  f"shards the parameters, gradients and optimizer state over {devices} "
                  f"device(s): {_gib(estimates['fsdp'].total)}")
    else:
        recommended = None
        tips = _what_would_fit(spec, best_b["fsdp"], precisions["fsdp"], budget, devices, seq_len, micro_batch,
                               **common)
        reason = (f"neither fits at micro-batch {micro_batch}: FSDP needs {_gib(estimates['fsdp'].total)} > "
                  f"{_gib(budget)} usable; try " + ", or ".join(tips))
    notes = [f"activation bytes estimated, not measured: {n}" for n in spec.estimated]
    if config_strategy and recommended and config_strategy != recommended:
        notes.append(f"the config trains with {config_strategy}; the plan recommends {recommended}")
    return Plan(
        spec,
        device_memory,
        device_memory_source,
        devices,
        seq_len,
        micro_batch,
        device_type,
        attention,
        checkpointing,
        precisions,
        estimates,
        best_b,
        recommended,
        reason,
        config_strategy,
        notes,
    )


def plan_from_config(
    cfg,
    *,
    device_memory: str | int | None = None,
    devices: int | None = None,
    seq_len: int | None = None,
    micro_batch: int | None = None,
    precision: str = "auto",
    attention: str = "auto",
    checkpointing: bool = False,
) -> Plan:
    """A plan for the model and settings of a WorkflowConfig (the arguments override them)."""
    train_cfg = cfg.train
    spec, task_seq = get_task(cfg).training.memory_spec()
    seq_len = seq_len or task_seq
    if device_memory is None:
        found = detected_device_memory()
        mem, source = (
            (found, "detected (cuda:0)")
            if found
            else (
                parse_bytes(DEFAULT_DEVICE_MEMORY),
                f"assumed {DEFAULT_DEVICE_MEMORY} (no CUDA device here; set --device-memory)",
            )
        )
    else:
        mem, source = parse_bytes(device_memory), "given"
    seq = seq_len or cfg.preprocess.max_length
    return make_plan(
        spec,
        devices=devices or _devices(train_cfg),
        seq_len=seq,
        micro_batch=micro_batch or train_cfg.batch_size,
        device_memory=mem,
        device_memory_source=source,
        device_type="cuda" if train_cfg.use_gpu else "cpu",
        precision=precision,
        attention=attention,
        config_strategy=train_cfg.strategy,
        checkpointing=checkpointing or bool(getattr(train_cfg, "activation_checkpointing", False)),
        accumulation=getattr(train_cfg, "grad_accum_steps", 1) > 1,
    )


def format_plan(plan: Plan) -> str:
    """The plan as aligned plain text."""
    sp = plan.spec
    g = lambda n: f"{n / GiB:.3f}"  # noqa: E731
    m = lambda n: f"{n / 1e6:.1f}M"  # noqa: E731
    lines = [
        f"model      {sp.name}: {m(sp.params)} params ({m(sp.trainable)} trainable), h={sp.hidden} L={sp.layers} "
        f"a={sp.heads} V={sp.vocab} i={sp.intermediate}; largest block {m(sp.block_params)}, "
        f"outside blocks {m(sp.root_params)}",
        f"setup      {plan.devices} device(s) ({plan.device_type}), seq_len {plan.seq_len}, "
        f"micro-batch {plan.micro_batch} "
        f"per device, attention {plan.attention}, activation checkpointing {'on' if plan.checkpointing else 'off'}, "
        f"gradient accumulation {'on' if plan.estimates['ddp'].accumulation else 'off'}",
        f"memory     {g(plan.device_memory)} GiB per device, {plan.device_memory_source}; usable {g(plan.usable)} GiB "
        f"after the safety margin ({FRAGMENTATION_MARGIN:.0%} fragmentation/overhead "
        f"+ {RESERVED_BYTES / GiB:.0f} GiB reserved)",
        "",
    ]
    header = [
        "GiB/device",
        "precision",
        "model",
        "grads",
        "optimizer",
        "activations",
        "buffers",
        "step temp",
        "peak",
        "sum",
        "fits",
        "max micro-batch",
    ]
    rows = [header]
    for k, e in plan.estimates.items():
        rows.append(
            [
                k,
                e.precision,
                g(e.model),
                g(e.gradients),
                g(e.optimizer),
                g(e.activations),
                g(e.buffers),
                g(e.temporaries),
                g(e.total),
                g(e.upper_bound),
                "yes" if e.total <= plan.usable else "NO",
                str(plan.max_micro_batch[k]),
            ]
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for r in rows:
        lines.append("  ".join(v.ljust(w) if c < 2 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths))).rstrip())
    lines += ["", f"recommended: {plan.recommended or 'none fits'} — {plan.reason}"]
    lines += [f"note: {n}" for n in plan.notes]
    lines.append(
        "peak = params + optimizer state + the largest of (activations + forward buffers | gradients + "
        "step temporaries | gradients + end-of-backward buffers); sum = every column at once. "
        "Formulas and assumptions: workflows/train/planner.py"
    )
    return "\n".join(lines)


def _devices(train_cfg) -> int:
    """The data-parallel devices a run of `train_cfg` would use: train.num_workers, or for auto (one worker per
    GPU; on CPUs one per node) the GPUs this machine has, else one."""
    if train_cfg.num_workers != "auto":
        return train_cfg.max_workers
    import torch

    return max(1, torch.cuda.device_count()) if train_cfg.use_gpu else 1

"""The training loop's parts: plain PyTorch, no Ray in here.

One epoch's steps (`train_epoch`), validation reduced over the ranks (`validate`), the model,
optimizer and schedule (`build_training`), and the seeds an epoch derives from (train.seed, epoch,
rank). The epoch loop itself, with the checkpoint state, is engine.Trainer, which Ray Train
(ray_worker.py), torchrun (standalone.py) and one-worker Tune trials (tune/trial.py) all drive.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from workflows.errors import UserError
from workflows.loader.order import STAND_IN
from workflows.parallel import all_have, all_reduce_sum, gradient_sync, parallelize, world
from workflows.tasks.base import MetricStates
from workflows.train.compile import batch_rows, compile_model, eager, fixed_rows


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float, head_lr: float | None = None, fused: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norms; `head_lr` (if given) for the new classification
    head (the `classifier` module), which starts from random weights while the encoder is pretrained.
    `fused`: one kernel per step for all parameters (torch's default, None, picks foreach)."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            decays = not (p.ndim < 2 or "norm" in name.lower())
            head = head_lr is not None and "classifier" in name.split(".")[:-1]
            groups.setdefault((decays, head), []).append(p)
    return torch.optim.AdamW(
        [
            {"params": params, "weight_decay": weight_decay if decays else 0.0, "lr": head_lr if head else lr}
            # body before head, decayed before not: without head_lr, the two groups of old checkpoints
            for (decays, head), params in sorted(groups.items(), key=lambda kv: (kv[0][1], not kv[0][0]))
        ],
        lr=lr,
        fused=fused,
    )


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_fraction: float):
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, int(total_steps * warmup_fraction), max(total_steps, 1))


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed precision (`dtype`, bf16) around ONE forward and its loss on `device`; None: nothing.

    Never around a loop of optimizer steps: autocast keeps its casts of the weights until its outermost
    context exits, so one context held over many steps feeds every forward the first step's weights
    while the optimizer updates the fp32 ones, and the loss stays where it started. `train_epoch` and
    `validate` refuse to run inside an enabled one."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype)


def check_no_outer_autocast(device: torch.device) -> None:
    if torch.is_autocast_enabled(device.type):
        raise RuntimeError(
            "the training loop was called inside an autocast context: its cached weight casts would give every "
            "step the first step's weights; pass amp=torch.bfloat16 to train_epoch / validate instead")


def in_step(batches: Iterable[dict], device: torch.device) -> Iterator[dict]:
    """Yield batches while every rank has one, moved to `device`: on a GPU from pinned memory (a
    loader that pins in its own thread hands them pinned), so the copy overlaps the step before it."""
    it = iter(batches)
    pin = device.type == "cuda"
    while True:
        batch = next(it, None)
        if not all_have(batch is not None, device):
            return
        assert batch is not None  # all_have: every rank has one, this rank included
        yield {k: (v.pin_memory() if pin and v.device.type == "cpu" and not v.is_pinned() else v).to(
            device, non_blocking=True) for k, v in batch.items()}


@contextlib.contextmanager
def evaluating(model: nn.Module, on: bool) -> Iterator[None]:
    """The model in eval mode while `on` (a stand-in batch: no dropout draw, no BatchNorm statistics
    updated), back in train mode after."""
    if not on:
        yield
        return
    model.eval()
    try:
        yield
    finally:
        model.train()


def micro_batch_groups(batches: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """Consecutive groups of `size` micro-batches (the last may be shorter): one optimizer step each."""
    group: list[dict] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def label_count(batch: dict) -> torch.Tensor | int:
    """What the batch's mean loss averages over: rows (classification, regression) or predicted tokens
    (causal LM: integer labels of -100 are ignored; a real-valued target of -100 is a target). A tensor
    on the batch's device where it must be counted there (no host sync), else a number."""
    labels = batch["labels"]
    if labels.is_floating_point():
        return int(labels.shape[0])
    return (labels != -100).sum()


def token_count(batch: dict, rows: int) -> torch.Tensor | int:
    """The input tokens of the batch's first `rows` rows: its attention mask's ones, or every position
    of `input_ids` when a collate left out an all-ones mask; 0 for inputs without tokens (images)."""
    if "attention_mask" in batch:
        return batch["attention_mask"][:rows].sum()
    if "input_ids" in batch:
        return batch["input_ids"][:rows].numel()
    return 0


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock that times it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedIterator:
    """An iterator that adds up the time spent waiting for its next item (the data pipeline's share)."""

    def __init__(self, items: Iterable):
        self._it = iter(items)
        self.seconds = 0.0

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self._it)
        finally:
            self.seconds += time.perf_counter() - t0


def train_epoch(
    model,
    batches,
    optimizer,
    scheduler,
    device,
    grad_clip: float | None = None,
    on_step: Callable[[int], None] | None = None,
    accum_steps: int = 1,
    after_step: Callable[[int], None] | None = None,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None,
    amp: torch.dtype | None = None,
    pad_to: int | None = None,
    pad_label: int = -100,
) -> dict:
    """One pass over `batches`; the metrics, including every optimizer step's loss averaged over all ranks.

    Gradient accumulation: each optimizer step sums the gradients of up to `accum_steps`
    micro-batches, each loss weighted by its share of the group's labels, so the step equals one
    over the concatenated batch (DDP synchronizes on the last micro-batch only, see gradient_sync).
    `epoch_seconds` is the time of the steps alone (no startup, no evaluation), of which
    `data_wait_seconds` waiting for batches; `samples_per_s_after_first_step` the steady rate, as
    the loader benchmarks count theirs after the first batch: the samples of the steps after the
    first over the time after it (the first waits for a cold loader's start). `loss_fn(model, batch)`:
    the task's `loss` hook (default: `model(**batch).loss`). A batch holding `STAND_IN` (a rank with
    no sample left in a step, loader/order.py) runs forward and backward in eval mode with zero
    weight (and uncompiled: compile.eager), so this rank takes part in the step's collectives and
    trains nothing, and counts no sample.
    `amp`: autocast to this dtype (bf16) around each forward and its loss, not the backward or the step.
    `pad_to` (a compiled model, train.compile): every micro-batch made exactly this many rows
    (compile.fixed_rows: a short one padded with `pad_label` labels, a longer one split within its step),
    so the compiled graphs see one shape.

    No host sync per step: losses, label counts and tokens add up on the device and are read once,
    at the end of the epoch (tests/test_compile.py counts a step's syncs).
    """
    check_no_outer_autocast(device)
    model.train()
    batches = TimedIterator(batches)
    t0 = time.perf_counter()
    sums = _EpochSums(device)
    for step, group in enumerate(micro_batch_groups(in_step(batches, device), accum_steps)):
        if on_step is not None:
            on_step(step)
        _accumulate(model, _step_pieces(group, pad_to, pad_label), device, sums, loss_fn, amp)
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if sums.first_step_seconds is None:
            sums.first_step_seconds = time.perf_counter() - t0
        if after_step is not None:  # a step checkpoint (train.checkpoint_every_steps)
            after_step(step)
    synchronize(device)
    return sums.metrics(time.perf_counter() - t0, batches.seconds, scheduler.get_last_lr()[0])


class _EpochSums:
    """What an epoch adds up: rows on the host; tokens and each step's [loss * labels, labels] on the
    device, where they are counted, read once at the end (`metrics`): no host sync per step."""

    def __init__(self, device: torch.device):
        self.samples = self.after_first = 0  # rows, of which after the first step
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)
        self.first_step_seconds: float | None = None
        self.steps: list[torch.Tensor] = []  # this rank's [loss*n, n] per step

    def metrics(self, seconds: float, data_wait_seconds: float, lr: float) -> dict:
        """train_epoch's metrics, summed over all ranks: every rank ran the same number of steps
        (in_step), so the per-step sums line up: one all-reduce of everything, read once."""
        tokens = self.tokens
        if self.steps:
            per_step = torch.stack(self.steps)
        else:
            per_step = torch.zeros((0, 2), dtype=torch.float64, device=tokens.device)
        head = torch.stack([tokens.new_full((), self.samples), tokens.new_full((), self.after_first), tokens])
        flat = all_reduce_sum(torch.cat([head, per_step.reshape(-1)])).tolist()
        samples, after_first, tokens_all = flat[:3]
        per_step_rows = [flat[3 + 2 * k: 5 + 2 * k] for k in range(len(self.steps))]
        labelled_all = sum(n for _, n in per_step_rows)
        steady_seconds = seconds - (self.first_step_seconds or 0.0)
        steady = after_first / steady_seconds if after_first and steady_seconds > 0 else 0.0
        return {
            "train_loss": sum(a for a, _ in per_step_rows) / max(labelled_all, 1),
            "samples": int(samples),
            "samples_per_s": samples / seconds if seconds else 0.0,
            "tokens_per_s": tokens_all / seconds if seconds else 0.0,
            "epoch_seconds": seconds,
            "first_step_seconds": self.first_step_seconds or 0.0,
            "samples_after_first_step": int(after_first),
            "samples_per_s_after_first_step": steady,
            "data_wait_seconds": data_wait_seconds,
            "lr": lr,
            "steps": len(self.steps),
            "step_losses": [round(a / max(b, 1), 7) for a, b in per_step_rows],
        }


def _step_pieces(group: list[dict], pad_to: int | None, pad_label: int) -> list[tuple[dict, int, bool]]:
    """One step's micro-batches as (micro-batch, its real rows, stand-in): `STAND_IN` taken out, and
    with `pad_to` each made exactly that many rows (compile.fixed_rows)."""
    pieces = []
    for b in group:
        stand_in = b.pop(STAND_IN, None) is not None
        parts = fixed_rows(b, pad_to, pad_label) if pad_to and not stand_in else [(b, batch_rows(b))]
        pieces += [(piece, real, stand_in) for piece, real in parts]
    return pieces


def _accumulate(model, pieces: list[tuple[dict, int, bool]], device: torch.device, sums: _EpochSums,
                loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None, amp: torch.dtype | None) -> None:
    """Forward and backward of one optimizer step's micro-batches into the gradients, each loss
    weighted by its share of the step's labels (DDP synchronizing on the last only); the step's
    loss, labels, rows and tokens added to `sums`."""
    counts = [0 if stand_in else label_count(b) for b, _, stand_in in pieces]
    labelled = sum(counts)
    group_n = labelled.clamp(min=1) if isinstance(labelled, torch.Tensor) else max(labelled, 1)
    step_loss = torch.zeros((), dtype=torch.float64, device=device)
    for i, ((batch, real, stand_in), n) in enumerate(zip(pieces, counts)):
        with gradient_sync(model, i == len(pieces) - 1), evaluating(model, stand_in), \
                (eager() if stand_in else contextlib.nullcontext()):
            with autocast(device, amp):
                batch_loss = loss_fn(model, batch) if loss_fn is not None else model(**batch).loss
            (batch_loss * (n / group_n)).backward()  # a stand-in: n = 0, zero gradients
        if stand_in:
            continue
        step_loss += batch_loss.detach().double() * n
        sums.tokens += token_count(batch, real)  # images: none
        sums.samples += real
        sums.after_first += real if sums.first_step_seconds is not None else 0
    n_step = labelled.to(torch.float64) if isinstance(labelled, torch.Tensor) else step_loss.new_full((), labelled)
    sums.steps.append(torch.stack([step_loss, n_step]))


@torch.no_grad()
def validate(task, model, batches, device: torch.device, data, amp: torch.dtype | None = None) -> dict:
    """The task's val_* metrics over all ranks, as torchmetrics reduces states with dist_reduce_fx="sum":
    each batch's `task.metric_states` are summed here in float64, the sums of all ranks added up by
    one all-reduce of them stacked, and `task.compute_metrics` called once on the totals. Tasks hold
    no collective: every rank validates the same number of batches (in_step) and so reduces the same
    states. `amp`: each batch's forward autocast to this dtype, as in training."""
    check_no_outer_autocast(device)
    model.eval()
    totals: dict[str, torch.Tensor] | None = None
    with eager():  # a compiled model's graphs are training's: validation's shapes and eval mode run eagerly
        for batch in in_step(batches, device):
            with autocast(device, amp):
                found = task.metric_states(model, batch)
            # tensors stay where they are (summed on the device, read once below), numbers on the host
            states = {k: (v.detach().to(torch.float64) if isinstance(v, torch.Tensor)
                          else torch.as_tensor(v, dtype=torch.float64))
                      for k, v in found.items()}
            if totals is None:
                totals = states
                continue
            if states.keys() != totals.keys() or any(states[k].shape != totals[k].shape for k in totals):
                raise UserError(f"{type(task).__name__}.metric_states: every batch must return the same keys and "
                                f"shapes (got {sorted(states)} after {sorted(totals)})")
            for k, v in states.items():
                totals[k] = totals[k].to(v.device) + v
    if totals is None:  # no rank had a validation batch
        return task.compute_metrics(MetricStates(), data)
    keys = sorted(totals)
    flat = all_reduce_sum(torch.cat([totals[k].reshape(-1).to(device) for k in keys])).cpu()
    out, i = MetricStates(), 0
    for k in keys:
        n = totals[k].numel()
        value = flat[i:i + n].reshape(totals[k].shape).numpy()
        out[k] = float(value) if value.ndim == 0 else value
        i += n
    return task.compute_metrics(out, data)


def steps_per_epoch(rows: int, world_size: int, batch_size: int, accum_steps: int = 1) -> int:
    """Optimizer steps per epoch."""
    return max(1, math.ceil(math.ceil(rows / world_size / batch_size) / accum_steps))


def build_training(cfg, task, data, device: torch.device, train_rows: int,
                   probe_batches: Iterable[dict] | None = None):
    """Model (the task's, with seeded new weights; FSDP2/DDP per train.strategy), optimizer and LR
    schedule: the same under Ray Train, torchrun and Tune. The schedule spans all epochs, so a
    resumed run continues it. `train_rows`: training examples per epoch (a causal LM: blocks).
    `probe_batches`: this rank's training batches for the task's `prepare_model` (None when
    resuming: the checkpoint holds everything)."""
    tc = cfg.train
    torch.manual_seed(tc.seed)  # new weights identical on every rank and every run
    model = task.build_model(data)
    task.training.prepare_model(model, device, probe_batches)
    if tc.activation_checkpointing:  # before sharding, so each block's checkpoint wraps its FSDP unit
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if tc.compiled:  # after activation checkpointing, before sharding (torchtitan's order)
        compile_model(model, tc.compile_backend)
    model = parallelize(model, tc.strategy, device)
    # fused AdamW on GPU: one kernel per step for all parameters
    optimizer = make_optimizer(model, tc.lr, tc.weight_decay, task.training.head_lr(),
                               fused=device.type == "cuda" or None)
    total_steps = steps_per_epoch(train_rows, world()[1], tc.batch_size, tc.grad_accum_steps) * tc.epochs
    scheduler = make_scheduler(optimizer, total_steps, tc.warmup_fraction)
    return model, optimizer, scheduler


def training_amp(model: nn.Module, device: torch.device) -> torch.dtype | None:
    """The autocast dtype around each forward: bf16 on a GPU, unless FSDP2's MixedPrecisionPolicy gives
    the model its bf16 already (parallelize); None (the model's own fp32) on CPU, where bf16 matmuls are
    slow. One rule for every launcher: torchrun, Ray Train (FSDP2 or DDP) and Tune trials."""
    from torch.distributed.fsdp import FSDPModule

    if device.type != "cuda" or isinstance(model, FSDPModule):
        return None
    return torch.bfloat16


def epoch_line(m: dict) -> str:
    """One epoch's metrics as the CLI and torchrun print them: every val_* metric."""
    val = ", ".join(f"{k} {v:.4f}" for k, v in m.items() if k.startswith("val_") and k != "val_seconds"
                    and isinstance(v, int | float))
    mfu = f", MFU {m['mfu']:.1%}" if m.get("mfu") is not None else ""
    tokens = f", {m['tokens_per_s']:.0f} tokens/s" if m.get("tokens_per_s") else ""
    return (
        f"epoch {m.get('epoch')}: loss {m.get('train_loss', 0):.4f}, {val}, {m.get('samples_per_s', 0):.1f} "
        f"samples/s{tokens}{mfu}, {m.get('epoch_seconds', 0):.1f}s"
    )

"""The training loop: plain PyTorch, no Ray in here (the adapter in trainer.py feeds it).

It runs the same under Ray Train, torchrun or a single process.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Iterator

import numpy as np
import torch
import torch.nn as nn

from workflows.preprocess.encoding import pad_batch
from workflows.train.parallel import all_have, all_reduce_sum


def collate(batch: dict[str, np.ndarray], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A batch of token id lists -> padded tensors (dynamic padding to the batch's longest row)."""
    ids, mask = pad_batch(list(batch["input_ids"]), pad_id)
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(np.array(batch["label_id"], dtype=np.int64)),
    }



def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr)


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_fraction: float):
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, int(total_steps * warmup_fraction), max(total_steps, 1))


def in_step(batches: Iterable[dict], device: torch.device) -> Iterator[dict]:
    """Yield batches while every rank has one, moved to `device`."""
    it = iter(batches)
    while True:
        batch = next(it, None)
        if not all_have(batch is not None, device):
            return
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_epoch(model, batches, optimizer, scheduler, device, grad_clip: float | None = None) -> dict:
    model.train()
    t0 = time.perf_counter()
    totals = torch.zeros(3, dtype=torch.float64)  # loss*n, samples, tokens
    for batch in in_step(batches, device):
        out = model(**batch)
        out.loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        n = batch["labels"].shape[0]
        totals += torch.tensor([out.loss.item() * n, n, batch["attention_mask"].sum().item()], dtype=torch.float64)
    seconds = time.perf_counter() - t0
    totals = all_reduce_sum(totals)
    loss_sum, samples, tokens = totals.tolist()
    return {
        "train_loss": loss_sum / max(samples, 1),
        "samples": int(samples),
        "samples_per_s": samples / seconds if seconds else 0.0,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "epoch_seconds": seconds,
        "lr": scheduler.get_last_lr()[0],
    }


@torch.no_grad()
def evaluate(model, batches, num_labels: int, device: torch.device) -> dict:
    """Loss and confusion matrix over all ranks, then accuracy and weighted F1."""
    model.eval()
    confusion = torch.zeros(num_labels, num_labels, dtype=torch.float64)
    loss_sum = torch.zeros(1, dtype=torch.float64)
    for batch in in_step(batches, device):
        out = model(**batch)
        pred = out.logits.argmax(-1).cpu()
        gold = batch["labels"].cpu()
        loss_sum += out.loss.item() * gold.shape[0]
        confusion += torch.bincount(gold * num_labels + pred, minlength=num_labels**2).reshape(num_labels, num_labels)
    confusion = all_reduce_sum(confusion)
    loss_sum = all_reduce_sum(loss_sum)
    return {**scores_from_confusion(confusion.numpy()), "loss": float(loss_sum.item() / max(confusion.sum().item(), 1))}


def scores_from_confusion(confusion: np.ndarray) -> dict:
    """Accuracy and weighted F1 from a confusion matrix (rows: gold, columns: predicted)."""
    total = confusion.sum()
    tp = np.diag(confusion)
    support = confusion.sum(1)
    predicted = confusion.sum(0)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, support, out=np.zeros_like(tp), where=support > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=(precision + recall) > 0)
    return {
        "accuracy": float(tp.sum() / total) if total else 0.0,
        "f1": float((f1 * support).sum() / total) if total else 0.0,
        "rows": int(total),
    }


def steps_per_epoch(rows: int, world_size: int, batch_size: int) -> int:
    return max(1, math.ceil(rows / world_size / batch_size))

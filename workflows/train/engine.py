"""One training object: the model, optimizer, LR schedule, input, checkpoint state and epoch loop.

Ray Train's worker (trainer.py), torchrun (standalone.py) and a one-worker Tune trial
(tune/trial.py) are thin adapters over `Trainer`, as torchtitan's launchers are over its Trainer:
each hands it a `BatchSource` (where an epoch's batches and the validation batches come from) and
overrides the hooks it needs (`end_of_epoch`: Ray Train's report with a checkpoint, torchrun's
rank-0 print and local write, Tune's report; `before_step`/`after_step`: fault injection and step
checkpoints). Plain PyTorch: no Ray in here. `checkpoint_state` is the one place a checkpoint's
train state is written, so `--resume`, a restarted worker and export read one layout.

Determinism: an epoch's result depends only on the state at its start (model, optimizer,
scheduler: all in the checkpoint) and on seeds derived from (train.seed, epoch, rank): the data
order (`data_seed`) and the dropout RNG (`dropout_seed`, reseeded at the start of every epoch).
So an epoch run after a resume reproduces the epoch of an uninterrupted run, without the RNG
state having to be saved.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from workflows.parallel import sync_buffers, world
from workflows.seeds import dropout_seed
from workflows.train import checkpoint as ckpt
from workflows.train.loop import build_training, train_epoch, training_amp, validate
from workflows.train.worker_setup import mid_epoch_position, start_point


class BatchSource(Protocol):
    """Where a Trainer's batches come from (this rank's, as tensors the task's collate made)."""

    def train(self, epoch: int, skip: int) -> Iterable[dict]:
        """One epoch's training batches, from global sample `skip` on (a step checkpoint's position)."""
        ...

    def val(self) -> Iterable[dict]:
        """The validation batches this rank scores."""
        ...

    def probe(self) -> Iterable[dict] | None:
        """Training batches for the task's `prepare_model` on a new model (a linear probe's features)."""
        ...


class EpochLog(Protocol):
    """Where each epoch's metrics are logged (tracking.run_logger.RunLogger: rank 0's MLflow run)."""

    def log_epoch(self, metrics: dict, step_losses: list[float] | None = None) -> None: ...


class Trainer:
    """Training of one task's model on one rank; the same under Ray Train, torchrun and Tune.

    `build` makes the model, optimizer and schedule (the schedule spans all train.epochs, so a
    resumed run continues it); `resume` loads a checkpoint into them and sets the epoch to start
    from; `fit` runs the epochs. `train_rows`: training examples per epoch over all ranks (a causal
    LM: blocks), for the schedule's length. `logger`: where this process logs its epochs (None:
    it does not)."""

    def __init__(self, cfg, task, data, device: torch.device, source: BatchSource, train_rows: int,
                 logger: EpochLog | None = None):
        self.cfg, self.task, self.data, self.device = cfg, task, data, device
        self.source, self.train_rows, self.logger = source, train_rows, logger
        self.rank = world()[0]
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.start_epoch = 0  # the first epoch to train
        self.history: list[dict] = []  # a row per epoch trained, the checkpoint's included
        self.resumed_from: int | None = None  # the epoch of the checkpoint this process started from
        self.saved: dict | None = None  # that checkpoint's train state
        self.resume_at = 0  # global samples of `start_epoch` trained before the checkpoint (a step one)
        # autocast dtype around each forward (training and validation); None: the model's own precision.
        # Set by `build` (loop.training_amp: bf16 on a GPU, unless FSDP2's policy gives the model its own)
        self.amp: torch.dtype | None = None

    def build(self, probe: bool = True) -> None:
        """Model (the task's, seeded new weights, FSDP2/DDP per train.strategy), optimizer, schedule.
        `probe`: give the task's `prepare_model` training batches (no need when a checkpoint follows)."""
        batches = self.source.probe() if probe else None
        self.model, self.optimizer, self.scheduler = build_training(
            self.cfg, self.task, self.data, self.device, self.train_rows, batches)
        self.amp = training_amp(self.model, self.device)

    def resume(self, directory: str | None) -> None:
        """Load the checkpoint in `directory` (None: start from scratch) into the built parts; training
        goes on with the epoch after it, or within its epoch from a step checkpoint."""
        self.start_epoch, self.history, self.resumed_from, self.saved = start_point(
            directory, self.model, self.optimizer, self.scheduler)
        self.resume_at = mid_epoch_position(self.saved)

    def checkpoint_state(self, epoch: int, metrics: dict, consumed: int | None = None) -> dict:
        """The train state a checkpoint holds besides the model and optimizer (checkpoint.save adds
        the schedule and the file list): the epoch, the optimizer step, the epoch's metrics and the
        history so far; a step checkpoint (mid-epoch, `metrics` {}) the global samples `consumed`."""
        state = {"epoch": epoch, "global_step": int(self.scheduler.last_epoch), "metrics": metrics,
                 "history": self.history}
        if consumed is not None:
            state["consumed"] = consumed
        return state

    def save_checkpoint(self, directory: str, epoch: int, metrics: dict, consumed: int | None = None) -> None:
        """Every rank's shard of the checkpoint into `directory` (collective: every rank calls it)."""
        ckpt.save(directory, self.model, self.optimizer, self.scheduler,
                  self.checkpoint_state(epoch, metrics, consumed))

    # hooks an adapter overrides
    def before_step(self, epoch: int, step: int) -> None:
        """Before each optimizer step (Ray Train: the fault injection of reliability/)."""

    def after_step(self, epoch: int, step: int) -> None:
        """After each optimizer step (Ray Train: a step checkpoint every train.checkpoint_every_steps)."""

    def end_of_epoch(self, epoch: int, metrics: dict) -> None:
        """After an epoch's validation and logging: checkpoint and report (Tune may stop the trial here)."""

    def run_epoch(self, epoch: int) -> dict:
        """Train one epoch, validate, log; the epoch's scalar metrics. Its history row adds the per-step
        losses and the epoch of the checkpoint this process started from (None: from scratch)."""
        tc, model = self.cfg.train, self.model
        torch.manual_seed(dropout_seed(tc.seed, epoch, self.rank))
        batches = self.source.train(epoch, self.resume_at if epoch == self.start_epoch else 0)
        stats = train_epoch(
            model, batches, self.optimizer, self.scheduler, self.device, tc.grad_clip,
            lambda step: self.before_step(epoch, step), tc.grad_accum_steps,
            lambda step: self.after_step(epoch, step), loss_fn=self.task.training.loss, amp=self.amp,
            # a compiled model sees one batch shape: short batches padded with labels the task's loss ignores
            pad_to=tc.batch_size if tc.compiled and self.task.training.pad_label is not None else None,
            pad_label=self.task.training.pad_label if self.task.training.pad_label is not None else -100,
        )
        step_losses = stats.pop("step_losses")
        # the ranks' buffers (BatchNorm statistics) made one before validating: the checkpoint saved
        # after it, and so the exported model, holds what was validated
        sync_buffers(model)
        t_val = time.perf_counter()
        val = validate(self.task, model, self.source.val(), self.device, self.data, self.amp)
        metrics = {
            **stats,
            "epoch": epoch,
            "global_step": int(self.scheduler.last_epoch),
            **val,
            "val_seconds": time.perf_counter() - t_val,
        }
        metrics.update(self.task.training.epoch_extras(model, stats, self.device))
        self.history.append({**metrics, "step_losses": step_losses, "resumed_from_epoch": self.resumed_from})
        if self.logger is not None:  # once per epoch trained: a resumed run does not log its last one again
            self.logger.log_epoch(metrics, step_losses)
        return metrics

    def fit(self, stop_after: int | None = None) -> list[dict]:
        """Epochs `start_epoch`..train.epochs-1, each ended by `end_of_epoch`; after `stop_after`, if
        given, no more (the LR schedule still spans train.epochs). Returns the history."""
        for epoch in range(self.start_epoch, self.cfg.train.epochs):
            self.end_of_epoch(epoch, self.run_epoch(epoch))
            if stop_after is not None and epoch >= stop_after:
                break
        return self.history


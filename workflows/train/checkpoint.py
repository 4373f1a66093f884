"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Each rank writes its own shard files (`__<rank>_0.distcp`) into its local directory; rank 0 also
writes `.metadata` and `train_state.json`. Ray Train uploads every rank's directory into the same
checkpoint folder in object storage, which then holds one complete DCP checkpoint.

What a checkpoint holds, all a resumed run needs to continue exactly where this one was:
model and optimizer state (DCP, sharded), and in train_state.json the LR scheduler state, the
epoch just completed (the data position: checkpoints are taken at epoch ends), the global step
and the history so far. No RNG state: loop.py reseeds the data order and dropout from
(seed, epoch, rank) at every epoch start.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from workflows.train.parallel import world

STATE_FILE = "train_state.json"


def save(directory: str, model, optimizer, scheduler, state: dict) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    if world()[0] == 0:
        body = {**state, "scheduler": scheduler.state_dict()}
        with open(os.path.join(directory, STATE_FILE), "w") as f:
            json.dump(body, f)


def load(directory: str, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer and scheduler in place; returns the saved train state (epoch, step...)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(directory, STATE_FILE)) as f:
        saved = json.load(f)
    scheduler.load_state_dict(saved.pop("scheduler"))
    return saved


def is_complete(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, ".metadata")) and os.path.exists(os.path.join(directory, STATE_FILE))


def latest_local(root: str) -> str | None:
    """The newest complete checkpoint directory `root/epoch_NNNN` (standalone runs), or None."""
    if not os.path.isdir(root):
        return None
    found = sorted(d for d in os.listdir(root) if d.startswith("epoch_") and is_complete(os.path.join(root, d)))
    return os.path.join(root, found[-1]) if found else None


def consolidated_model_state(directory: str) -> dict[str, torch.Tensor]:
    """One full, unsharded model state dict from a sharded checkpoint (no process group needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(directory, path)
        full = torch.load(path, weights_only=True, map_location="cpu")
    return full["model"]


def read_state(directory: str) -> dict:
    with open(os.path.join(directory, STATE_FILE)) as f:
        return json.load(f)

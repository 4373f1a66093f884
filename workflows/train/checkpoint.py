"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Each rank writes its own shard files (`__<rank>_0.distcp`) into its local directory; rank 0 also
writes `.metadata` and `train_state.json`. Ray Train uploads every rank's directory into the same
checkpoint folder in object storage, which then holds one complete DCP checkpoint.

A checkpoint is complete when every file every rank wrote is there with its size:
train_state.json lists them (gathered from all ranks after the save). A crash while the ranks
upload leaves a folder with some files and not others (rank 0's .metadata and train_state.json
may be there while rank 1's shard is not); `missing` finds what is absent, so such a folder is
never taken for a checkpoint to resume from.

What a checkpoint holds, all a resumed run needs to continue exactly where this one was:
model and optimizer state (DCP, sharded), and in train_state.json the LR scheduler state, the
epoch just completed (the data position: checkpoints are taken at epoch ends), the global step
and the history so far. No RNG state: loop.py reseeds the data order and dropout from
(seed, epoch, rank) at every epoch start.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from workflows.errors import UserError
from workflows.train.parallel import world

STATE_FILE = "train_state.json"


def save(directory: str, model, optimizer, scheduler, state: dict) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    files = {n: size for n, size in local_listing(directory).items() if n != STATE_FILE}
    rank, world_size = world()
    if world_size > 1:  # each Ray Train worker writes its own directory: gather every rank's files
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, files)
        files = {n: size for ranks_files in gathered for n, size in ranks_files.items()}
    if rank == 0:
        body = {**state, "scheduler": scheduler.state_dict(), "files": files}
        with open(os.path.join(directory, STATE_FILE), "w") as f:
            json.dump(body, f)


def missing(listing: dict[str, int], state: dict | None) -> list[str]:
    """Files of a checkpoint that are absent from `listing` (name -> size) or have another size;
    [STATE_FILE] without its state. A checkpoint written before train_state.json listed its files
    counts as complete with .metadata."""
    if state is None:
        return [STATE_FILE]
    expected = state.get("files") or {".metadata": listing.get(".metadata", -1)}
    return sorted(n for n, size in expected.items() if listing.get(n) != size)


def local_listing(directory: str) -> dict[str, int]:
    return {n: os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)}


def load(directory: str, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer and scheduler in place; returns the saved train state (epoch, step...)."""
    check_complete(directory)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(directory, STATE_FILE)) as f:
        saved = json.load(f)
    scheduler.load_state_dict(saved.pop("scheduler"))
    return saved


def is_file(directory: str, name: str) -> bool:
    return os.path.isfile(os.path.join(directory, name))


def missing_locally(directory: str) -> list[str]:
    return missing(local_listing(directory), read_state(directory) if is_file(directory, STATE_FILE) else None)


def is_complete(directory: str) -> bool:
    return not missing_locally(directory)


def latest_local(root: str) -> str | None:
    """The newest complete checkpoint directory `root/epoch_NNNN` (standalone runs), or None."""
    if not os.path.isdir(root):
        return None
    found = sorted(d for d in os.listdir(root) if d.startswith("epoch_") and is_complete(os.path.join(root, d)))
    return os.path.join(root, found[-1]) if found else None


def check_complete(directory: str) -> None:
    absent = missing_locally(directory)
    if absent:
        raise UserError(f"incomplete checkpoint {directory}: {', '.join(absent)} missing or cut short "
                        "(a crash while it was written or uploaded?)")


def consolidated_model_state(directory: str) -> dict[str, torch.Tensor]:
    """One full, unsharded model state dict from a sharded checkpoint (no process group needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    check_complete(directory)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(directory, path)
        full = torch.load(path, weights_only=True, map_location="cpu")
    return full["model"]


@contextlib.contextmanager
def private_copy(checkpoint) -> Iterator[str]:
    """A Ray Train checkpoint as a local directory that this process alone reads.

    Not `Checkpoint.as_directory`: its download directory is shared by a node's processes (named
    by the checkpoint), and only callers that arrive while a download holds the lock wait for it.
    A rank that arrives later downloads again over the files another rank is reading (DCP then
    reads a cut-short .metadata: "Ran out of input"), and the first rank to leave may delete it.
    """
    from pyarrow.fs import LocalFileSystem

    if isinstance(checkpoint.filesystem, LocalFileSystem):  # read in place, as as_directory does
        yield checkpoint.path
        return
    with tempfile.TemporaryDirectory(prefix="workflows-checkpoint-") as tmp:
        yield checkpoint.to_directory(tmp)


def read_state(directory: str) -> dict:
    with open(os.path.join(directory, STATE_FILE)) as f:
        return json.load(f)

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

A checkpoint is read from the store, where anyone who may write to the bucket can replace its files.
DCP reads `.metadata` with pickle and the non-tensor values in the shards (the optimizer's
hyperparameters) with torch.load(weights_only=False): either could run any code. Here both are read
with restricted loaders (`read_metadata`: only the classes DCP's metadata is made of; values:
torch.load(weights_only=True)), and the metadata may name only plain files of the checkpoint's own
directory. A replaced file can still hold other numbers; it cannot choose code or paths.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import tempfile
from collections.abc import Iterator
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from workflows.errors import UserError
from workflows.parallel import world
from workflows.storage.confine import plain_segments, shown

STATE_FILE = "train_state.json"
METADATA_FILE = ".metadata"
# what DCP's .metadata is made of (torch 2.13, FSDP2 and plain state dicts alike), besides torch's dtypes
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id: a path, never opened
}


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
    with refused_in_one_line(directory):
        _read_local_metadata(directory)
        dcp.load(state, storage_reader=_Reader(directory), planner=_LoadPlanner())
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


def newest_stored(fs, run: str) -> str | None:
    """The newest complete `checkpoint_*` folder of a Ray Train run's directory `run` on the fsspec
    `fs` (Ray names them by time), or None: a folder that lacks any file its train_state.json lists (a
    crash during upload) is passed over."""
    try:
        entries = fs.ls(run, detail=True)
    except FileNotFoundError:
        return None
    found = sorted((e["name"] for e in entries
                    if e["type"] == "directory" and e["name"].rsplit("/", 1)[-1].startswith("checkpoint_")),
                   reverse=True)
    for c in found:
        listing = {e["name"].rsplit("/", 1)[-1]: e["size"] for e in fs.ls(c, detail=True) if e["type"] == "file"}
        state = (parse_state(fs.cat_file(f"{c}/{STATE_FILE}", end=MAX_STATE_BYTES + 1), c)
                 if STATE_FILE in listing else None)
        if not missing(listing, state):
            return c
    return None


def check_complete(directory: str) -> None:
    absent = missing_locally(directory)
    if absent:
        raise UserError(f"incomplete checkpoint {directory}: {', '.join(absent)} missing or cut short "
                        "(a crash while it was written or uploaded?)")


def consolidated_model_state(directory: str) -> dict[str, torch.Tensor]:
    """One full, unsharded model state dict from a sharded checkpoint (no process group needed):
    dcp_to_torch_save's reading, without its pickle."""
    check_complete(directory)
    full: dict[str, Any] = {}
    with refused_in_one_line(directory):
        _read_local_metadata(directory)
        # as dcp_to_torch_save reads (dcp.load would fill only the keys `full` already has)
        _load_state_dict(full, storage_reader=_Reader(directory), planner=_ConsolidatingPlanner(), no_dist=True)
    return full["model"]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata is not made of")


def read_metadata(f: IO[bytes]) -> Metadata:
    """A checkpoint's .metadata, read without running code it could name; its storage entries may
    name only files of the checkpoint's own directory. pickle.UnpicklingError where it is not so."""
    try:
        metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # a malformed stream: EOFError, a bad opcode, a class given wrong state
        raise pickle.UnpicklingError(f"{type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    for info in (metadata.storage_data or {}).values():
        if not isinstance(info, _StorageInfo) or not _plain_name(info.relative_path) or info.transform_descriptors:
            raise pickle.UnpicklingError(f"an entry names {getattr(info, 'relative_path', info)!r}, "
                                         "not a file of the checkpoint")
    return metadata


def _plain_name(name: object) -> bool:
    """A file name of the checkpoint's own folder: one plain segment (workflows.storage.confine)."""
    return isinstance(name, str) and plain_segments(name) and "/" not in name


def _read_local_metadata(directory: str | os.PathLike) -> Metadata:
    with open(os.path.join(directory, METADATA_FILE), "rb") as f:
        return read_metadata(f)


class _Reader(FileSystemReader):
    """DCP's reader of a local checkpoint directory, with .metadata read by `read_metadata`. DCP
    reports a failure to read it as text in an AssertionError: callers read it first
    (_read_local_metadata), for its own error."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _read_local_metadata(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes(planner: DefaultLoadPlanner, read_item, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes with torch.load(weights_only=True): the checkpoint's non-tensor
    values are numbers, strings, tuples and lists."""
    loaded = torch.load(value, weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class _LoadPlanner(DefaultLoadPlanner):
    load_bytes = _load_bytes


class _ConsolidatingPlanner(_EmptyStateDictLoadPlanner):
    load_bytes = _load_bytes


@contextlib.contextmanager
def refused_in_one_line(directory: str) -> Iterator[None]:
    """A checkpoint whose files name code or paths it may not, as a one-line UserError."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        cause = _unpickling_error(e)
        if cause is None:
            raise
        raise UserError(f"checkpoint {directory} was not read: {cause} (its files were replaced, or written "
                        "by another torch)") from None


def _unpickling_error(e: BaseException | None) -> str | None:
    """The first line of a pickle.UnpicklingError in `e`'s chain, or within DCP's CheckpointException."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, pickle.UnpicklingError):
            text = str(err)
            weights_only = re.search(r"WeightsUnpickler error: (.+?)(\. Please|\n|$)", text)  # torch.load's reason
            return weights_only.group(1) if weights_only else (text.splitlines() or [type(err).__name__])[0]
        stack += [err.__cause__, err.__context__]
        failures = getattr(err, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


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


MAX_STATE_BYTES = 64 << 20


def read_state(directory: str) -> dict:
    """train_state.json of a local checkpoint directory, checked (`parse_state`)."""
    path = os.path.join(directory, STATE_FILE)
    if os.path.getsize(path) > MAX_STATE_BYTES:
        raise UserError(f"checkpoint {directory}: {STATE_FILE} is over {MAX_STATE_BYTES} bytes: refused")
    with open(path, "rb") as f:
        return parse_state(f.read(), directory)


def parse_state(raw: bytes, where: str) -> dict:
    """A checkpoint's train_state.json, refused in one line unless it is a JSON object whose `files`
    (when there) maps plain file names to sizes: a replaced file may hold other numbers, not other
    shapes."""
    if len(raw) > MAX_STATE_BYTES:
        raise UserError(f"checkpoint {where}: {STATE_FILE} is over {MAX_STATE_BYTES} bytes: refused")
    try:
        state = json.loads(raw)
    except ValueError as e:
        raise UserError(f"checkpoint {where}: {STATE_FILE} is not JSON ({str(e)[:120]}): refused") from None
    files = state.get("files") if isinstance(state, dict) else None
    if not isinstance(state, dict) or files is not None and not (
            isinstance(files, dict) and all(_plain_name(k) and type(v) is int and v >= 0
                                            for k, v in files.items())):
        what = f"files {shown(files)}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise UserError(f"checkpoint {where}: {STATE_FILE}: {what} is not a map of the checkpoint's file names "
                        "to their sizes: refused (its files were replaced)")
    return state

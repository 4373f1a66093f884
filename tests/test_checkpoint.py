"""A training checkpoint is read from the store, where whoever may write to the bucket can replace
its files: resuming or exporting one never runs code its files name (DCP's .metadata is a pickle, and
its non-tensor values are torch.load'ed), nor reads a file outside it. Ray-free: a checkpoint of a
tiny model saved by checkpoint.save in this process, its files replaced as a bucket writer would
(train_state.json's sizes included, so it is complete)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from workflows.config import WorkflowConfig
from workflows.errors import UserError
from workflows.storage.uri import StorageContext
from workflows.train import checkpoint as ckpt


def _parts():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _saved(directory: Path) -> Path:
    model, optimizer, scheduler = _parts()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    directory.mkdir(parents=True)
    ckpt.save(str(directory), model, optimizer, scheduler, {"epoch": 0})
    return directory


class Payload:
    """Unpickled, it creates `marker`: what a replaced file could run instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _as_complete(directory: Path) -> None:
    """train_state.json lists the files as they are now (a bucket writer can edit it too)."""
    state = ckpt.read_state(str(directory))
    state["files"] = {n: s for n, s in ckpt.local_listing(str(directory)).items() if n != ckpt.STATE_FILE}
    (directory / ckpt.STATE_FILE).write_text(json.dumps(state))


def _refused(directory: Path, marker: Path, reason: str) -> None:
    for read in (lambda: ckpt.load(str(directory), *_parts()), lambda: ckpt.consolidated_model_state(str(directory))):
        with pytest.raises(UserError) as e:
            read()
        message = str(e.value)
        assert len(message.splitlines()) == 1 and f"checkpoint {directory} was not read" in message, message
        assert reason in message, message
        assert not marker.exists(), "the checkpoint's payload ran"


def test_a_checkpoint_saved_here_loads_and_consolidates(tmp_path):
    directory = _saved(tmp_path / "ck")
    model, optimizer, scheduler = _parts()
    assert ckpt.load(str(directory), model, optimizer, scheduler)["epoch"] == 0
    assert optimizer.state_dict()["param_groups"][0]["lr"] == 1e-3 and optimizer.state_dict()["state"]
    assert sorted(ckpt.consolidated_model_state(str(directory))) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def test_a_replaced_metadata_file_is_refused_and_its_payload_never_runs(tmp_path):
    directory, marker = _saved(tmp_path / "ck"), tmp_path / "payload-ran"
    (directory / ckpt.METADATA_FILE).write_bytes(pickle.dumps(Payload(marker)))
    _as_complete(directory)
    _refused(directory, marker, "it names io.open, which DCP's metadata is not made of")
    # DCP's own reader runs it: what the checks above guard against
    with pytest.raises(BaseException):  # noqa: B017 - whatever DCP makes of an open file
        dcp.load({}, checkpoint_id=str(directory))
    assert marker.exists()


def test_a_replaced_value_in_a_shard_is_refused_and_its_payload_never_runs(tmp_path):
    """The optimizer's hyperparameters are pickled into the shard (DCP reads them with
    torch.load(weights_only=False)): a checkpoint rewritten with a payload as its learning rate."""
    directory, marker = _saved(tmp_path / "ck"), tmp_path / "payload-ran"
    model, optimizer, _ = _parts()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    optim_sd["param_groups"][0]["lr"] = Payload(marker)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))
    _as_complete(directory)
    assert not marker.exists()
    _refused(directory, marker, "Unsupported global: GLOBAL io.open was not an allowed global")


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    directory = _saved(tmp_path / "ck")
    with open(directory / ckpt.METADATA_FILE, "rb") as f:
        metadata = ckpt.read_metadata(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    (directory / ckpt.METADATA_FILE).write_bytes(pickle.dumps(metadata))
    _as_complete(directory)
    _refused(directory, tmp_path / "never", "an entry names '../outside.distcp', not a file of the checkpoint")


def test_resume_refuses_a_replaced_checkpoint_in_one_line_before_training(tmp_path):
    """`train --resume`: the driver reads the .metadata of the checkpoint it found before any worker
    starts (the workers read it the same way; a worker's restart too)."""
    from workflows.train.trainer import resume_point

    cfg = WorkflowConfig.model_validate({"data": {"source": str(tmp_path / "raw")},
                                         "storage": {"root": str(tmp_path / "store"), "embedded": {"enabled": False}}})
    directory = _saved(tmp_path / "store" / "runs" / "quickstart-train-20000101-000000-0000" / "checkpoint_0")
    assert resume_point(cfg, StorageContext(), "quickstart-train") == str(directory)
    marker = tmp_path / "payload-ran"
    (directory / ckpt.METADATA_FILE).write_bytes(pickle.dumps(Payload(marker)))
    _as_complete(directory)
    with pytest.raises(UserError) as e:
        resume_point(cfg, StorageContext(), "quickstart-train")
    assert len(str(e.value).splitlines()) == 1 and "io.open" in str(e.value), str(e.value)
    assert not marker.exists()

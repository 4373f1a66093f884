"""`tune --resume` reads Ray Tune's tuner.pkl (which Tuner.restore unpickles) only where this user's own
`tune` wrote it (issue #63, finding 8): unit tests without Ray, Tuner.restore replaced by what it does
first (unpickling the file)."""

from __future__ import annotations

import os
import pickle

import pytest

from workflows.config import WorkflowConfig
from workflows.errors import UserError
from workflows.storage.uri import StorageContext
from workflows.tune.state import TUNER_PKL, check_tuner_state, remember_tuner_state

CTX = StorageContext()


class Payload:
    """What a bucket writer would put in tuner.pkl: code that runs when it is unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _cfg(tmp_path) -> WorkflowConfig:
    return WorkflowConfig.model_validate({
        "name": "q", "data": {"source": str(tmp_path / "raw")},
        "storage": {"root": str(tmp_path / "store"), "embedded": {"enabled": False}},
        "cache": {"dir": str(tmp_path / "cache")},
        "tune": {"space": {"train.lr": {"grid": [1e-4, 2e-4]}}}})


def _experiment(tmp_path, cfg, data: bytes) -> str:
    uri = f"{cfg.uri('tune')}/{cfg.name}-tune"
    os.makedirs(uri, exist_ok=True)
    with open(f"{uri}/{TUNER_PKL}", "wb") as f:
        f.write(data)
    return uri


@pytest.fixture
def restored(monkeypatch):
    """Tuner.can_restore and Tuner.restore as far as Ray goes before anything else: the pickle loaded."""
    from ray import tune

    loaded = []

    def restore(path, **kwargs):
        with open(f"{path}/{TUNER_PKL}", "rb") as f:
            loaded.append(pickle.loads(f.read()))
        raise RuntimeError("restored (test)")

    monkeypatch.setattr(tune.Tuner, "can_restore", classmethod(lambda cls, path, **kw: True))
    monkeypatch.setattr(tune.Tuner, "restore", classmethod(lambda cls, path, **kw: restore(path, **kw)))
    monkeypatch.setattr(tune, "with_parameters", lambda fn, **kw: fn)  # no object store: no Ray
    monkeypatch.setattr(tune, "with_resources", lambda fn, resources: fn)
    return loaded


@pytest.mark.parametrize("case", ["never recorded", "replaced since", "a link to another file"])
def test_resume_refuses_a_tuner_pkl_this_user_did_not_write(tmp_path, restored, case):
    from workflows.tune.search import run_tune

    cfg = _cfg(tmp_path)
    marker = tmp_path / "ran"
    hostile = pickle.dumps(Payload(str(marker)))
    uri = _experiment(tmp_path, cfg, b"the state this user's tune wrote" if case != "never recorded" else hostile)
    if case != "never recorded":
        remember_tuner_state(cfg, uri, CTX)
        if case == "replaced since":
            _experiment(tmp_path, cfg, hostile)
        else:
            (tmp_path / "elsewhere.pkl").write_bytes(hostile)
            os.unlink(f"{uri}/{TUNER_PKL}")
            os.symlink(tmp_path / "elsewhere.pkl", f"{uri}/{TUNER_PKL}")
    with pytest.raises(UserError) as e:
        run_tune(cfg, CTX, data=None, resume=True)
    assert len(str(e.value).splitlines()) == 1 and TUNER_PKL in str(e.value), str(e.value)
    assert restored == [] and not marker.exists()


def test_resume_reads_the_tuner_pkl_this_users_tune_wrote(tmp_path):
    cfg = _cfg(tmp_path)
    uri = _experiment(tmp_path, cfg, pickle.dumps({"state": 1}))
    remember_tuner_state(cfg, uri, CTX)
    check_tuner_state(cfg, uri, CTX)  # no error
    record = next((tmp_path / "cache" / "tune-state").iterdir())
    assert oct(record.stat().st_mode & 0o777) == "0o600"
    assert oct(record.parent.stat().st_mode & 0o777) == "0o700"

"""`tune --resume` reads Ray Tune's `tuner.pkl` only where this user's own `tune` wrote it.

Ray Tune 2.60 restores a search with `Tuner.restore`, which unpickles the experiment's `tuner.pkl`
(and cloudpickled fields of its experiment and trial state) from the experiment folder in the bucket;
Ray has no reader of that state without the pickle. So the pickle the resume would load is checked
first, with its bytes read as bytes: when a fresh `tune` creates the experiment, the sha256 of the
`tuner.pkl` Ray wrote is kept on this machine, in the user's cache (a folder only they can read,
outside the bucket); `--resume` refuses a `tuner.pkl` whose bytes are not those, and on a local store
one that is not a plain file of this user's in the experiment's own folder. What this leaves open is
in docs/guides/security.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from workflows.errors import UserError
from workflows.storage.atomic import atomic_write
from workflows.storage.uri import StorageContext, filesystem, join, protocol_of, reaching

TUNER_PKL = "tuner.pkl"  # ray.tune.impl.tuner_internal._TUNER_PKL
MAX_TUNER_PKL_BYTES = 256 << 20


def _record(cfg, experiment_uri: str) -> Path:
    key = hashlib.sha256(experiment_uri.encode()).hexdigest()[:24]
    return Path(cfg.cache.resolved_dir()) / "tune-state" / f"{key}.json"


def _digest(experiment_uri: str, storage: StorageContext) -> str:
    """sha256 of the experiment's tuner.pkl, its bytes read as bytes (never unpickled)."""
    uri = join(experiment_uri, TUNER_PKL)
    fs, path = filesystem(uri, storage)
    with reaching(uri, storage), fs.open(path, "rb") as f:
        data = f.read(MAX_TUNER_PKL_BYTES + 1)
    if len(data) > MAX_TUNER_PKL_BYTES:
        raise UserError(f"--resume: {uri} is over {MAX_TUNER_PKL_BYTES} bytes: refused")
    return hashlib.sha256(data).hexdigest()


def remember_tuner_state(cfg, experiment_uri: str, storage: StorageContext) -> None:
    """After a fresh Tuner wrote the experiment's tuner.pkl: keep its sha256 in this user's cache."""
    record = _record(cfg, experiment_uri)
    record.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(record.parent, 0o700)
    atomic_write(record, json.dumps({"experiment": experiment_uri, "sha256": _digest(experiment_uri, storage)}))
    os.chmod(record, 0o600)


def check_tuner_state(cfg, experiment_uri: str, storage: StorageContext) -> None:
    """Before `Tuner.restore` unpickles it: the experiment's tuner.pkl is the one this user's `tune`
    wrote (its sha256 as kept by `remember_tuner_state`), and on a local store a plain file of this
    user's in the experiment's own folder. Else a one-line UserError; a missing one is left to
    `Tuner.can_restore`."""
    uri = join(experiment_uri, TUNER_PKL)
    if protocol_of(uri) == "file":
        path = filesystem(uri, storage)[1]
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():  # lstat: a link is no plain file
            raise UserError(f"--resume: {uri} is not a plain file of this user's in the experiment's folder (owner "
                            f"uid {st.st_uid}, this user's {os.getuid()}): refused, as Ray Tune unpickles it")
    else:
        fs, path = filesystem(uri, storage)
        with reaching(uri, storage):
            if not fs.exists(path):
                return
    record = _record(cfg, experiment_uri)
    try:
        kept = json.loads(record.read_text())
    except (OSError, ValueError):
        raise UserError(f"--resume: {uri} was not written by a `workflows tune` of this user on this machine (no "
                        f"record in {record.parent}): refused, as Ray Tune unpickles it; start the search again "
                        "without --resume") from None
    if kept.get("sha256") != _digest(experiment_uri, storage):
        raise UserError(f"--resume: {uri} is not the tuner.pkl this user's `workflows tune` wrote (its sha256 "
                        "differs): refused, as Ray Tune unpickles it; start the search again without --resume")

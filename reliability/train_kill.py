"""train_worker_kill: a Ray Train worker SIGKILLed mid-epoch; the run restarts from its last
checkpoint, completes, and its losses equal those of an uninterrupted run. And a crash during
checkpoint upload: the run's last checkpoint is copied under a newer name without one rank's
shard (what a crash while the ranks upload leaves: rank 0's .metadata and train_state.json are
there); `--resume` must still pick the previous complete checkpoint, never the cut one.

Tiny quickstart settings on a local 2-CPU Ray cluster and the embedded S3 endpoint: an
uninterrupted 2-epoch FSDP2 run on 2 workers, then the same run with worker rank 1 SIGKILLed at
its second step of epoch 1 (faults.TrainFault, passed as fit's on_step). Lost = a
completed run whose per-step losses differ from the reference (it trained on something else) or
whose final checkpoint is not a complete, finite checkpoint of the last epoch.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from reliability import make_row
from reliability.faults import TrainFault
from tests.helpers import tiny_overrides

RTOL, ATOL = 1e-4, 1e-5  # as tests/test_train_resume.py: same process, seeds and data order


def train_worker_kill(workdir: Path, seed: int = 0) -> dict:
    import numpy as np
    import torch

    from workflows.config import load_config
    from workflows.pipeline.stages import stage_preprocess
    from workflows.runtime import runtime
    from workflows.train.checkpoint import consolidated_model_state, read_state
    from workflows.train.export import download_checkpoint
    from workflows.train.trainer import fit, latest_checkpoint

    workdir = Path(workdir)
    t0 = time.time()
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "quickstart.yaml", [
        *tiny_overrides(workdir), "train.epochs=2", f"train.seed={seed}", "train.num_workers=2", "train.strategy=fsdp",
        "train.num_to_keep=2", "train.max_failures=1", "ray.num_cpus=2", "tune.enabled=false", "serve.enabled=false",
    ])
    marker = workdir / "killed-once"
    notes: list[str] = []
    failed = lost = 0
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        reference = fit(cfg, rt.storage, data, run_prefix="reference")
        kill = TrainFault(epoch=1, step=1, rank=1, action="kill", once=str(marker))
        try:
            out = fit(cfg, rt.storage, data, run_prefix="killed", on_step=kill)
        except Exception as e:  # noqa: BLE001 - the row reports it
            out = None
            failed = 1
            notes.append(f"the run did not complete: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        injected = int(marker.exists())
        if out is not None:
            epochs = [h["epoch"] for h in out.history]
            resumed = [h.get("resumed_from_epoch") for h in out.history]
            same = all(np.allclose(a["step_losses"], b["step_losses"], rtol=RTOL, atol=ATOL)
                       for a, b in zip(out.history, reference.history))
            latest = latest_checkpoint(cfg, rt.storage, "killed")
            assert latest is not None, "the resumed run left no complete checkpoint"
            with tempfile.TemporaryDirectory() as d:
                local = download_checkpoint(latest, rt.storage, d)
                last_epoch = read_state(local)["epoch"]
                finite = all(torch.isfinite(v).all() for v in consolidated_model_state(local).values()
                             if v.is_floating_point())
            cut_ok = _cut_upload_is_passed_over(cfg, rt.storage, "killed")
            notes.append("a checkpoint cut short in upload (one shard missing, newer name) is "
                         + ("passed over by --resume, which takes the previous complete one" if cut_ok
                            else "TAKEN by --resume"))
            notes.append(
                f"epochs {epochs}, restarted from epoch {resumed[-1]}'s checkpoint; per-step losses "
                f"{'equal' if same else 'DIFFER from'} the uninterrupted run's (rtol {RTOL}); final checkpoint: "
                f"epoch {last_epoch}, {'finite' if finite else 'NON-FINITE'} weights"
            )
            if epochs != [0, 1] or not same or last_epoch != 1 or not finite or not cut_ok:
                lost = 1
    if not injected:
        notes.append("the fault never fired")
    detail = (
        f"2-epoch FSDP2 run on 2 Ray Train workers (tiny quickstart), worker rank 1 SIGKILLed at step 2 of "
        f"epoch 1 ({injected} kill); " + "; ".join(notes)
    )
    return make_row(
        "train_worker_kill",
        injected=injected,
        survived=int(injected and not failed and not lost),
        failed=failed if injected else 1,
        allowed_failures=0,
        lost=lost,
        detail=detail,
        seconds=round(time.time() - t0, 1),
    )


def _cut_upload_is_passed_over(cfg, storage, prefix: str) -> bool:
    """Copy the newest checkpoint of run `prefix-*` under a newer name, less one non-zero rank's
    shard; True if latest_checkpoint still returns the original."""
    from workflows.storage.uri import filesystem
    from workflows.train.checkpoint import STATE_FILE
    from workflows.train.trainer import latest_checkpoint

    good = latest_checkpoint(cfg, storage, prefix)
    assert good is not None, f"no complete checkpoint of a run {prefix}-*"
    fs, path = filesystem(good, storage)
    files = json.loads(fs.cat_file(f"{path}/{STATE_FILE}"))["files"]
    shard = next(n for n in sorted(files) if n.endswith(".distcp") and not n.startswith("__0_"))
    cut = f"{path.rsplit('/', 1)[0]}/checkpoint_9999-12-31_23-59-59"
    for f in fs.ls(path, detail=False):
        if f.rsplit("/", 1)[-1] != shard:
            fs.copy(f, f"{cut}/{f.rsplit('/', 1)[-1]}")
    return latest_checkpoint(cfg, storage, prefix) == good

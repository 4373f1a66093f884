"""train.loader=stream under Ray Train: each sample exactly once per epoch with 2 workers, and a
run stopped at ~40% of its epoch continues from its last step checkpoint with the rest of the
epoch's samples in the same order as an uninterrupted run, on the same or another number of
workers (2 -> 1, 1 -> 2), restarted by Ray Train or resumed with `--resume`.

Real parts: the session's 2-CPU Ray cluster, the digits dataset preprocessed on it into the
embedded S3 endpoint, the small CNN under FSDP2, faults raised inside the workers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from reliability.faults import TrainFault
from tests.stream_lineage import DIGITS, ROWS, lineage, overrides
from workflows.config import load_config
from workflows.loader import epoch_order, parquet_index
from workflows.pipeline.stages import stage_preprocess
from workflows.runtime import runtime
from workflows.train.stream_input import SampleRecorder, head
from workflows.train.trainer import fit


@pytest.fixture(scope="module")
def digits(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream")
    cfg = load_config(DIGITS, overrides(tmp))
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        index = head(parquet_index(data.files["train"], rt.storage), ROWS)
        expected = epoch_order(index.counts, cfg.train.seed, 0, cfg.train.shuffle_window).tolist()
        yield SimpleNamespace(tmp=tmp, rt=rt, data=data, expected=expected)


def run(digits, name: str, workers: int, *extra: str, resume: bool = False, on_step=None):
    cfg = load_config(DIGITS, overrides(digits.tmp, f"train.num_workers={workers}", *extra))
    record = digits.tmp / name
    record.mkdir(exist_ok=True)
    return fit(cfg, digits.rt.storage, digits.data, run_prefix=name, resume=resume, on_step=on_step,
               on_samples=SampleRecorder(str(record)))


@pytest.mark.integration
def test_two_workers_see_each_sample_once_in_the_global_order(digits):
    out = run(digits, "once", 2)
    ids = lineage(digits.tmp / "once")
    assert sorted(ids) == sorted(digits.expected) and len(set(ids)) == ROWS
    assert ids == digits.expected  # the epoch's one order, as the loader defines it for any worker count
    h = out.history[0]
    assert h["steps"] == 5 and h["step_checkpoints"] == 2 and h["step_checkpoint_seconds"] > 0


@pytest.mark.integration
# a variant of the elastic run below (Ray Train restarts the group from the 40% step checkpoint, there on
# fewer workers, here on as many), which the gate runs
@pytest.mark.extended
def test_a_restarted_worker_group_continues_mid_epoch(digits):
    marker = digits.tmp / "raised-once"
    # raise in rank 1 before step 2 of 5 (40%): Ray Train restarts the group from the checkpoint after step 2
    out = run(digits, "restart", 2, on_step=TrainFault(epoch=0, step=2, rank=1, action="raise", once=str(marker)))
    assert marker.exists()
    assert out.history[0]["resumed_at_sample"] == 64 and out.history[0]["resumed_from_epoch"] == 0
    assert lineage(digits.tmp / "restart") == digits.expected


@pytest.mark.parametrize("before,after", [(2, 1), pytest.param(1, 2, marks=pytest.mark.extended)])
@pytest.mark.integration
def test_resume_mid_epoch_on_another_worker_count(digits, before, after):
    name = f"w{before}to{after}"
    marker = digits.tmp / f"{name}-raised"
    stop_step = 2 if before == 2 else 4  # 40% of the epoch: 64 samples
    with pytest.raises(Exception, match="injected fault"):
        run(digits, name, before, "train.max_failures=0",
            on_step=TrainFault(epoch=0, step=stop_step, rank=0, action="raise", once=str(marker)))
    out = run(digits, name, after, resume=True)
    assert out.history[0]["resumed_at_sample"] == 64
    assert lineage(digits.tmp / name) == digits.expected


def crops(digits, workers: int, start: int, *extra: str) -> dict[int, bytes]:
    """Each sample's training input (the task's training collate, as the trainer calls it) from
    global position `start` of epoch 1, as `workers` ranks see it, by sample id."""
    from workflows.tasks import get_task
    from workflows.train.stream_input import StreamInput

    cfg = load_config(DIGITS, overrides(digits.tmp, "train.loader_workers=0", *extra))
    out: dict[int, bytes] = {}
    for rank in range(workers):
        ids: list[list[int]] = []
        stream = StreamInput(cfg, digits.data, digits.rt.storage, rank, workers, ROWS,
                             lambda _r, _e, _p, batch: ids.append(batch), get_task(cfg))
        for k, batch in enumerate(stream.train_batches(1, start)):
            out.update(zip(ids[k], (x.numpy().tobytes() for x in batch["pixel_values"])))
    return out


@pytest.mark.parametrize("image_input", [pytest.param("pixels", marks=pytest.mark.extended), "raw"])
@pytest.mark.integration
def test_training_crops_follow_the_sample_not_the_rank(digits, image_input):
    """An elastic 2 -> 1 resume mid-epoch: the samples the one worker trains on get the crops the
    two would have given them (augmentation seeded by seed, epoch and sample, never the rank)."""
    two, one = crops(digits, 2, 64, f"model.options.image_input={image_input}"), \
        crops(digits, 1, 64, f"model.options.image_input={image_input}")
    assert sorted(two) == sorted(one) and len(one) == ROWS - 64
    assert all(two[i] == one[i] for i in one)
    other_seed = crops(digits, 1, 0, f"model.options.image_input={image_input}", "train.seed=1")  # the whole epoch
    assert sum(other_seed[i] != one[i] for i in one) > len(one) // 2  # the crops are drawn, not fixed


@pytest.mark.integration
def test_torchrun_trains_on_the_raw_images_a_ray_train_worker_reads(digits, monkeypatch):
    """model.options.image_input=raw under torchrun (one process, workflows.train.standalone): the epoch's
    crops of the source's images, batch by batch those of a Ray Train worker (StreamInput), not
    the stored pixels (tests/test_local_input.py checks the parquet stream and Tune trials)."""
    from tests.test_local_input import trained_batches
    from workflows.tasks import get_task
    from workflows.train.standalone import train
    from workflows.train.stream_input import StreamInput

    cfg = load_config(DIGITS, overrides(digits.tmp, "model.options.image_input=raw", "train.loader_workers=0"))
    epochs = trained_batches(monkeypatch, lambda b: b["pixel_values"].numpy().tobytes())
    train(cfg, digits.rt.storage, digits.data)
    worker = StreamInput(cfg, digits.data, digits.rt.storage, 0, 1, ROWS, task=get_task(cfg))
    assert epochs == [[b["pixel_values"].numpy().tobytes() for b in worker.train_batches(0, 0)]]


@pytest.mark.integration
def test_raw_images_train_from_the_tars_each_sample_once(digits):
    """model.options.image_input=raw under Ray Train (2 workers, a decode process each): the train split's
    samples read from the source's tars by the saved index, each exactly once in the epoch."""
    from workflows.preprocess.image_dataset import TRAIN_SAMPLES
    from workflows.storage.uri import exists, join

    out = run(digits, "raw", 2, "model.options.image_input=raw", "train.loader_workers=1")
    ids = lineage(digits.tmp / "raw")
    assert sorted(ids) == list(range(ROWS))
    assert exists(join(digits.data.uri, TRAIN_SAMPLES), digits.rt.storage)  # saved: the next run reuses it
    assert out.history[0]["steps"] == 5 and out.history[0]["val_f1"] >= 0


def elastic_run(directory: Path) -> subprocess.CompletedProcess:
    """tests/elastic_run.py in a process of its own; it stops a run that hangs after 8 minutes (a run takes
    1.5-3), printing each process's stacks, and exits 3."""
    directory.mkdir()
    script = Path(__file__).with_name("elastic_run.py")
    return subprocess.run([sys.executable, str(script), str(directory)], capture_output=True, text=True, timeout=900)


def failure_report(res: subprocess.CompletedProcess) -> str:
    """The script's output, the Train controller's log lines, and the end of its log."""
    controller = [ln for ln in res.stderr.splitlines() if "TrainController" in ln]
    return "\n".join([res.stdout[-20000:], *controller[-80:], res.stderr[-3000:]])


@pytest.mark.integration
def test_an_elastic_run_that_loses_a_worker_continues_on_fewer(tmp_path):
    """train.num_workers=[1, 2] on two 2-CPU nodes (a worker each); the second node is removed mid-epoch (past the
    40% step checkpoint): the run finishes on one worker, and the epoch's final lineage sees each
    sample once, in the epoch's order."""
    res = elastic_run(tmp_path / "run")
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert res.returncode == 0 and line, failure_report(res)
    out = json.loads(line[len("RESULT "):])
    assert out["removed"]
    assert out["lineage"] == out["expected"], out["files"]
    # two workers before the loss, one after, continuing from the step checkpoint at 64 samples (the ranks
    # wait there until the node has gone)
    files = sorted(out["files"], key=lambda f: f["first_t"])
    assert len(files) == 3 and files[2]["first_t"] > max(files[0]["first_t"], files[1]["first_t"]), files
    resumed_at = out["history"][0]["resumed_at_sample"]
    assert resumed_at == 64 and files[2]["positions"][0] == resumed_at, (resumed_at, files)

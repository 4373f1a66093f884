"""`train.num_workers: auto` (workflows.train.layout): the layout chosen for the cluster's nodes, the
config's forms, a group of one training the plain model, and the threads a worker runs. No Ray: the
nodes are the free-resource figures Ray reports per node; the pipeline's own run (tests/test_quickstart*)
shows the chosen layout on a real cluster."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from workflows.config import WorkflowConfig, load_config
from workflows.errors import UserError
from workflows.train.layout import choose
from workflows.train.worker_setup import set_torch_threads


def train_cfg(**train):
    return WorkflowConfig.model_validate({"data": {"source": "/tmp/raw"}, "train": train}).train


def test_auto_is_the_default_and_numbers_and_ranges_stay_as_given():
    assert train_cfg().num_workers == "auto" and not train_cfg().elastic
    assert load_config("quickstart").train.num_workers == "auto"
    assert train_cfg(num_workers=3).max_workers == 3
    assert train_cfg(num_workers=[1, 2], loader="stream").elastic
    with pytest.raises(ValueError, match="train.num_workers is auto: the number is chosen when the run starts"):
        train_cfg().max_workers  # noqa: B018 - a run resolves auto before it counts workers
    with pytest.raises(ValueError, match="train.num_workers"):
        train_cfg(num_workers="some")


@pytest.mark.parametrize("nodes, use_gpu, expected, why", [
    ([{"CPU": 2.0}], False, {"num_workers": 1, "cpus_per_worker": 2.0}, "one worker with the 2 CPUs free on the node"),
    ([{"CPU": 8.0, "memory": 1e9}, {"CPU": 4.0}, {"GPU": 0.0}], False, {"num_workers": 2, "cpus_per_worker": 4.0},
     "one worker per node (2), 4 CPUs each"),
    ([{"CPU": 0.5}, {"CPU": 3.0}], False, {"num_workers": 1, "cpus_per_worker": 3.0}, "the 3 CPUs free"),
    ([{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}], True, {"num_workers": 3}, "one worker per GPU"),
])
def test_the_layout_chosen_for_the_clusters_nodes(nodes, use_gpu, expected, why):
    update, said = choose(train_cfg(use_gpu=use_gpu), nodes)
    assert update == expected and why in said


@pytest.mark.parametrize("nodes, use_gpu, error", [
    ([{"CPU": 0.0}], False, "no node of the Ray cluster has a CPU free"),
    ([{"CPU": 4.0}], True, "has no GPU free"),
])
def test_nothing_to_train_on_is_said_in_one_line(nodes, use_gpu, error):
    with pytest.raises(UserError, match=error):
        choose(train_cfg(use_gpu=use_gpu), nodes)


def test_a_group_of_one_trains_the_plain_model():
    """One worker: nothing to shard or reduce; the model is not wrapped (FSDP2 would gather and reduce it
    with itself every step)."""
    from torch.distributed.fsdp import FSDPModule

    from workflows.parallel import parallelize

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            for strategy in ("fsdp", "ddp"):
                wrapped = parallelize(model, strategy, torch.device("cpu"))
                assert wrapped is model and not isinstance(wrapped, FSDPModule)
        finally:
            dist.destroy_process_group()


def test_a_worker_runs_a_thread_per_cpu_up_to_its_cores(monkeypatch):
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        set_torch_threads(train_cfg(num_workers=1, cpus_per_worker=cores + 6))
        assert torch.get_num_threads() == cores  # logical CPUs beyond the cores would only wait
        set_torch_threads(train_cfg(num_workers=1, cpus_per_worker=1))
        assert torch.get_num_threads() == 1
        set_torch_threads(train_cfg(num_workers=1, cpus_per_worker=1, torch_threads=3))
        assert torch.get_num_threads() == 3  # as the config says
    finally:
        torch.set_num_threads(before)


@pytest.mark.integration
def test_auto_trains_one_worker_with_the_clusters_cpus(ray_cluster, tiny_cfg):
    """On the session's real cluster (one node, 2 CPUs): auto resolves to one worker holding both, `fit` trains
    it (the plain model in a group of one), checkpoints and validates as any layout does."""
    from workflows.pipeline.stages import stage_preprocess
    from workflows.runtime import runtime
    from workflows.train.layout import resolved
    from workflows.train.trainer import fit

    cfg = tiny_cfg("train.num_workers=auto")
    with runtime(cfg) as rt:
        chosen, why = resolved(cfg)
        assert (chosen.train.num_workers, chosen.train.cpus_per_worker) == (1, 2.0), why
        assert why.startswith("one worker with the 2 CPUs free on the node")
        data = stage_preprocess(rt)
        out = fit(cfg, rt.storage, data)
        rows = min(data.counts["train"], cfg.train.max_train_rows or data.counts["train"])
        assert out.history[-1]["samples"] == rows  # one worker saw every row of the epoch
        assert out.best_checkpoint_uri.startswith("s3://workflows/runs/") and 0 <= out.best_metrics["val_f1"] <= 1


@pytest.mark.integration
def test_one_worker_of_cpus_trains_in_one_actor_and_goes_on_after_its_death(ray_cluster, tiny_cfg, tmp_path,
                                                                             monkeypatch):
    """auto's one worker of CPUs trains in one actor, not under Ray Train (no Train controller starts): killed in
    its second epoch, a new actor goes on from the first epoch's checkpoint, and the run keeps its newest
    checkpoint only (num_to_keep 1, checkpoint_select last), which export reads as Ray Train's."""
    from reliability.faults import TrainFault
    from workflows.pipeline.stages import stage_preprocess
    from workflows.runtime import runtime
    from workflows.storage.uri import filesystem
    from workflows.train import trainer
    from workflows.train.checkpoint import consolidated_model_state
    from workflows.train.export import download_checkpoint

    def no_ray_train(*args, **kwargs):
        raise AssertionError("auto's one worker of CPUs started Ray Train's TorchTrainer")

    monkeypatch.setattr(trainer, "_torch_trainer", no_ray_train)
    cfg = tiny_cfg("train.num_workers=auto", "train.epochs=3", "train.max_failures=1", "train.checkpoint_select=last")
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        out = trainer.fit(cfg, rt.storage, data, run_prefix="in-actor",
                          on_step=TrainFault(epoch=1, step=0, action="kill", once=str(tmp_path / "fired")))
        assert (tmp_path / "fired").exists()  # the fault fired: the first actor died in epoch 1
        assert [h["epoch"] for h in out.history] == [0, 1, 2]
        assert [h["resumed_from_epoch"] for h in out.history] == [None, 0, 0]  # the new actor went on from epoch 0
        assert out.best_metrics["epoch"] == 2 and out.history[-1]["samples"] == cfg.train.max_train_rows
        fs, path = filesystem(out.run_uri, rt.storage)
        kept = [name for name in (p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
                if name.startswith("checkpoint_")]
        assert len(kept) == 1 and out.best_checkpoint_uri.endswith("/" + kept[0])
        with tempfile.TemporaryDirectory() as d:
            assert consolidated_model_state(download_checkpoint(out.best_checkpoint_uri, rt.storage, d))

"""Ray Train on 2 CPU workers (a real local cluster): FSDP2 and DDP, checkpoints in S3, export."""

import tempfile

import numpy as np
import pytest
import torch

from tests.helpers import free_port
from workflows import registry
from workflows.errors import UserError
from workflows.pipeline.stages import export_artifact, stage_preprocess
from workflows.runtime import runtime
from workflows.tasks.text.predictor import TextPredictor
from workflows.tracking.run_logger import TrackingSpec
from workflows.train.checkpoint import consolidated_model_state, read_state
from workflows.train.export import download_checkpoint
from workflows.train.loop import steps_per_epoch
from workflows.train.trainer import check_resources, fit, select_checkpoint

# FSDP also runs with gradient accumulation and activation checkpointing switched on, and hands on
# the last epoch's checkpoint; DDP with the mean-pooling head (DDP fails on a parameter left without
# a gradient), its own learning rate and the head fitted by a linear probe over both workers' rows
# first (LP-FT), and hands on the best epoch's
# FSDP's case is extended: the gate's pipelines train, checkpoint and export under FSDP2 on 2 workers
FSDP_EXTRA = ["train.grad_accum_steps=2", "train.activation_checkpointing=true", "train.checkpoint_select=last",
              "train.num_to_keep=2"]


@pytest.mark.parametrize("strategy,extra", [pytest.param("fsdp", FSDP_EXTRA, marks=pytest.mark.extended),
                                            ("ddp", ["model.options.pooling=mean", "model.options.head_lr=1e-3",
                                                     "model.options.head_init=linear_probe"])])
@pytest.mark.integration
def test_two_workers_train_checkpoint_and_export(ray_cluster, tiny_cfg, strategy, extra):
    cfg = tiny_cfg(f"train.strategy={strategy}", "train.epochs=2", *extra)
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        # rank 0 is handed a run on a tracking server that is not there: one warning, training goes on
        dead = TrackingSpec(f"http://127.0.0.1:{free_port()}", "0" * 32, "1")
        out = fit(cfg, rt.storage, data, tracking=dead)
        rows = min(data.counts["train"], cfg.train.max_train_rows or data.counts["train"])
        assert out.history[-1]["steps"] == steps_per_epoch(rows, 2, cfg.train.batch_size, cfg.train.grad_accum_steps)
        assert out.best_checkpoint_uri.startswith("s3://workflows/runs/quickstart-train-")
        assert [h["epoch"] for h in out.history] == [0, 1] or out.history[-1]["epoch"] == 1
        m = out.best_metrics
        assert 0 <= m["val_f1"] <= 1 and m["samples"] > 0 and m["train_loss"] > 0
        if cfg.train.checkpoint_select == "last":
            assert m["epoch"] == 1
        else:
            assert m["val_f1"] == max(h["val_f1"] for h in out.history)

        with tempfile.TemporaryDirectory() as ck, tempfile.TemporaryDirectory() as art:
            download_checkpoint(out.best_checkpoint_uri, rt.storage, ck)
            state = consolidated_model_state(ck)
            assert read_state(ck)["epoch"] == m["epoch"]  # the chosen checkpoint is that epoch's
            meta = export_artifact(cfg, rt.storage, data, out.best_checkpoint_uri, art, {"run": out.run_uri})
            assert meta["labels"] == data.labels and meta["lineage"]["dataset_version"] == data.version
            # export -> reload gives the checkpoint's exact weights, hence identical logits
            predictor = TextPredictor(art)
            reloaded = predictor.model.state_dict()
            for k, v in state.items():
                assert torch.equal(reloaded[k], v), k
            ref = registry.register(cfg, rt.storage, art, f"t-{strategy}", meta)
        local, fetched = registry.fetch(cfg, rt.storage, f"t-{strategy}")
        assert fetched.version == ref.version == 1
        rows = [{"text": "Plot a histogram."}, {"text": "Solve a linear system."}]
        a, b = TextPredictor(local).predict(rows), TextPredictor(local).predict(rows)
        assert [p["label"] for p in a] == [p["label"] for p in b]
        assert np.allclose([p["score"] for p in a], [p["score"] for p in b])
        # bf16 (serve.precision for GPU replicas; the same numerics on CPU): the same answers, to bf16's precision
        half = TextPredictor(local, precision="bf16")
        assert next(half.model.parameters()).dtype == torch.bfloat16
        for full, bf in zip(a, half.predict(rows)):  # probabilities, not labels: a near-tie may flip
            assert np.allclose(list(bf["probabilities"].values()), list(full["probabilities"].values()), atol=0.02)


def test_select_checkpoint_best_or_last():
    kept = [("c0", {"epoch": 0, "val_f1": 0.7, "val_loss": 0.9}), ("c2", {"epoch": 2, "val_f1": 0.8, "val_loss": 0.5}),
            ("c1", {"epoch": 1, "val_f1": 0.8, "val_loss": 0.4}), ("c3", {"epoch": 3, "val_f1": 0.75, "val_loss": 0.6})]
    assert select_checkpoint(kept, "best", "val_f1", "max")[0] == "c1"  # the earliest of equals
    assert select_checkpoint(kept, "best", "val_loss", "min")[0] == "c1"
    assert select_checkpoint(kept, "last", "val_f1", "max") == kept[3]


def test_too_many_workers_fail_fast_with_numbers(ray_cluster):
    with pytest.raises(UserError, match=r"3 worker\(s\) x 1 CPU = 3 CPUs, but the Ray cluster has 2"):
        check_resources(3, 1, False)
    with pytest.raises(UserError, match="GPU"):
        check_resources(1, 1, True)


def test_not_a_model_directory(tmp_path):
    from workflows.preprocess.encoding import resolve_model_dir

    with pytest.raises(UserError, match="not a model directory"):
        resolve_model_dir(str(tmp_path))

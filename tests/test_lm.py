"""Causal-LM pretraining: packing, the GPT model from a preset, FLOPs/MFU, Ray Train FSDP2 on
2 CPU workers, and the torchrun benchmark (CPU here; the GPU figures come from a GPU machine)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from workflows.errors import UserError
from workflows.tasks.causal_lm.model import (
    build_causal_lm,
    flops_per_token,
    model_shape,
    pack_blocks,
    padded_vocab,
    peak_for_name,
)

ROOT = Path(__file__).resolve().parents[1]


def lm_cfg(size: str, seq_len: int = 1024):
    return SimpleNamespace(size=size, n_layer=None, n_embd=None, n_head=None, seq_len=seq_len)


def test_packing_concatenates_rows_and_drops_the_short_tail():
    blocks = pack_blocks([np.arange(0, 5), np.arange(5, 12), np.arange(12, 14)], 4)
    assert blocks.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert pack_blocks([np.arange(3)], 4).shape == (0, 4)


def test_gpt2_124m_preset_has_gpt2s_parameters_and_flops():
    """GPT-2 small (tied embeddings: 124,439,808 parameters) with its vocabulary padded from 50,257 to
    50,304 rows (a multiple of 64, as nanoGPT pads it): 47 x 768 parameters more, which the output head's
    matmul computes, so the FLOPs count them."""
    with torch.device("meta"):
        model = build_causal_lm(lm_cfg("gpt2-124m"), vocab_size=50257)
    assert model.config.vocab_size == padded_vocab(50257) == 50304 and padded_vocab(64) == 64
    gpt2 = 124_439_808 + 47 * 768
    assert sum(p.numel() for p in model.parameters()) == gpt2
    params, layers, hidden = model_shape(model)
    assert (params, layers, hidden) == (gpt2 - 1024 * 768, 12, 768)  # position table: a lookup
    assert flops_per_token(params, layers, hidden, 1024) == 6 * params + 12 * 12 * 768 * 1024


def test_peak_table_knows_the_datacenter_gpus():
    assert peak_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_for_name("NVIDIA H200") == 989e12
    assert peak_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_for_name("Some Future GPU") is None


def test_heads_must_divide_hidden(tmp_path):
    from workflows.config import load_config
    from workflows.tasks import get_task

    cfg = load_config(None, ["data.source=x", "model.task=causal_lm", "model.options.size=tiny",
                             "model.options.n_head=3"])
    with pytest.raises(UserError, match="hidden size 64 is not divisible by 3 heads"):
        get_task(cfg).check_config()


def test_pipeline_and_tuning_refuse_a_causal_lm(tiny_cfg):
    from workflows.pipeline.stages import registering_task_only

    with pytest.raises(UserError, match="workflows train"):
        registering_task_only(tiny_cfg("model.task=causal_lm"), "tuning")


@pytest.mark.integration
def test_ray_train_pretrains_a_causal_lm_with_fsdp(ray_cluster, tiny_cfg):
    from workflows.pipeline.stages import stage_preprocess
    from workflows.runtime import runtime
    from workflows.train.trainer import fit

    # train.loader=ray_data: the quickstart's stream loader reads stored rows, an LM trains on blocks made from them
    cfg = tiny_cfg("model.task=causal_lm", "model.options={size: tiny, seq_len: 32}", "train.strategy=fsdp",
                   "train.loader=ray_data",
                   "train.epochs=3", "train.lr=3e-3", "train.max_train_rows=1000", "train.warmup_fraction=0")
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        out = fit(cfg, rt.storage, data)
    losses = [h["val_loss"] for h in out.history]
    assert len(losses) == 3 and losses[-1] < losses[0] < math.log(30522) + 1  # it learns the text's tokens
    assert out.best_metrics["val_loss"] == min(losses)  # checkpoints ranked by validation loss
    assert out.history[-1]["val_perplexity"] == pytest.approx(math.exp(losses[-1]), rel=1e-6)
    assert "val_f1" not in out.history[-1] and out.history[-1]["tokens_per_s"] > 0
    assert "mfu" not in out.history[-1]  # CPU: no peak to divide by


@pytest.mark.extended  # the LM benchmark's own rows (test_ray_train_pretrains_a_causal_lm_with_fsdp trains the path)
def test_benchmark_under_torchrun_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "lm.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "workflows.bench.lm", "--size", "tiny", "--seq-len", "64", "--micro-batch", "2",
                           "--steps", "3", "--warmup", "1", "--output", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["steps"] == 3 and r["tokens_per_s"] > 0 and r["mfu"] is None
    assert r["tokens_per_s"] == pytest.approx(3 * 2 * 2 * 64 / r["seconds"], rel=0.01)
    assert math.isfinite(r["last_loss"]) and "tokens/s" in proc.stdout


@pytest.mark.parametrize("world_size, code", [("2", 3), ("1", 4)])
def test_exit_rank_keeps_the_exit_code_and_flushes_output(world_size, code):
    """A torchrun rank ends without interpreter finalization (gloo's threads may abort it there): its
    buffered output still arrives and its exit code is kept; one process exits normally."""
    script = ("import sys; from workflows.parallel import exit_rank; print('done', end=''); "
              f"print('warned', file=sys.stderr, end=''); exit_rank({code})")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as under torchrun
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**env, "WORLD_SIZE": world_size})
    assert (proc.returncode, proc.stdout, proc.stderr) == (code, "done", "warned")


def test_freeze_embeddings_applies_to_fine_tuning_only():
    """quickstart.yaml freezes MiniLM's pretrained embeddings (the classification task's
    model.options.freeze_embeddings); the same config pretraining an LM, with the LM's options, does
    not freeze its random ones (tied to the LM head), and the LM takes no such option."""
    from tests.conftest import QUICKSTART
    from workflows.config import load_config
    from workflows.dataset import ProcessedDataset
    from workflows.tasks import get_task
    from workflows.train.loop import build_training

    data = ProcessedDataset(uri="", version="", labels=["a", "b"], label_column="label", files={}, counts={},
                            label_counts={}, source="", tokenizer="minilm")
    common = ["train.strategy=ddp"]
    lm_cfg = load_config(QUICKSTART, [*common, "model.task=causal_lm", "model.options={size: tiny, seq_len: 32}"])
    model, _, _ = build_training(lm_cfg, get_task(lm_cfg), data, torch.device("cpu"), 8)
    assert model.get_input_embeddings().weight.requires_grad
    with pytest.raises(UserError, match="task causal_lm: model.options.freeze_embeddings: unknown option"):
        get_task(load_config(QUICKSTART, [*common, "model.task=causal_lm", "model.options.size=tiny"])).check_config()
    cls_cfg = load_config(QUICKSTART, common)
    assert get_task(cls_cfg).options.freeze_embeddings
    model, _, _ = build_training(cls_cfg, get_task(cls_cfg), data, torch.device("cpu"), 8)
    assert not model.get_input_embeddings().weight.requires_grad

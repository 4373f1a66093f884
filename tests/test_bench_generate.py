"""`workflows bench generate` (#50, #60) on the tiny chat model with tiny settings: the in-process paths
(the engine, static batching) and the one-at-a-time peer, a server process reached by the bench's client
process over HTTP with SSE: every row and key is in the JSON and the doc section (the figures themselves
are the lead's run, on SmolLM2, on a quiet machine). The path through `workflows serve` (Ray) is the
extended test below."""

from __future__ import annotations

import json

import pytest

from tests.chat_serve_task import build_tiny_chat
from tests.conftest import ROOT

TOP_KEYS = ("http_vs_static_c16", "http_vs_static_natural_c16", "itl_p99_over_p50_c16", "ttft_c16_over_c1",
            "decode_vs_roofline", "sampled_vs_greedy", "http_vs_engine_c16", "vs_llama_cpp_c1", "vs_llama_cpp_c16",
            "vs_vllm_c1", "vs_vllm_c16", "itl_p50_vs_vllm_c1", "ttft_c16_vs_best_peer", "lora_vs_base_c16",
            "lora_vs_vllm_lora_c16", "overload_itl_p99_vs_closed_loop")


def bench(tmp_path, *settings: str) -> tuple[dict, str]:
    from benchmarks.record import record

    model = tmp_path / "tiny"
    build_tiny_chat(model)
    overrides = [f"model.name_or_path={model}", f"cache.dir={tmp_path}/cache", "storage.embedded.enabled=false",
                 f"storage.root={tmp_path}/store", "requests=8", "serial_requests=2", "max_tokens=3", "repeats=1",
                 "threads=1", "static_batch=4", "concurrency=1,16", "serve.generate.max_batch=16",
                 "peers=", *settings]  # no harness peer (llama.cpp, vLLM), even where they are built
    doc = tmp_path / "BENCHMARKS.md"
    result = record("generate", str(ROOT / "configs" / "chat.yaml"), overrides, "python -m benchmarks.generate",
                    results_dir=tmp_path, doc=doc)
    stored = json.loads((tmp_path / "generate.json").read_text())
    assert stored == result
    for key in TOP_KEYS:
        assert key in stored and key in stored["goals"] and key in stored["meets_goals"], key
    return stored, doc.read_text()


def check_rows(stored: dict, expected: list[str], repeats: int = 1) -> None:
    assert [r["row"] for r in stored["rows"]] == expected
    for row in stored["rows"]:
        if row["arrivals"] == "closed loop":  # every request answered: 2 at concurrency 1, else 8, each repeat
            assert row["requests"] == (2 if row["concurrency"] == 1 else 8) * repeats, row
        assert row["servers_beside"] == [], row  # no server ran beside another path's row
        if row["lengths"].startswith("fixed"):
            assert row["tokens"] == row["requests"] * 3, row  # every request produced max_tokens: eos ignored
        else:
            assert 0 < row["tokens"] <= row["requests"] * 3, row
        for key in ("tokens_per_s", "ttft_s_p50", "ttft_s_p99", "itl_s_p50", "itl_s_p99"):
            assert row[key] > 0, (row["row"], key)


@pytest.mark.integration  # a server process (the peer) on 127.0.0.1, the client in another
def test_bench_generate_writes_every_row_and_key(tmp_path, monkeypatch):
    import threading

    from workflows.bench import generate

    ran_in: list[str] = []  # the thread of each in-process computation beside the engine's own steps

    def traced(fn):
        return lambda *a, **kw: (ran_in.append(threading.current_thread().name), fn(*a, **kw))[1]

    for name in ("static_run", "matmul_rate", "memory_bandwidth", "transformers_step", "matmul_floor"):
        monkeypatch.setattr(generate, name, traced(getattr(generate, name)))
    stored, text = bench(tmp_path, "paths=engine,static,peer")
    # all in the engine's thread: the process holds one OpenMP pool (a second throttles the engine's steps)
    assert len(ran_in) == 9 and set(ran_in) == {"generate"}, ran_in  # static: 2 warm-ups + 3 rows; 4 probes
    # a warm-up of each kind of row: each path, and on it its own weights (each model, structured output)
    assert stored["warm_ups"] == ["engine_c16", "static", "static_packed", "peer"]
    check_rows(stored, ["engine_c16", "static", "static_natural", "static_packed", "peer"])  # its fp32 linears packed
    assert stored["rows"][-1]["prompt_tokens_mean"] > 0  # as the server counted them
    assert stored["http_vs_static_c16"] is None and stored["meets_goals"]["http_vs_static_c16"] is False
    step = stored["decode_step"]
    # its steps with every row decoding (3 tokens a request may leave none: then its token gaps)
    measured = step["measured_from"].removeprefix("engine_c16 ")
    assert measured in ("decode_step_s_p50", "itl_s_p50") and step["measured_s"] == stored["rows"][0][measured]
    assert step["flops"] > 0 and step["bytes"] > step["weight_bytes"] > 0 and step["bound"] in ("memory", "compute")
    assert stored["decode_vs_roofline"] > 0 and stored["matmul_flops_per_s"] > 0 and stored["memory_bytes_per_s"] > 0
    # transformers' own decode step of 16 rows on the same weights, once a repeat, beside the engine's
    assert len(step["transformers_step_s_runs"]) == 1 and step["transformers_step_s"] > 0
    assert stored["decode_vs_transformers"] == round(step["transformers_step_s"] / step["measured_s"], 3)
    assert "Transformers' own decode step of as many rows" in text
    # the step's matmuls alone: every weight of the tiny Llama once, at 16 rows, on the faster kernel
    assert step["matmul_floor_kernel"] in ("onednn", "mkl") and len(step["matmul_floor_s_runs"]) == 1
    assert stored["decode_vs_matmul_floor"] == round(step["matmul_floor_s"] / step["measured_s"], 3)
    floor = step["matmul_floor_s"]  # against the roofline's step, which is stored to 5 decimals (a tiny model's: µs)
    assert stored["matmul_floor_vs_roofline"] == pytest.approx(step["step_s"] / floor, abs=1e-5 / floor + 1e-3)
    assert "The step's matmuls alone" in text and "| decode_vs_matmul_floor |" in text
    assert "## Generation: ours over HTTP beside the engine, static batching and peers" in text
    assert "| engine_c16 |" not in text and "| engine | ours: the engine called directly" in text
    assert "| decode_vs_roofline |" in text and "| http_vs_static_c16 |" not in text  # a key without its rows: named
    left_out = text.split("Not measured in this run (their rows were left out): ")[1].split(".")[0].split(", ")
    assert left_out[0] == "http_vs_static_c16" and "ttft_p50_vs_peer" in left_out  # the keys first


@pytest.mark.extended  # `workflows serve` in its own process: a Ray cluster and Serve (a minute or more)
def test_bench_generate_through_workflows_serve(tmp_path):
    stored, text = bench(tmp_path, "paths=http,engine,static", "load=0.9", "overload=4", "overload_requests=12",
                         "repeats=2")
    check_rows(stored, ["http_c1", "http_c16", "http_sampled_c16", "http_natural_c16", "http_json_c1", "http_json_c16",
                        "http_lora_c16", "http_mixed_c16", "http_poisson", "http_overload", "engine_c16", "static",
                        "static_natural", "static_packed"], repeats=2)
    # `workflows serve` is up for its own rows alone: started for each repeat's, stopped before the engine's
    assert stored["http_starts"] == 2 and "(2 starts, each warmed as the first)" in text
    # the second repeat mirrors the first: the other rows first, in reverse, then the HTTP rows (the server started
    # again for them): each row's mean time in the run about its middle
    http, others = stored["order"][0][:10], stored["order"][0][10:]
    assert all(k.startswith("http_") for k in http) and others == ["engine_c16", "static", "static_natural",
                                                                   "static_packed"]
    assert stored["order"][1] == others[::-1] + http and "Every second repeat ran the rows mirrored" in text
    # the adapter's rows: requests naming bench-lora (a LoRA adapter of bench-base), alone and in turn with the base
    assert [r["models"] for r in stored["rows"][6:8]] == ["adapter", "mixed"]
    assert stored["lora_vs_base_c16"] > 0 and stored["mixed_vs_base_c16"] > 0
    # the adapter is loaded by the first request naming it: in a warm-up, not in the first repeat's row
    assert stored["warm_ups"] == ["http_c1", "http_json_c1", "http_lora_c16", "http_mixed_c16", "engine_c16", "static",
                                  "static_packed"]
    for key in ("http_vs_static_c16", "http_vs_static_natural_c16", "http_vs_static_packed_c16",
                "itl_p99_over_p50_c16", "ttft_c16_over_c1", "overload_itl_p99_vs_closed_loop",
                "sampled_vs_greedy", "http_vs_engine_c16", "json_schema_vs_unconstrained_c1",
                "json_schema_vs_unconstrained_c16"):
        assert stored[key] > 0, key
    assert stored["rows"][4]["output"] == "json_schema" and stored["rows"][1]["output"] == "unconstrained"
    overload = stored["rows"][9]
    assert overload["requests"] + overload["refused"] == 2 * 12 and stored["overload_requests"] == 12
    # the slowest refusals, each placed in its repeat's run (none where every request was answered)
    slowest = overload["refused_slowest"]
    assert len(slowest) == min(overload["refused"], 5), slowest
    assert all(0 <= x["sent_s"] <= x["run_s"] and x["repeat"] in (0, 1) for x in slowest), slowest
    assert not slowest or slowest[0]["answer_s"] == overload["refused_answer_s_max"]
    assert stored["model"] == "bench-base:1" and "workflows serve --model bench-base:1" in stored["servers"]["http"]


def test_the_attention_named_is_the_served_engines_whatever_this_process_loaded():
    """A run without in-process paths loads the plain transformers model (eager attention) for its
    sizes; the server computed with the engine's: that is what the section names."""
    from workflows.bench.generate_report import served_attention
    from workflows.config import load_config
    from workflows.tasks.chat.engine.cache import ATTENTION

    assert served_attention(load_config("chat", [])) == ATTENTION
    assert served_attention(load_config("chat", ["serve.generate.engine=vllm"])) == "vllm's own"


def test_a_figure_is_described_at_the_concurrency_the_run_measured_it():
    """A variant run at other levels (`--set concurrency=1`) names its figures at those levels, not at 16."""
    from benchmarks.generate import TEXT, describe

    engine = "over HTTP with SSE against the engine called directly"
    assert describe("http_vs_engine_c16", 16) == f"tokens/s at 16 {engine}"
    assert describe("http_vs_engine_c1", 1) == f"tokens/s at 1 {engine}"
    assert describe("ttft_c8_over_c1", 8) == "time to first token p50 at 8 over that at 1, over HTTP"
    assert describe("sampled_vs_greedy", 1).endswith("over greedy at 1, over HTTP")
    assert describe("sampled_vs_greedy", 16) == TEXT["sampled_vs_greedy"]
    assert describe("decode_vs_roofline", 1) == TEXT["decode_vs_roofline"]
    assert describe("a_new_figure_c4", 4) == "a_new_figure_c4"  # no words: its key


def test_a_goal_set_at_one_concurrency_is_not_judged_in_a_run_at_another():
    """tokens/s against the one-at-a-time peer has its goal at 16, the decode step's roofline at 32: a run at 1
    reports them unjudged; the full run (1, 8, 16, 32) judges them, and the goals of other figures either way."""
    from workflows.bench.generate_report import GOALS, goals_at

    keys = ["tokens_per_s_vs_one_at_a_time", "decode_vs_roofline", "vs_vllm_c1"]
    assert goals_at(keys, 16, 32) == {k: GOALS[k] for k in keys}
    assert goals_at(keys, 1, 1) == {"tokens_per_s_vs_one_at_a_time": None, "decode_vs_roofline": None,
                                    "vs_vllm_c1": (">=", 1.0)}


def test_the_overload_rows_slowest_refusals_are_named_with_when_they_were_sent():
    """A slow refusal is placed in its run (the burst's first seconds, or a steady stretch): the results keep the
    slowest few with their repeat and send time, and the row's line in the doc says when the slowest was sent."""
    from benchmarks.generate import markdown
    from workflows.bench.generate_report import slowest_refusals

    runs = [{"seconds": 40.0, "refused": [{"status": 429, "sent_s": 1.5, "answer_s": 0.02},
                                          {"status": 429, "sent_s": 3.34, "answer_s": 0.106}]},
            {"seconds": 38.0, "refused": [{"status": 429, "sent_s": 0.5, "answer_s": 0.07}]}]
    assert slowest_refusals(runs, 2) == [{"repeat": 0, "sent_s": 3.34, "run_s": 40.0, "answer_s": 0.106},
                                         {"repeat": 1, "sent_s": 0.5, "run_s": 38.0, "answer_s": 0.07}]
    stored = json.loads((ROOT / "benchmarks" / "results" / "generate.json").read_text())
    overload = next(x for x in stored["rows"] if x["row"] == "http_overload")
    overload.pop("refused_slowest", None)  # results from before the field
    before = markdown(stored)
    overload["refused_slowest"] = slowest_refusals(runs)
    line = next(x for x in markdown(stored).splitlines() if "x capacity" in x and " 0 refused" not in x)
    assert line.endswith(", sent 3.3 s into repeat 1's 40 s |"), line
    assert line.replace(", sent 3.3 s into repeat 1's 40 s", "") in before.splitlines()  # results without: as before


def test_the_matmul_floor_times_every_weight_a_decode_step_multiplies_fused_as_the_compiled_step_fuses_them():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from workflows.bench.roofline import decode_step, matmul_floor, step_weights

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    weights = step_weights(model)
    # per layer: q/k/v as one (32 + 2 x 16 rows), o, gate/up as one, down; then the head (the tied embedding)
    assert [tuple(w.shape) for w in weights] == [(64, 32), (32, 32), (96, 32), (32, 48)] * 2 + [(96, 32)]
    assert torch.equal(weights[-1], model.get_input_embeddings().weight)
    assert weights[-1].data_ptr() != model.get_input_embeddings().weight.data_ptr()  # copies, the model untouched
    floor = matmul_floor(model, rows=4, repeats=3)
    assert floor["flops"] == 2 * 4 * decode_step(model, 4, 10)["matmul_weights"]  # the roofline's own weights
    fastest = round(floor["floor_s"], 5)  # the faster kernel's median
    assert floor["by_kernel_s"][floor["kernel"]] == fastest and min(floor["by_kernel_s"].values()) == fastest
    assert floor["flops_per_s"] == floor["flops"] / floor["floor_s"] > 0
    # a model not laid out as transformers' Llama: no floor, and no error
    assert matmul_floor(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=96)), rows=4) == {}

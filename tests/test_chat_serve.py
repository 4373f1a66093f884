"""Serving a chat model (#50): the continuous-batching engine (workflows.tasks.chat.engine) on a tiny
random Llama without Ray, then the OpenAI-compatible app on Ray Serve over real HTTP, driven by the
official `openai` client (two slow tests on one served app)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, Field

from tests.chat_serve_task import EAGER, build_lora, build_tiny_chat, deploy_chat, register_chat_models, served
from tests.conftest import ROOT
from tests.helpers import wait_until
from workflows.tasks.chat.engine import Engine, QueueFull, SamplingParams, TextState

torch.set_num_threads(1)
CHAT = ROOT / "configs" / "chat.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, model, tokenizer) of the tiny chat model."""
    out = tmp_path_factory.mktemp("tinychat")
    model, tokenizer = build_tiny_chat(out)
    return str(out), model, tokenizer


@pytest.fixture
def engine(tiny):
    made = []

    def make(**kw):
        e = Engine(tiny[1], tiny[2], **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer("hello world the cat " * (1 + k % 4) + "dog " * (k % 3) + "sat").input_ids for k in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


@pytest.mark.parametrize("chunk", [32, 3])
def test_greedy_tokens_are_the_same_alone_and_beside_requests_that_come_and_go(tiny, engine, chunk):
    """Six requests with staggered arrivals share steps of a batch of up to 4 (one joins as another
    ends), their prompts prefilled whole or 3 tokens a step beside the decoding rows: each gets, token
    for token, what it gets alone, which is what `generate` gives."""
    _, model, tokenizer = tiny
    ps = prompts(tokenizer, 6)
    e = engine(max_batch=4, prefill_chunk=chunk, mixed_step_ratio=None)  # chunks in tokens, as named
    e.eos = set()  # run every request to its max_tokens: the lengths differ by design
    alone = []
    for p in ps:
        g = e.submit(p, greedy(24))
        g.result(60)
        alone.append(g.tokens)
    out = model.generate(torch.tensor([ps[0]]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                         pad_token_id=tokenizer.pad_token_id)
    assert alone[0] == out[0, len(ps[0]):].tolist()
    e.stats["max_rows"] = 0
    gens = []
    for i, p in enumerate(ps):
        gens.append(e.submit(p, greedy(24 - 3 * i)))
        if i < 4:  # the next arrives once this one is decoding
            wait_until(lambda: len(gens[-1].tokens) >= 2, 30, "a request to start decoding", every=0.001)
    for g in gens:
        assert g.result(60)[1] == "length"
    assert [g.tokens for g in gens] == [a[: 24 - 3 * i] for i, a in enumerate(alone)]
    assert e.stats["max_rows"] == 4


def test_a_finished_request_leaves_and_a_waiting_one_joins_mid_flight(tiny, engine):
    _, _, tokenizer = tiny
    ps = prompts(tokenizer, 3)
    e = engine(max_batch=2)
    e.eos = set()
    long, short, waiting = (e.submit(p, greedy(n)) for p, n in zip(ps, (60, 4, 6)))
    for g in (long, short, waiting):
        g.result(60)
    assert short.steps[1] <= waiting.steps[0], (short.steps, waiting.steps)  # it waited for a place
    assert waiting.steps[1] < long.steps[1], (waiting.steps, long.steps)  # and ran, and ended, beside `long`
    assert e.stats["max_rows"] == 2 and len(long.tokens) == 60


def test_cancel_stops_that_request_only(tiny, engine):
    _, _, tokenizer = tiny
    a, b = prompts(tokenizer, 2)
    e = engine(max_batch=4)
    e.eos = set()
    ref = e.submit(b, greedy(40))
    ref.result(60)
    gone, kept = e.submit(a, greedy(200)), e.submit(b, greedy(40))
    wait_until(lambda: len(gone.tokens) >= 3, 30, "tokens of the request to cancel", every=0.001)
    gone.cancel()
    assert gone.result(30) [1] == "cancelled" and len(gone.tokens) < 200
    assert kept.result(60)[1] == "length" and kept.tokens == ref.tokens
    assert e.load() == {"running": 0, "waiting": 0, "planning": 0}


def test_a_request_that_ended_stops_counting_once_its_caller_has_the_answer(tiny, engine):
    """The decode thread held as a request ends, its step not over (the caller already has the answer):
    the request no longer counts as running, and its row's place goes to the next ones."""
    _, _, tokenizer = tiny
    p = prompts(tokenizer, 1)[0]
    e = engine(max_batch=1, max_queue=1)
    e.eos = set()
    held, release = threading.Event(), threading.Event()

    def hold():
        held.set()
        release.wait(30)

    e.on_finish = lambda gen: hold()  # in the decode thread, as the request ends, mid-step
    try:
        assert e.submit(p, greedy(2)).result(60)[1] == "length"
        wait_until(held.is_set, 30, "the decode thread held as the request ended")
        assert e.load() == {"running": 0, "waiting": 0, "planning": 0}
        queued = [e.submit(p, greedy(2)) for _ in range(2)]  # the batch's free row, then the queue's place
    finally:
        e.on_finish = None
        release.set()
    assert [g.result(60)[1] for g in queued] == ["length", "length"]


def test_a_full_queue_refuses_with_a_retry_after(tiny, engine):
    _, _, tokenizer = tiny
    p = prompts(tokenizer, 1)[0]
    e = engine(max_batch=1, max_queue=2, retry_after_s=3)
    e.eos = set()
    running = e.submit(p, greedy(200))
    wait_until(lambda: e.load()["running"] == 1, 30, "the first request in the batch", every=0.001)
    waiting = [e.submit(p, greedy(2)) for _ in range(2)]
    with pytest.raises(QueueFull, match="2 requests are waiting") as refused:
        e.submit(p, greedy(2))
    assert refused.value.retry_after_s == 3
    running.cancel()
    assert [g.result(30)[1] for g in waiting] == ["length", "length"]
    e.submit(p, greedy(2)).result(30)  # room again


def test_stop_strings_end_the_text_before_them_streamed_or_not(tiny, engine):
    _, _, tokenizer = tiny
    p = prompts(tokenizer, 1)[0]
    e = engine()
    e.eos = set()
    g = e.submit(p, greedy(30))
    full = g.result(60)[0]
    stop = full[8:11]
    cut = full[: full.find(stop)]
    text, reason = e.submit(p, SamplingParams(max_tokens=30, temperature=0, stop=("\x00never", stop))).result(60)
    assert (text, reason) == (cut, "stop")

    async def stream():
        g = e.submit(p, SamplingParams(max_tokens=30, temperature=0, stop=(stop,)))
        return [d async for d in g]

    deltas = asyncio.run(stream())
    assert "".join(d.text for d in deltas) == cut and deltas[-1].finish_reason == "stop"
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_a_rows_token_does_not_depend_on_the_rows_beside_it():
    """The sampler picks a step's tokens together on the model's device (greedy rows by argmax, sampled
    rows with one uniform each from their own seeded generator): each row gets the token it gets alone,
    with logits in float32 or bf16 (a GPU replica's serve.precision=bf16)."""
    from workflows.tasks.chat.engine import model_device
    from workflows.tasks.chat.engine.sampler import Sampler

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 4
    params = [greedy(4), SamplingParams(4, temperature=0.7, seed=1), greedy(4),
              SamplingParams(4, temperature=1.0, top_p=0.5, seed=2), SamplingParams(4, temperature=1.5, seed=3)]
    for x in (logits, logits.bfloat16()):
        sampler = Sampler(64, 5, torch.device("cpu"))
        alone = [sampler.choose(x[i:i + 1], [sampler.row(p, i)])[0] for i, p in enumerate(params)]
        together = sampler.choose(x, [sampler.row(p, i) for i, p in enumerate(params)])
        assert together == alone
        assert [together[i][0] for i in (0, 2)] == x[[0, 2]].float().argmax(-1).tolist()
    assert model_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(SimpleNamespace()) == torch.device("cpu")  # nothing to tell: the CPU


def test_text_that_may_start_a_stop_string_waits():
    state = TextState(stop=("abc",))
    state.text = "xxab"
    assert state.delta(final=False) == "xx"
    state.text = "xxabd"
    assert state.delta(final=False) == "abd"


def test_a_seed_repeats_sampling_alone_or_beside_others(tiny, engine):
    _, _, tokenizer = tiny
    a, b = prompts(tokenizer, 2)
    e = engine(max_batch=4)
    e.eos = set()
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    first = e.submit(a, seeded)
    first.result(60)
    beside = [e.submit(b, SamplingParams(max_tokens=30, temperature=1.0, seed=s)) for s in (1, 2)]
    again = e.submit(a, seeded)
    other = e.submit(a, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=8))
    for g in (*beside, again, other):
        g.result(60)
    assert again.tokens == first.tokens
    assert other.tokens != first.tokens


def test_a_prompt_over_the_context_is_refused(tiny, engine):
    e = engine()
    with pytest.raises(ValueError, match="context is 256"):
        e.submit([5] * 256, greedy(1))
    g = e.submit([5] * 250, greedy(50))
    g.result(60)
    assert g.finish_reason in ("length", "stop") and len(g.tokens) <= 6


def test_ignore_eos_runs_past_the_end_of_sequence_to_max_tokens(tiny, engine):
    """With the first token it says taken as its end of sequence, a request ends there ("stop"); with
    ignore_eos it runs on to max_tokens ("length"), as the bench's fixed lengths need."""
    _, _, tokenizer = tiny
    e = engine()
    p = prompts(tokenizer, 1)[0]
    first = e.submit(p, greedy(8))
    first.result(60)
    e.eos = {first.tokens[0]}
    stopped, running = e.submit(p, greedy(8)), e.submit(p, SamplingParams(max_tokens=8, temperature=0,
                                                                            ignore_eos=True))
    stopped.result(60), running.result(60)
    assert (stopped.finish_reason, len(stopped.tokens)) == ("stop", 1)
    assert (running.finish_reason, running.tokens) == ("length", first.tokens[:8])


def test_bf16_serving_on_a_cpu_keeps_the_weights_cache_and_answers_in_bf16(tiny, monkeypatch, caplog):
    """serve.precision=bf16 on a CPU replica: the engine's model and KV cache are bf16 and it answers; a
    CPU without native bf16 matmuls (AVX512-BF16 or AMX: faked, this one may have them) is warned of."""
    from workflows.tasks.chat.serving import loading as serving

    model_dir, _, tokenizer = tiny
    assert isinstance(serving.native_cpu_bf16(), bool)
    monkeypatch.setattr(serving, "native_cpu_bf16", lambda: False)
    predictor = served(model_dir, extra=("serve.precision=bf16",), max_tokens=6)
    try:
        with caplog.at_level("WARNING", logger=serving.__name__):
            engine = predictor.engine
        assert "without AVX512-BF16 or AMX" in caplog.text
        assert next(engine.model.parameters()).dtype == torch.bfloat16 and engine.cache.dtype == torch.bfloat16
        engine.eos = set()
        assert predictor.predict([{"prompt": "hello world"}])[0]["completion_tokens"] == 6
    finally:
        predictor.close()


def test_a_served_adapter_is_its_base_with_it_and_takes_adapters_of_the_same_base(tiny, tmp_path):
    """What the chat task registers with export=adapter: the adapter and a card naming its base by path
    and weights sha256. Served, it answers as the base with that adapter (batch predictions too); another
    adapter is accepted only when its card names the same base weights."""
    from workflows.tasks.chat.engine import ModelNotFound
    from workflows.tasks.chat.training.model import weights_sha256

    model_dir, _, tokenizer = tiny
    for i in (1, 2):
        build_lora(model_dir, tmp_path / f"lora{i}", seed=i)
        tokenizer.save_pretrained(tmp_path / f"lora{i}")  # as the export writes it beside the adapter
    base = {"name_or_path": model_dir, "sha256": weights_sha256(model_dir)}
    predictor = served(str(tmp_path / "lora1"), SimpleNamespace(name="mine", version=1, base=base), base=model_dir,
                       max_tokens=12)
    plain = served(model_dir)
    try:
        plain.engine.eos = predictor.engine.eos = set()
        name = plain.adapters.add("mine:1", str(tmp_path / "lora1")).result(60)
        p = prompts(tokenizer, 1)[0]
        ours = predictor.engine.submit(p, greedy(12), predictor.served_adapter)
        ours.result(60)
        theirs = plain.engine.submit(p, greedy(12), name)
        theirs.result(60)
        assert ours.tokens == theirs.tokens
        assert predictor.predict([{"prompt": "hello world"}])[0]["text"] == \
            plain.engine.submit(plain.prompts.prompt_ids("hello world"), greedy(12), name).result(60)[0]
        predictor.adapters.check_files("two:1", str(tmp_path / "lora2"), SimpleNamespace(base=base))
        for other in ({**base, "sha256": "0" * 64}, None):
            with pytest.raises(ModelNotFound, match="not of the base served by mine:1"):
                predictor.adapters.check_files("two:1", str(tmp_path / "lora2"), SimpleNamespace(base=other))
        plain.adapters.check_files("two:1", str(tmp_path / "lora2"),
                                   SimpleNamespace(base=base))  # its own weights' sha256
    finally:
        predictor.close()
        plain.close()


def test_adapters_beside_the_base_in_one_batch_each_as_alone(tiny, tmp_path):
    """Two LoRA adapters of one base and the base itself in one batch (peft's mixed-adapter forward, an
    adapter per token of the step, prompts prefilled 2 tokens a step beside decoding rows): each row
    decodes what it decodes alone, and an adapter unused once unloaded leaves the model."""
    model_dir, _, tokenizer = tiny
    for i in (1, 2):
        build_lora(model_dir, tmp_path / f"lora{i}", seed=i)
    predictor = served(model_dir, max_batch=3, prefill_chunk=2, mixed_step_ratio="null")  # 2 tokens a step
    try:
        e = predictor.engine
        e.eos = set()
        names = {m: predictor.adapters.add(m, str(tmp_path / f"lora{i}")).result(60)
                 for i, m in ((1, "one:1"), (2, "two:1"))}
        p = prompts(tokenizer, 1)[0]
        alone = {}
        for adapter in (None, *names.values()):
            g = e.submit(p, greedy(16), adapter)
            g.result(60)
            alone[adapter] = g.tokens
        assert len({tuple(t) for t in alone.values()}) == 3  # the adapters change what the model says
        gens = {a: e.submit(p, greedy(16), a) for a in alone}
        for g in gens.values():
            g.result(60)
        assert {a: g.tokens for a, g in gens.items()} == alone
        assert predictor.adapters.resolve("tiny") is None and predictor.adapters.resolve("tiny:1") is None
        assert predictor.adapters.resolve("two:v1") == "two:1"
        predictor.adapters.retire("one:1")
        e.call(lambda: None).result(30)  # the deletion queued before it has run
        assert names["one:1"] not in e.model.peft_config and names["two:1"] in e.model.peft_config
        g = e.submit(p, greedy(4), names["one:1"])
        with pytest.raises(LookupError, match="not loaded"):
            g.result(30)
    finally:
        predictor.close()


def test_requests_wait_on_the_engine_not_the_event_loop(tiny, engine):
    """Many async consumers on one event loop while the engine decodes in its thread: the loop stays
    free (a timer ticks meanwhile) and every stream ends."""
    _, _, tokenizer = tiny
    e = engine(max_batch=4, max_queue=16)
    e.eos = set()
    ps = prompts(tokenizer, 8)

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        ticker = asyncio.create_task(tick())

        async def one(p):
            return "".join([d.text async for d in e.submit(p, greedy(30))])

        t0 = time.perf_counter()
        texts = await asyncio.gather(*(one(p) for p in ps))
        ticker.cancel()
        return texts, ticks, time.perf_counter() - t0

    texts, ticks, seconds = asyncio.run(main())
    assert len(texts) == 8 and all(texts)
    assert ticks > 0



def test_batch_predictions_go_through_the_engine_within_its_queue(tiny):
    """`predict` (batch inference) submits more instances than the batch and queue hold (max_queue 0:
    only free places), waiting as the engine frees them; each answer is the greedy one."""
    model_dir, _, tokenizer = tiny
    predictor = served(model_dir, max_batch=2, max_queue=0, max_tokens=8)
    try:
        instances = [{"prompt": "hello world " * k} for k in range(1, 5)] + [
            {"messages": [{"role": "user", "content": "the cat"}]}]
        answers = predictor.predict(instances)
        for inst, answer in zip(instances, answers):
            ids = (predictor.prompts.chat_ids(inst["messages"]) if "messages" in inst
                   else predictor.prompts.prompt_ids(inst["prompt"]))
            alone = predictor.engine.submit(ids, greedy(8))
            assert (answer["text"], answer["finish_reason"]) == alone.result(60)
            assert answer["completion_tokens"] == len(alone.tokens)
        assert predictor.engine.stats["max_rows"] == 2
    finally:
        predictor.close()


def test_rows_of_prompts_or_conversations_are_chats_with_the_system_prompt(tiny):
    """`workflows predict` rows: a `prompt` is a user's turn (or the JSON conversation a processed row
    stores, its reference answer left out), rendered by the chat template after the task's system prompt."""
    import json

    import pandas as pd

    model_dir, _, tokenizer = tiny
    predictor = served(model_dir, extra=("model.options.system_prompt=be big",), max_tokens=6)
    try:
        user = [{"role": "user", "content": "hello world"}]
        assert predictor.prompts.chat_ids(user) == list(tokenizer.apply_chat_template(
            [{"role": "system", "content": "be big"}, *user], add_generation_prompt=True, return_dict=False))
        batch = pd.DataFrame({"prompt": ["hello world", json.dumps([*user, {"role": "assistant", "content": "red"}])]})
        out = predictor.predict_frame(batch)
        assert out["prediction"][0] == out["prediction"][1] == predictor.predict([{"messages": user}])[0]["text"]
        assert set(out["finish_reason"]) <= {"stop", "length"}
    finally:
        predictor.close()


def test_the_measurements_count_what_ran(tiny, engine):
    """workflows.tasks.chat.engine.measure (what a generation benchmark reports): each path produces exactly
    max_tokens per prompt; timings are there (their values are not checked: this is no benchmark)."""
    from workflows.tasks.chat.engine.measure import engine_run, static_run

    _, model, tokenizer = tiny
    ps = prompts(tokenizer, 4)
    e = engine(max_batch=2)
    run = engine_run(e, ps, 6, arrivals_s=[0, 0, 0.01, 0.02])
    assert run["tokens"] == 24 and run["requests"] == 4 and 1 <= run["mean_batch"] <= 2
    assert 0 < run["ttft_s_p50"] <= run["latency_s_p50"] and run["tokens_per_s"] > 0
    assert e.eos  # untouched: the run asks for ignore_eos
    static = static_run(model, tokenizer, ps, 6, batch_size=2)
    assert static["tokens"] == 24 and static["tokens_per_s"] > 0


def test_the_generic_app_mounts_the_chat_contracts_routes_and_no_predict():
    """workflows.serve.app builds the replica's app from any task's contract: the chat task's adds the
    OpenAI routes (their bodies declared in the OpenAPI document) and goes without /predict."""
    from workflows.config.serve import GenerateConfig
    from workflows.serve.api import build_api
    from workflows.tasks.chat.openai.routes import OpenAIContract

    card = SimpleNamespace(name="tiny", version=1, labels=[], task="chat")
    api = build_api(SimpleNamespace(card=card, contract=OpenAIContract(card, GenerateConfig()), predictor=None))
    paths = {r.path for r in api.routes}
    assert {"/v1/models", "/v1/chat/completions", "/v1/completions", "/healthz"} <= paths
    assert "/predict" not in paths
    doc = api.openapi()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatRequest"} and "Message" in doc["components"]["schemas"]

# --- over HTTP, on Ray Serve -------------------------------------------------------------------------

TASK = "tests.chat_serve_task:HookedChatTask"
TOKEN = "chat-s3cret"
STEP_S = 0.05  # each model call of the served model sleeps this long: a long stream lasts seconds
# serve.generate.timeout_s: a request of the MAX_TOKENS the server allows sleeps MAX_TOKENS x STEP_S = 20 s in
# its model calls alone, so it always ends at this deadline (the overload part below); a shorter one has the
# 15 s (a forced tool call, some 65 one-character tokens, had reached 47 of them at 6 s at load 13 on 2 cores)
MAX_TOKENS, DEADLINE_S = 400, 15


@pytest.fixture(scope="module")
def chat_server(ray_cluster, tmp_path_factory):
    """The tiny chat model and two LoRA adapters of it registered in a local store, served by the
    generic app (workflows.serve.app.ModelServer) behind a bearer token: batches of 2, a queue of 1."""
    from ray import serve

    from tests.helpers import free_port
    from workflows.config import load_config
    from workflows.serve import drain
    from workflows.storage.uri import StorageContext

    tmp = tmp_path_factory.mktemp("chat-serve")
    base = tmp / "tinychat"
    build_tiny_chat(base, context=512)  # room for MAX_TOKENS after a prompt
    for name, seed in (("support", 1), ("pirate", 2)):
        build_lora(base, tmp / name, seed)
    port = free_port()
    cfg = load_config(CHAT, [
        EAGER, "storage.embedded.enabled=false", "serve.enabled=true", f"storage.root={tmp}/store",
        f"cache.dir={tmp}/cache",
        f"model.task={TASK}", f"model.options.step_delay_s={STEP_S}", f"model.options.finish_log={tmp}/finished.jsonl",
        f"serve.port={port}", "serve.auth_token_env=CHAT_TOKEN", "serve.generate.max_batch=2",
        "serve.generate.max_queue=1", f"serve.generate.max_tokens={MAX_TOKENS}", "serve.generate.retry_after_s=2",
        "serve.generate.max_prompt_tokens=192", "serve.generate.max_stop_chars=16",
        f"serve.generate.timeout_s={DEADLINE_S}"])
    ctx = StorageContext.from_config(cfg.storage)
    register_chat_models(cfg, ctx, base, tmp, "tinychat", TASK)
    drainer = drain.create()  # as `workflows serve` does: replicas find it and drain on stop
    url = deploy_chat(cfg, "tinychat:1", "chat", port, TOKEN, 300)
    yield SimpleNamespace(url=url, tmp=tmp, base=base, drainer=drainer)
    serve.delete("chat")
    serve.shutdown()


def _hostile_adapters(chat_server) -> list[str]:
    """Copies of the support adapter registered with what a bucket writer could change: its config's
    modules_to_save (the shared head) or megatron_core (a module peft imports), its weights as a
    pickle only; their names."""
    import json
    import shutil

    from workflows import registry
    from workflows.config import load_config
    from workflows.storage.uri import StorageContext
    from workflows.tasks.chat.training.model import weights_sha256

    tmp = chat_server.tmp
    cfg = load_config(CHAT, ["storage.embedded.enabled=false", f"storage.root={tmp}/store", f"cache.dir={tmp}/cache"])
    same = {"name_or_path": "registry:tinychat:1", "sha256": weights_sha256(str(chat_server.base))}
    changes = {"headcopy": {"modules_to_save": ["lm_head"]}, "megatron": {"megatron_config": {"x": 1},
                                                                          "megatron_core": "os"},
               "pickled": None}
    for name, change in changes.items():
        folder = tmp / f"hostile-{name}"
        shutil.copytree(tmp / "support", folder)
        if change is None:
            (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
        elif change:
            doc = json.loads((folder / "adapter_config.json").read_text())
            (folder / "adapter_config.json").write_text(json.dumps({**doc, **change}))
        registry.register(cfg, StorageContext(), str(folder), name, {"task": TASK, "export": "adapter", "base": same})
    return list(changes)


def _generate_metrics(pick) -> dict:
    """{sample name: [(labels, value)]} of every `ray_workflows_generate_*` sample on the session's node(s),
    or None if `pick` of it is falsy."""
    from workflows.cluster_state import metric_samples

    out: dict = {}
    for sample in metric_samples("ray_workflows_generate_"):
        out.setdefault(sample["name"], []).append((sample["labels"], sample["value"]))
    return out if pick(out) else None


def _finished(tmp) -> list[dict]:
    import json

    path = tmp / "finished.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Answer(BaseModel):
    """What `chat.completions.parse` asks for: a bounded answer, so the random model's JSON ends."""

    verdict: Literal["yes", "no"]
    score: int = Field(ge=0, le=9)


ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two digits", "strict": True,
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a", "b"], "additionalProperties": False}}}


@pytest.mark.integration
def test_the_replica_runs_at_a_servers_niceness_not_rays_workers(chat_server):
    """Ray starts its workers at niceness 15; the replica answers clients at 0 (serve.replica_niceness), so a
    client or a batch job on the same node does not outrun it."""
    import psutil

    replicas = [p for p in psutil.process_iter(["cmdline"])
                if (p.info["cmdline"] or [""])[0].startswith("ray::ServeReplica:chat:ModelServer")]
    assert replicas, "no replica process found"
    assert {p.nice() for p in replicas} == {0}
    workers = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith("ray::Serve")]
    assert any(p.nice() == 15 for p in workers), "Ray's own Serve processes keep its default (so the test can fail)"


@pytest.mark.integration
def test_the_openai_client_parses_calls_tools_and_reads_logprobs(chat_server):
    """What agents and extractors do through the official client, against the served tiny model: a
    parsed pydantic object (json_schema, strict), a tools round trip (a named call, the tool's answer in
    a `tool` message, the model goes on), a streamed tool call, logprobs, n choices, a null temperature,
    and OpenAI's Model object for NAME and NAME:VERSION. (Before the test that ends by stopping the server.)"""
    import openai
    import requests

    url = chat_server.url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "is the cat big"}]

    parsed = client.chat.completions.parse(model="tinychat:1", messages=messages, response_format=Answer,
                                           temperature=0, max_tokens=60)
    choice = parsed.choices[0]
    assert isinstance(choice.message.parsed, Answer) and choice.finish_reason == "stop", choice

    # a tools round trip: the call the request names, its arguments valid for the function's schema
    asked = client.chat.completions.create(model="tinychat:1", messages=messages, tools=[ADD_TOOL],
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           temperature=0, max_tokens=120)
    choice = asked.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"} and call.id.startswith("call_")
    history = [*messages, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    went_on = client.chat.completions.create(model="tinychat:1", messages=history, tools=[ADD_TOOL], temperature=0,
                                             max_tokens=6)
    assert went_on.choices[0].finish_reason in ("stop", "length") and went_on.usage.prompt_tokens > \
        asked.usage.prompt_tokens  # the call and its result are in the prompt

    # the same call streamed: one delta with the call, then finish_reason tool_calls
    chunks = list(client.chat.completions.create(model="tinychat:1", messages=messages, tools=[ADD_TOOL],
                                                 tool_choice="required", temperature=0, max_tokens=120, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.id, d.function.name) for d in deltas] == [(0, deltas[0].id, "add")]
    assert json.loads(deltas[0].function.arguments) == args  # greedy: what the call above said
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # logprobs, n choices and a null temperature (the default, 1)
    seen = client.chat.completions.create(model="tinychat:1", messages=messages, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = seen.choices[0].logprobs.content
    assert "".join(t.token for t in content) == seen.choices[0].message.content and len(content) >= 1
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-9 for t in content)
    streamed = list(client.chat.completions.create(model="tinychat:1", messages=messages, max_tokens=5,
                                                   temperature=0, logprobs=True, stream=True))
    assert [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content] \
        == [t.token for t in content]
    several = client.chat.completions.create(model="tinychat:1", messages=messages, max_tokens=6, n=2, seed=3,
                                             extra_body={"temperature": None})
    assert [c.index for c in several.choices] == [0, 1] and several.choices[0].message != several.choices[1].message
    again = client.chat.completions.create(model="tinychat:1", messages=messages, max_tokens=6, n=2, seed=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in several.choices]
    text = client.completions.create(model="tinychat:1", prompt=["the cat", "a dog"], max_tokens=3, temperature=0,
                                     logprobs=2)
    assert [c.index for c in text.choices] == [0, 1] and len(text.choices[1].logprobs.tokens) >= 1

    for name in ("tinychat", "tinychat:1"):
        assert client.models.retrieve(name).model_dump(include={"id", "object", "owned_by"}) == {
            "id": name, "object": "model", "owned_by": "workflows"}
    missing = requests.get(f"{url}/v1/models/nope:1", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def clients_python() -> str:
    """The python of the clients' own venv (`make clients`: the latest openai and langchain-openai as a
    user installs them), built first if it is not there."""
    import subprocess

    python = ROOT / ".venv-clients" / "bin" / "python"
    if not python.exists():
        made = subprocess.run(["make", "clients"], cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    return str(python)


@pytest.mark.integration
# extended: the clients' own venv is a pip install of openai and langchain-openai (about a minute), and
# the openai client's calls repeat the gated test above
@pytest.mark.extended
def test_agent_frameworks_from_their_own_venv(chat_server):
    """An agent framework (langchain-openai's ChatOpenAI: with_structured_output, bind_tools with a named
    tool, the tool's answer sent back) and the openai client's parse, tool calls (streamed through its
    stream helper) and logprobs, from a venv of their own, against the served tiny model."""
    import subprocess

    res = subprocess.run([clients_python(), str(ROOT / "tests" / "clients" / "agent_clients.py"), chat_server.url,
                          TOKEN, "tinychat:1"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["parse"]["finish_reason"] == "stop" and Answer.model_validate(out["parse"]["parsed"])
    assert out["tools"]["name"] == "add" and set(out["tools"]["arguments"]) == {"a", "b"}
    assert out["tools"]["finish_reason"] == "tool_calls" and out["tools"]["after"] in ("stop", "length")
    assert out["stream"]["calls"] and out["stream"]["finish_reason"] == "tool_calls"
    assert "".join(out["logprobs"]["tokens"]) == out["logprobs"]["content"]
    lc = out["langchain"]
    assert Answer.model_validate(lc["structured"]) and lc["after"] in ("stop", "length")
    assert [name for name, _ in lc["calls"]] == ["add"] and all(0 <= v <= 9 for v in lc["calls"][0][1].values())


@pytest.mark.integration
def test_the_openai_client_chats_streams_and_meets_each_limit(chat_server):
    import threading

    import openai
    import requests
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url, auth = chat_server.url, {"Authorization": f"Bearer {TOKEN}"}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["tinychat:1"]
    messages = [{"role": "user", "content": "hello the cat sat"}]

    # greedy over HTTP is what the model says here, through its chat template
    tokenizer = AutoTokenizer.from_pretrained(chat_server.base)
    model = AutoModelForCausalLM.from_pretrained(chat_server.base)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:]
    expected = tokenizer.decode(out, skip_special_tokens=True)
    answer = client.chat.completions.create(model="tinychat:1", messages=messages, max_tokens=12, temperature=0)
    choice = answer.choices[0]
    assert choice.message.content == expected and choice.message.role == "assistant"
    assert choice.finish_reason == ("stop" if out[-1] == tokenizer.eos_token_id else "length")
    assert answer.usage.prompt_tokens == ids["input_ids"].shape[1] and answer.usage.completion_tokens == len(out)

    # the same, streamed: a role chunk, content chunks, the finish reason, the usage, [DONE]
    chunks = list(client.chat.completions.create(model="tinychat", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(out)
    raw = requests.post(f"{url}/v1/chat/completions", headers=auth, stream=True, timeout=60,
                        json={"model": "tinychat:1", "messages": messages, "max_tokens": 3, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    lines = [ln for ln in raw.iter_lines(decode_unicode=True) if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"

    # text completions, a stop string, a seed
    text = client.completions.create(model="tinychat:1", prompt="hello world", max_tokens=20, temperature=0)
    full = text.choices[0].text
    assert text.object == "text_completion" and text.usage.completion_tokens <= 20
    assert len(full) > 6, full
    cut = client.completions.create(model="tinychat:1", prompt="hello world", max_tokens=20, temperature=0,
                                    stop=[full[4:6]])
    assert cut.choices[0].text == full[: full.find(full[4:6])] and cut.choices[0].finish_reason == "stop"
    seeded = [client.completions.create(model="tinychat:1", prompt="the dog", max_tokens=10, seed=5).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    fixed = client.completions.create(model="tinychat:1", prompt="the dog", max_tokens=9, temperature=0,
                                      extra_body={"ignore_eos": True})  # vLLM's and llama.cpp's field
    assert fixed.usage.completion_tokens == 9 and fixed.choices[0].finish_reason == "length"

    # 4xx in OpenAI's error shape
    def post(body):
        return requests.post(f"{url}/v1/chat/completions", headers=auth, timeout=60, json=body)

    chat, text_path = "/v1/chat/completions", "/v1/completions"
    for path, kwargs, status, param in [
        (chat, {"json": {"model": "tinychat:1", "messages": messages, "temperature": 3}}, 400, "temperature"),
        (chat, {"json": {"model": "tinychat:1", "messages": []}}, 400, "messages"),
        (chat, {"json": {"model": "tinychat:1", "messages": messages, "n": 9}}, 400, "n"),  # over max_n
        (chat, {"json": {"model": "tinychat:1", "messages": messages, "max_tokens": MAX_TOKENS + 1}}, 400,
         "max_tokens"),
        (chat, {"json": {"model": "tinychat:1", "messages": messages, "echo": True}}, 400, "echo"),  # not chat's
        (chat, {"data": b"{not json", "headers": {**auth, "content-type": "application/json"}}, 400, None),
        (chat, {"json": {"model": "nope:1", "messages": messages}}, 404, "model"),
        (chat, {"json": {"model": "stranger:1", "messages": messages}}, 404, "model"),
        (text_path, {"json": {"model": "tinychat:1", "prompt": ["a"] * 5, "n": 2}}, 400, "prompt"),  # 10 > max_n
        (text_path, {"json": {"model": "tinychat:1", "prompt": "the " * 300}}, 400, "prompt"),  # over the context
        (chat, {"json": {"model": "tinychat:1", "messages": [{"role": "user", "content": "the " * 200}]}}, 400,
         "messages"),  # over max_prompt_tokens
        (chat, {"json": {"model": "tinychat:1", "messages": messages, "stop": ["a", "b", "c", "d", "e"]}}, 400, "stop"),
        (chat, {"json": {"model": "tinychat:1", "messages": messages, "stop": "x" * 17}}, 400, "stop"),
        (chat, {"data": b" " * ((1 << 20) + 1), "headers": {**auth, "content-type": "application/json"}}, 413, None),
    ]:
        r = requests.post(f"{url}{path}", **{"headers": auth, "timeout": 60, **kwargs})
        err = r.json()["error"]
        assert r.status_code == status and err["param"] == param, (r.status_code, err)
        assert err["type"] == "invalid_request_error" and err["message"] and "code" in err
        if param in ("prompt", "messages") and status == 400 and "the " in str(kwargs["json"]):
            assert err["code"] == "context_length_exceeded", err
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tinychat:1", messages=messages, temperature=2.5)

    # two adapters on one base, in one replica: each answers its own way, the same way each time
    said = {m: client.chat.completions.create(model=m, messages=messages, max_tokens=10, temperature=0)
            .choices[0].message.content for m in ("support:1", "pirate:v1", "tinychat:1")}
    assert len(set(said.values())) == 3, said
    again = client.chat.completions.create(model="support:1", messages=messages, max_tokens=10, temperature=0,
                                           extra_headers={"serve_multiplexed_model_id": "support:1"})
    assert again.choices[0].message.content == said["support:1"]
    assert sorted(m.id for m in client.models.list()) == ["pirate:1", "support:1", "tinychat:1"]

    # adapters edited in the store (#63): each a 404 that names the model and no place, none listed after,
    # the base and the adapters loaded before answering as before
    for name in _hostile_adapters(chat_server):
        r = post({"model": f"{name}:1", "messages": messages, "max_tokens": 10, "temperature": 0})
        err = r.json()["error"]
        assert r.status_code == 404 and err["param"] == "model" and len(err["message"].splitlines()) == 1, err
        assert name in err["message"] and str(chat_server.tmp) not in err["message"], err
    assert sorted(m.id for m in client.models.list()) == ["pirate:1", "support:1", "tinychat:1"]
    for m in ("support:1", "tinychat:1"):
        assert client.chat.completions.create(model=m, messages=messages, max_tokens=10, temperature=0) \
            .choices[0].message.content == said[m]

    # a client that leaves mid-stream ends its own generation only
    before = len(_finished(chat_server.tmp))
    kept = client.chat.completions.create(model="tinychat:1", messages=messages, max_tokens=40, temperature=0,
                                          stream=True)
    left = client.chat.completions.create(model="tinychat:1", messages=messages, max_tokens=200, temperature=0,
                                          stream=True)
    for _, _ in zip(range(3), left):
        pass
    left.close()
    rest = [c.choices[0].finish_reason for c in kept]
    ended = wait_until(lambda: [r for r in _finished(chat_server.tmp)[before:] if r["max_tokens"] == 200], 60,
                       "the generation of the client that left to end")
    assert ended[0]["finish_reason"] == "cancelled" and ended[0]["tokens"] < 200, ended
    assert rest[-1] in ("stop", "length")

    # a full queue: 2 running, 1 waiting, the next is a 429 with Retry-After, answered at once (while the
    # running ones still run); the running ones end at their deadline (timeout_s) with the text so far
    running = [client.chat.completions.create(model="tinychat:1", messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0, stream=True) for _ in range(2)]
    for s in running:  # past the role chunk, which comes before the request has a place in the batch
        next(c for c in s if c.choices[0].delta.content or c.choices[0].finish_reason)
    answers: list = []
    body = {"model": "tinychat:1", "messages": messages, "max_tokens": 2}
    threads = [threading.Thread(target=lambda: answers.append((post(body), time.monotonic()))) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: answers, 60, "a refused request")
    refused, refused_at = answers[0]
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "2", refused.text
    assert refused.json()["error"]["code"] == "server_busy" and refused.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):  # what the openai client raises for it (no retries here)
        client.chat.completions.create(**body)
    ends = []
    for s in running:
        chunks = list(s)
        ends.append((chunks[-1].choices[0].finish_reason, time.monotonic()))
    assert [reason for reason, _ in ends] == ["timeout", "timeout"] and refused_at < min(t for _, t in ends)
    for t in threads:
        t.join(60)
    assert sorted(a.status_code for a, _ in answers) == [200, 429]

    # the engine's metrics, per model, on the node's Prometheus endpoint (Ray exports them every few seconds)
    def seen(m: dict) -> bool:
        def labels(name: str, key: str) -> set:
            return {lab[key] for lab, _ in m.get(f"ray_workflows_generate_{name}", [])}

        return ({"queue_full", "context_length_exceeded", "invalid_request"} <= labels("rejections_total", "reason")
                and {"tinychat:1", "support:1", "pirate:1"} <= labels("time_to_first_token_s_count", "model")
                and {"length", "timeout", "cancelled"} <= labels("request_latency_s_count", "finish_reason"))

    scraped = wait_until(lambda: _generate_metrics(seen), 120, "the engine's metrics of this traffic")
    assert sum(v for _, v in scraped["ray_workflows_generate_inter_token_latency_s_count"]) > 50
    assert sum(v for _, v in scraped["ray_workflows_generate_prefill_tokens_total"]) > 50
    assert sum(v for _, v in scraped["ray_workflows_generate_decode_tokens_total"]) > 50
    for gauge in ("running", "waiting", "cache_tokens", "cache_capacity_tokens"):
        assert f"ray_workflows_generate_{gauge}" in scraped, gauge

    _an_adapters_alias_is_followed(chat_server, client, messages, said)

    # stopping: a stream in flight finishes whole, a new request is refused (OpenAI's shape), the drain waits
    from workflows.serve import drain

    stream = client.chat.completions.create(model="tinychat:1", messages=messages, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    report: dict = {}
    stopper = threading.Thread(target=lambda: report.update(drain.drain(chat_server.drainer, timeout_s=60)))
    stopper.start()
    wait_until(lambda: post(body).status_code == 503, 30, "new requests refused while stopping")
    assert post(body).json()["error"]["message"] == "the server is shutting down"
    rest_chunks = list(stream)
    stopper.join(60)
    assert rest_chunks[-1].usage is not None and rest_chunks[-1].usage.completion_tokens >= 1
    assert report["drained"] == 1 and report["in_flight_answered"] >= 1, report


def _an_adapters_alias_is_followed(chat_server, client, messages, said: dict) -> None:
    """A request whose model is an adapter's NAME@ALIAS is answered by the version the alias holds;
    when the alias moves, requests are answered by the new one (the replica reads the alias again
    after serve.alias_poll_s), with no restart. support:2 is pirate's adapter registered as support."""
    import openai

    from workflows import registry
    from workflows.config import load_config
    from workflows.storage.uri import StorageContext
    from workflows.tasks.chat.training.model import weights_sha256

    cfg = load_config(CHAT, ["storage.embedded.enabled=false", f"storage.root={chat_server.tmp}/store",
                             f"cache.dir={chat_server.tmp}/cache", "tracking.enabled=false"])
    ctx = StorageContext.from_config(cfg.storage)
    same = {"name_or_path": "registry:tinychat:1", "sha256": weights_sha256(str(chat_server.base))}
    registry.register(cfg, ctx, str(chat_server.tmp / "pirate"), "support", {"task": TASK, "export": "adapter",
                                                                            "base": same})
    ask = {"messages": messages, "max_tokens": 10, "temperature": 0}
    with pytest.raises(openai.NotFoundError, match="no alias 'live'"):
        client.chat.completions.create(model="support@live", **ask)
    registry.move_alias(cfg, ctx, "support", "live", 1, by="test")

    def answer_or_404():  # the unknown alias is remembered for serve.alias_poll_s, as a known one is
        try:
            return client.chat.completions.create(model="support@live", **ask).choices[0].message.content
        except openai.NotFoundError:
            return None

    assert wait_until(answer_or_404, 60, "the alias, once set, to answer") == said["support:1"]
    registry.move_alias(cfg, ctx, "support", "live", 2, by="test")
    wait_until(lambda: client.chat.completions.create(model="support@live", **ask).choices[0].message.content
               == said["pirate:v1"], 60, "the alias's new adapter to answer")

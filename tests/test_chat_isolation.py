"""No client of a chat replica stalls, slows or breaks another (#71): requests bounded before they are
validated, planned off the single tokenizing thread with grammars compiled once in a thread of their
own, admitted against the engine's capacity before planning, deadlines from arrival, one row's
non-finite logits failing that row alone, a dead decode thread failing everything pending and the
replica's health, detokenizing bounded per token, unknown aliases answered naming the model only.

Over real HTTP where a route is involved: the replica's app (workflows.serve.api) under uvicorn on
127.0.0.1, over the chat predictor of the tiny random Llama, outside Ray Serve (the app's request
metrics need the session's Ray cluster; the engine reports to no Prometheus here)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import requests
import torch

from tests.chat_serve_task import served
from tests.helpers import wait_until
from workflows.net import free_port
from workflows.tasks.chat.engine import EngineStopped, SamplingParams, TextState

torch.set_num_threads(1)
SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.chat_serve_task import build_tiny_chat

    out = tmp_path_factory.mktemp("tinychat")
    build_tiny_chat(out)
    return str(out)


class Replica:
    """The chat routes of `served(model_dir, **generate)` on a uvicorn server; `gate` holds every grammar
    compile until it is set (a compile slow on purpose: how long a real one takes depends on the machine)."""

    def __init__(self, model_dir: str, **generate):
        import uvicorn
        from fastapi import FastAPI

        from workflows.serve.api import build_api

        self.predictor = p = served(model_dir, **generate)
        p.start_http = lambda: (p.prompts.warm_grammars(), p.engine)[1]  # the engine, without Prometheus
        card = SimpleNamespace(name="tiny", version=1, labels=[], task="chat")

        async def pin(model):
            return model

        self.server = SimpleNamespace(card=card, predictor=p, stopping=False, token=None, in_flight=0,
                                      guard=lambda request: None, pin=pin)
        self.server.contract = self.contract = p.task.serving.http_contract(card, p.cfg)
        api = build_api(self.server)
        assert isinstance(api, FastAPI)
        grammars = p.prompts.grammars()
        compiled, self.gate = grammars.compiled, threading.Event()
        self.gate.set()
        grammars.compiled = lambda *a: (self.gate.wait(60), compiled(*a))[1]
        self.url = f"http://127.0.0.1:{free_port()}"
        self._uv = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                                 lifespan="off", log_level="warning"))
        threading.Thread(target=self._uv.run, daemon=True).start()
        wait_until(lambda: self._uv.started, 30, "the replica's server")

    def post(self, body: dict, route: str = "/v1/chat/completions", timeout: float = 60) -> requests.Response:
        body = {"model": "tiny:1", **body}
        if route.endswith("chat/completions"):
            body.setdefault("messages", [{"role": "user", "content": "hello there"}])
        return requests.post(self.url + route, json=body, timeout=timeout)

    def in_background(self, body: dict) -> dict:
        out: dict = {}
        thread = threading.Thread(target=lambda: out.setdefault("r", self.post(body)), daemon=True)
        thread.start()
        out["thread"] = thread
        return out

    def close(self):
        self.gate.set()
        self._uv.should_exit = True
        self.predictor.close()


@pytest.fixture(scope="module")
def replica(tiny, ray_cluster):
    r = Replica(tiny)
    yield r
    r.close()


def planning(replica) -> int:
    return replica.predictor.engine.load()["planning"]


def test_a_request_without_a_grammar_never_waits_behind_anothers_compile(replica):
    """Planning ran in one thread, grammar compiles in it: a 4-token request waited 27 s behind 12
    distinct 300 KB schemas. Now grammars compile in a thread of their own, and a plain request is
    answered while a structured one is still compiling."""
    replica.gate.clear()
    structured = replica.in_background({"response_format": SCHEMA, "max_tokens": 4})
    try:
        wait_until(lambda: planning(replica) == 1, 30, "the structured request admitted and compiling")
        plain = replica.post({"max_tokens": 4, "ignore_eos": True}, timeout=30)
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4
        assert structured["thread"].is_alive()
    finally:
        replica.gate.set()
    structured["thread"].join(60)
    assert structured["r"].status_code == 200


@pytest.mark.parametrize("route,body,param", [
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "f"}}] * 20000}}}, "tool_choice.allowed_tools.tools"),
    ("chat", {"messages": [{"role": "user"}] * 15000}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 5000}]},
     "messages.0.content"),
    ("chat", {"stop": ["a"] * 50000}, "stop"),
    ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("chat", {"logit_bias": {"²": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"٣": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "x-guidance": {"whitespace_flexible": True}}}}}, "response_format.json_schema.schema"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "x-guidance": {"whitespace_flexible": True}}}}], "tool_choice": "required"},
     "tools.0.function.parameters"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}}},
     "response_format.json_schema.schema"),
    ("chat", {"tools": [{"type": "function", "function": {"name": f"f{j}", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(800)}}}} for j in range(4)]},
     "tools"),
    ("text", {"prompt": [[1]] * 50000}, "prompt"),
    ("text", {"prompt": [1] * 100000 + ["x"]}, "prompt"),
])
def test_every_list_is_bounded_and_every_key_checked_with_a_400_naming_the_field(replica, route, body, param):
    """Lists were bounded after validating every item (20,000 allowed tools held the event loop 1.8 s
    and were answered 200), '²' passed as a token id and failed as a 400 naming `messages`, '٣' was
    token 3, a client's x-guidance turned our JSON whitespace rules off, schemas had no size limit."""
    answer = replica.post(body, "/v1/chat/completions" if route == "chat" else "/v1/completions")
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.json()


def test_a_grammar_compiles_once_and_a_failed_one_is_refused_again_without_compiling(tiny):
    from transformers import AutoTokenizer

    from workflows.tasks.chat.grammar import GrammarError, Grammars, schema_grammar

    tok = AutoTokenizer.from_pretrained(tiny)
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    text = schema_grammar(SCHEMA["json_schema"]["schema"], strict=True)
    a, b = grammars.constraint(text, "x"), grammars.constraint(text, "x")
    assert grammars.compiles == 1 and a.matcher is not b.matcher
    bad = schema_grammar({"type": "string", "pattern": "("}, strict=False)
    for param in ("response_format.json_schema.schema", "tools"):
        with pytest.raises(GrammarError) as refused:
            grammars.constraint(bad, param)
        assert refused.value.param == param and str(refused.value).startswith(param)
    assert grammars.compiles == 2


def test_a_request_still_planning_counts_against_capacity_and_its_deadline_runs_from_arrival(tiny, ray_cluster):
    """A request being planned was invisible to admission (no 429 while it planned, however many) and
    its serve.generate.timeout_s started only once the engine had it. Now a replica at capacity answers
    429 at once, and a request whose planning outlasts its deadline ends with "timeout"."""
    replica = Replica(tiny, max_batch=1, max_queue=0, timeout_s=1.0)
    try:
        replica.gate.clear()
        slow = replica.in_background({"response_format": SCHEMA, "max_tokens": 50})
        wait_until(lambda: planning(replica) == 1, 30, "the structured request admitted and compiling")
        busy = replica.post({"max_tokens": 4}, timeout=10)
        assert busy.status_code == 429 and busy.headers["retry-after"] and \
            busy.json()["error"]["code"] == "server_busy"
        time.sleep(1.2)  # past the deadline, still compiling
        replica.gate.set()
        slow["thread"].join(60)
        assert slow["r"].status_code == 200 and slow["r"].json()["choices"][0]["finish_reason"] == "timeout"
        assert planning(replica) == 0
        again = replica.post({"max_tokens": 2, "ignore_eos": True})
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
    finally:
        replica.close()


class Panic(BaseException):
    """What a tokenizer's Rust panic raises in Python (pyo3's PanicException is a BaseException)."""


class PanickingTokenizer:
    def __init__(self, tokenizer):
        self._tokenizer, self.armed = tokenizer, threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, *args, **kwargs):
        if self.armed.is_set():
            raise Panic("tokenizer panicked")
        return self._tokenizer.decode(*args, **kwargs)


def test_a_dead_decode_thread_fails_what_is_pending_at_once_and_the_replica_reports_unhealthy(tiny, ray_cluster):
    """A BaseException (a tokenizer's panic) ended the decode thread silently: every request in flight
    waited forever while /healthz answered ok. Now they fail at once, new ones get a 503, /healthz is a
    503 naming why and Ray Serve's health check fails (so Serve replaces the replica)."""
    from workflows.serve.app import ModelServer

    replica = Replica(tiny)
    try:
        engine = replica.predictor.engine
        engine.tokenizer = tokenizer = PanickingTokenizer(engine.tokenizer)
        assert requests.get(replica.url + "/healthz", timeout=10).status_code == 200
        streaming = replica.in_background({"max_tokens": 200, "ignore_eos": True, "stream": True})
        direct = engine.submit([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), deadline=False)
        wait_until(lambda: engine.load()["running"] == 2, 30, "the stream and the direct request decoding")
        tokenizer.armed.set()
        streaming["thread"].join(30)
        events = [line for line in streaming["r"].text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "engine_stopped"
        with pytest.raises(EngineStopped):
            direct.result(10)
        health = requests.get(replica.url + "/healthz", timeout=10)
        assert health.status_code == 503 and "decode thread died" in health.json()["error"]
        refused = replica.post({"max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_stopped"
        with pytest.raises(RuntimeError, match="decode thread died"):
            ModelServer.func_or_class.check_health(replica.server)
    finally:
        replica.close()


def test_non_finite_logits_fail_their_own_row_only_on_every_kind_of_row():
    """A NaN row sampled with top_p < 1 made `gather` raise and failed the whole batch; a greedy NaN row
    was answered with token 0. Now each broken row fails alone with a clear error."""
    from workflows.tasks.chat.engine.sampler import NonFinite, Sampler

    vocab = 50
    sampler = Sampler(vocab, 6, torch.device("cpu"))
    settings = [SamplingParams(8, temperature=1.0, top_p=0.5, seed=1), SamplingParams(8, temperature=0),
                SamplingParams(8, temperature=1.0, seed=2), SamplingParams(8, temperature=0),
                SamplingParams(8, temperature=0.7, top_p=0.9, seed=3, logprobs=2), SamplingParams(8, temperature=0)]
    rows = [sampler.row(p, slot) for slot, p in enumerate(settings)]
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, 3] = logits[1, 7] = float("nan")
    logits[2, 1] = float("inf")
    logits[5] = float("-inf")
    out = sampler.choose(logits.clone(), rows)
    assert all(isinstance(out[i], NonFinite) and "not finite" in str(out[i]) for i in (0, 1, 2, 5))
    assert out[3][0] == int(logits[3].argmax()) and isinstance(out[4][0], int) and len(out[4][1].top) == 2


def test_detokenizing_reads_a_bounded_window_whatever_the_tokens(tiny):
    """Tokens that decode to nothing never advanced the window: with ignore_eos and a logit_bias on
    such a token, each step decoded everything since, O(max_tokens²) in the decode thread."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    widest = []

    class Counting:
        def decode(self, ids, **kw):
            widest.append(len(ids))
            return tok.decode(ids, **kw)

    state = TextState(())
    special, word = tok.convert_tokens_to_ids("<|im_start|>"), tok("hello").input_ids
    for _ in range(2000):
        state.add(special, Counting())
    for t in word:
        state.add(t, Counting())
    assert max(widest) <= 16 and state.delta(final=True) == "hello"


def test_an_unknown_alias_is_a_404_naming_the_model_only_and_is_looked_up_once(tmp_path, monkeypatch):
    """`"model": "ghost@production"` was answered naming the registry's URI, and each request cost a
    listing. Now the answer names the model only, and a failed lookup is kept as long as an answer is."""
    import asyncio

    from tests.conftest import ROOT
    from workflows import registry
    from workflows.config import load_config
    from workflows.errors import UserError
    from workflows.serve.app import ModelServer
    from workflows.storage.uri import StorageContext

    server = object.__new__(ModelServer.func_or_class)
    server.cfg = load_config(ROOT / "configs" / "chat.yaml", [f"storage.root={tmp_path}/store",
                                                              "storage.embedded.enabled=false"])
    server.storage, server.served_as, server._pins = StorageContext.from_config(server.cfg.storage), None, {}
    lookups = []
    real = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda *a: (lookups.append(a[-1]), real(*a))[1])
    for _ in range(3):
        with pytest.raises(UserError) as refused:
            asyncio.run(server.pin("ghost@production"))
        assert "ghost" in str(refused.value) and str(tmp_path) not in str(refused.value)
        assert "store" not in str(refused.value) and "file:" not in str(refused.value)
    assert lookups == ["ghost@production"]

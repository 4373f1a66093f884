"""Serving a chat model (#50): the continuous-batching engine (workflows.tasks.chat.engine) on a tiny
random Llama without Ray."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tests.chat_serve_task import build_tiny_chat
from tests.helpers import wait_until
from workflows.tasks.chat.engine import Engine, QueueFull
from workflows.tasks.chat.sampling import SamplingParams, TextState

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
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer("hello world the cat " * (1 + k % 4) + "dog " * (k % 3) + "sat").input_ids for k in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def test_greedy_tokens_are_the_same_alone_and_beside_requests_that_come_and_go(tiny, engine):
    """Six requests with staggered arrivals share steps of a batch of up to 4 (one joins as another
    ends): each gets, token for token, what it gets alone, which is what `generate` gives."""
    _, model, tokenizer = tiny
    ps = prompts(tokenizer, 6)
    e = engine(max_batch=4)
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
    assert e.load() == {"running": 0, "waiting": 0}


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

"""The chat engine's parts on a tiny random Llama, without Ray (#60): prefill batched and chunked beside
decoding, the KV cache written in place (slots), the batched sampler (logit bias, penalties, constraints,
top-p, log probabilities), deadlines, prompt limits, and what the engine reports per step."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from tests.chat_serve_task import build_tiny_chat
from tests.helpers import wait_until
from workflows.tasks.chat.engine import Engine, EngineMetrics, PromptTooLong, SamplingParams, StepReport
from workflows.tasks.chat.engine.sampler import Sampler

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, tokenizer) of the tiny chat model."""
    return build_tiny_chat(tmp_path_factory.mktemp("tinychat"))


@pytest.fixture
def engine(tiny):
    made = []

    def make(**kw):
        e = Engine(tiny[0], tiny[1], **kw)
        e.eos = set()  # every request runs to its max_tokens
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def words(tokenizer, n: int) -> list[int]:
    """A prompt of n tokens (the tiny tokenizer has a token per word)."""
    vocab = "hello world the cat dog sat on mat is big small red".split()
    return tokenizer(" ".join(vocab[i % len(vocab)] for i in range(n))).input_ids[:n]


def hold(e: Engine) -> threading.Event:
    """Block the decode thread (a command) until the returned event is set."""
    release, started = threading.Event(), threading.Event()
    e.call(lambda: (started.set(), release.wait(30)))
    assert started.wait(30)
    return release


def test_requests_that_arrive_together_are_prefilled_in_one_forward(tiny, engine):
    e = engine(max_batch=4)
    ps = [words(tiny[1], n) for n in (5, 9, 13, 7)]
    release = hold(e)
    gens = [e.submit(p, greedy(3)) for p in ps]
    release.set()
    for g in gens:
        g.result(60)
    assert {g.steps[0] for g in gens} == {0}  # all joined at the first step
    assert len({g.times["first_token"] for g in gens}) == 1  # and got their first token from its forward
    assert e.stats["prefill_tokens"] == sum(map(len, ps)) and e.stats["steps"] == 3


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(tiny, engine):
    """While a 40-token prompt is prefilled 9 tokens a step (the chunk of 8 plus one per decoding row), a
    decoding request gets a token at every step; both get the tokens they get alone."""
    tok = tiny[1]
    e = engine(max_batch=2, prefill_chunk=8, max_prefill_tokens=64, mixed_step_ratio=None)
    short, long = words(tok, 6), words(tok, 40)
    alone = {}
    for name, p in (("short", short), ("long", long)):
        g = e.submit(p, greedy(30))
        g.result(60)
        alone[name] = g.tokens
    a = e.submit(short, greedy(30))
    wait_until(lambda: len(a.tokens) >= 2, 30, "the short request decoding", every=0.001)
    b = e.submit(long, greedy(30))
    a.result(60), b.result(60)
    assert a.tokens == alone["short"] and b.tokens == alone["long"]
    first = b.times["first_token"]
    # the long prompt took 5 steps (40 / 9), the short request had a token from each of them
    during = [t for t in a.token_times if b.times["submitted"] <= t <= first]
    assert len(during) >= 4, (len(during), a.token_times, b.times)


def joining_two_decoding_rows(tiny, engine, **settings) -> list[tuple[int, int, int]]:
    """Four prompts joining at once beside two decoding rows, on the token budget (prefill_chunk 3): every
    request gets the tokens it gets alone; the steps that prefilled beside decoding rows (prompt tokens,
    decoding rows, rows after the step)."""
    tok = tiny[1]
    watcher = Recorder()
    e = engine(max_batch=6, prefill_chunk=3, max_prefill_tokens=64, mixed_step_ratio=None, metrics=watcher,
               **settings)
    running, burst = [words(tok, 5), words(tok, 7)], [words(tok, n) for n in (11, 9, 13, 10)]
    alone = []
    for p in running + burst:
        g = e.submit(p, greedy(24))
        g.result(60)
        alone.append(g.tokens)
    first = [e.submit(p, greedy(24)) for p in running]
    wait_until(lambda: all(len(g.tokens) >= 2 for g in first), 30, "two requests decoding", every=0.001)
    release = hold(e)
    watcher.reports.clear()
    later = [e.submit(p, greedy(24)) for p in burst]
    release.set()
    assert [g.result(60) and g.tokens for g in first + later] == alone
    steps = [(r.prefill_tokens, r.decode_tokens, r.running) for r in watcher.reports]
    beside = [(p, d, n) for p, d, n in steps if p and d]
    assert sum(p for p, _, _ in beside) == sum(map(len, burst)), steps
    return beside


def test_a_step_beside_decoding_rows_prefills_a_chunk_plus_one_per_decoding_row_and_a_chunk_per_excess_joiner(
        tiny, engine):
    """Without waves (prefill_wave null): while more rows prefill than decode, each one beyond the decoding
    ones adds a chunk to the step's budget; once no more prefill than decode, a step prefills at most one
    chunk plus a token per decoding row."""
    beside = joining_two_decoding_rows(tiny, engine, prefill_wave=None)
    # the first such step: 2 decoding, 4 prefilling -> 2 + 3 * (4 - 2) tokens
    assert beside[0][:2] == (2 + 3 * 2, 2) and len(beside) >= 4, beside
    for p, d, n in beside:  # n - d rows were prefilling at that step (the running count is after it)
        assert p <= d + 3 * max(1, n - 2 * d), beside


def test_a_wave_of_prompts_beside_few_decoding_rows_is_prefilled_in_one_step(tiny, engine):
    """Four prompts joining two decoding rows are a wave (prefill_wave 2): one step prefills all of them, the
    two streams waiting that one step, and all six decode in step from then on."""
    beside = joining_two_decoding_rows(tiny, engine)
    assert [d for _, d, _ in beside] == [2], beside


def test_the_next_requests_of_clients_whose_requests_ended_together_join_in_one_step(tiny, engine):
    """A closed loop's wave: four requests end in one step, their clients' next ones arrive 30 ms apart; the
    empty batch's step waits for them (join_wait_s), so all four are prefilled together, not the first alone
    and the others beside its stream. Nothing waits longer than the last of them."""
    tok = tiny[1]
    e = engine(max_batch=4, join_wait_s=5.0)
    release = hold(e)
    first = [e.submit(words(tok, 6), greedy(2)) for _ in range(4)]
    release.set()
    for g in first:
        g.result(60)
    assert len({g.steps[1] for g in first}) == 1  # they ended together: the batch emptied
    nxt = []
    for n in (5, 8, 11, 7):
        nxt.append(e.submit(words(tok, n), greedy(3)))
        time.sleep(0.03)
    for g in nxt:
        g.result(60)
    assert len({g.steps[0] for g in nxt}) == 1, [g.steps for g in nxt]
    assert nxt[0].times["first_token"] - nxt[-1].times["submitted"] < 2.0  # gathered, not held for join_wait_s


def test_a_lone_clients_next_request_and_one_at_an_idle_engine_do_not_wait(tiny, engine):
    """join_wait_s long: a request reaching an idle engine with none being planned steps at once, and so
    does a lone client's next request after its last one ended; one being planned holds the step for it,
    up to join_wait_s at most."""
    tok = tiny[1]
    e = engine(max_batch=4, join_wait_s=5.0)
    for _ in range(3):
        g = e.submit(words(tok, 6), greedy(2))
        g.result(60)
        assert g.times["first_token"] - g.times["submitted"] < 2.0
    e.admit()  # a request still being planned: the next step waits for it
    alone = e.submit(words(tok, 5), greedy(2))
    time.sleep(0.2)
    assert not alone.tokens
    planned = e.submit(words(tok, 7), greedy(2), admitted=True)
    alone.result(60), planned.result(60)
    assert alone.steps[0] == planned.steps[0]
    short = engine(max_batch=4, join_wait_s=0.3)
    short.admit()  # never submitted: the step waits join_wait_s, then runs without it
    g = short.submit(words(tok, 5), greedy(2))
    g.result(60)
    assert 0.3 <= g.times["first_token"] - g.times["submitted"] < 3.0
    short.release()
    release = hold(short)
    ended = [short.submit(words(tok, 6), greedy(2)) for _ in range(4)]
    release.set()
    for g in ended:
        g.result(60)
    time.sleep(0.5)  # their clients did not come back within join_wait_s: a later request does not wait for them
    g = short.submit(words(tok, 5), greedy(2))
    g.result(60)
    assert g.times["first_token"] - g.times["submitted"] < 0.25


def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(tiny, engine):
    tok = tiny[1]
    ps = [words(tok, n) for n in (3, 17, 29, 11, 23)]
    whole = engine(max_batch=5)
    chunked = engine(max_batch=5, prefill_chunk=4, max_prefill_tokens=6)
    want = []
    for p in ps:
        g = whole.submit(p, greedy(12))
        g.result(60)
        want.append(g.tokens)
    gens = [chunked.submit(p, greedy(12)) for p in ps]
    for g in gens:
        g.result(60)
    assert [g.tokens for g in gens] == want
    assert chunked.stats["steps"] > whole.stats["steps"] / len(ps)


@pytest.mark.parametrize("kernel", ["kernel", "torch"])
def test_a_long_request_beside_short_ones_decodes_as_alone(tiny, engine, kernel):
    """With torch's operators, a row far longer than the others attends over its own slot alone (the
    others' attention reads their own lengths only); with the kernel, every row reads its own length:
    every row still gets the tokens it gets alone."""
    tok = tiny[1]
    e = engine(max_batch=4, attention_kernel=kernel)
    ps = [words(tok, 150), words(tok, 4), words(tok, 6), words(tok, 5)]
    alone = []
    for p in ps:
        g = e.submit(p, greedy(10))
        g.result(60)
        alone.append(g.tokens)
    release = hold(e)
    gens = [e.submit(p, greedy(10)) for p in ps]
    release.set()
    assert [g.result(60) and g.tokens for g in gens] == alone
    plan = e.cache.plan([0, 1, 2, 3], [150, 4, 6, 5], [0, 1, 2, 3], [])
    if kernel == "torch":
        assert [slot for _, slot, _ in plan.alone] == [0] and plan.decode_len == 7
    else:
        assert plan.kernel_lengths.tolist() == [151, 5, 7, 6] and plan.alone == [] and plan.decode_mask is None
    # prefill chunks likewise: those of similar reach attend together, a far longer one alone
    plan = e.cache.plan([0] * 4 + [1] * 3 + [2] * 2, [140, 141, 142, 143, 0, 1, 2, 3, 4], [], [(0, 4), (4, 3), (7, 2)])
    assert [slot for _, _, slot, _, _ in plan.prefills] == [0] and plan.prefill_group is not None
    assert plan.prefill_group.slots.tolist() == [1, 2] and plan.prefill_group.length == 5


def test_the_cache_is_written_in_place(tiny, engine):
    """A request keeps its slot; another joining writes its own slot only, and one leaving copies
    nothing: the first request's keys are where they were, the storage the same tensors."""
    tok = tiny[1]
    e = engine(max_batch=3)
    release = hold(e)
    a = e.submit(words(tok, 10), greedy(200))
    release.set()
    wait_until(lambda: len(a.tokens) >= 3, 30, "the first request decoding", every=0.001)
    cache = e.cache
    pointers = [k.data_ptr() for k in cache.keys]
    release = hold(e)
    before = cache.keys[0][0, :, :10].clone()
    b = e.submit(words(tok, 5), greedy(3))
    release.set()
    b.result(60)
    release = hold(e)
    assert torch.equal(cache.keys[0][0, :, :10], before)  # slot 0 (a's) untouched by b's join and leave
    assert [k.data_ptr() for k in cache.keys] == pointers and cache.free_slots() == 2
    release.set()
    a.cancel()
    a.result(60)
    assert cache.free_slots() == 3
    assert cache.bytes_bound == 3 * e.max_context * cache.bytes_per_token
    assert cache.capacity <= e.max_context and cache.allocated_bytes <= cache.bytes_bound


def test_a_request_past_its_deadline_ends_with_timeout(tiny, engine):
    """Waiting (the decode thread held) or generating (each step slowed), a request past timeout_s ends
    with finish reason "timeout" and the text it has."""
    tok = tiny[1]
    e = engine(max_batch=2, timeout_s=0.3)
    release = hold(e)
    queued = e.submit(words(tok, 5), greedy(5))
    threading.Timer(0.5, release.set).start()
    assert queued.result(30) == ("", "timeout") and queued.tokens == []
    forward = e.model.forward

    def slow(*args, **kwargs):
        threading.Event().wait(0.02)
        return forward(*args, **kwargs)

    e.model.forward = slow
    try:
        running = e.submit(words(tok, 5), greedy(10_000))
        text, reason = running.result(30)
        batch = e.submit(words(tok, 5), greedy(3), deadline=False)  # batch work: no deadline
        assert batch.result(30)[1] == "length"
    finally:
        del e.model.forward
    assert reason == "timeout" and 0 < len(running.tokens) < 10_000 and text


def test_prompt_limits_are_checked_before_any_compute(tiny, engine):
    e = engine(max_prompt_tokens=20)
    with pytest.raises(PromptTooLong, match="the most this server takes is 20"):
        e.submit([5] * 21, greedy(1))
    with pytest.raises(PromptTooLong, match="context is 256"):
        e.submit([5] * 256, greedy(1))
    with pytest.raises(ValueError, match="logit_bias: token 100000"):
        e.submit([5] * 4, greedy(1, logit_bias={100_000: 1.0}))
    assert e.stats["steps"] == 0


class Recorder(EngineMetrics):
    def __init__(self):
        self.reports: list[StepReport] = []
        self.rejections: list[str] = []

    def step(self, report):
        self.reports.append(report)

    def rejected(self, reason, adapter=None):
        self.rejections.append(reason)


def test_each_step_reports_tokens_latencies_and_the_cache(tiny, engine):
    tok = tiny[1]
    watcher = Recorder()
    e = engine(max_batch=2, max_queue=0, max_prompt_tokens=30, metrics=watcher)
    ps = [words(tok, 7), words(tok, 12)]
    gens = [e.submit(p, greedy(5)) for p in ps]
    with pytest.raises(Exception, match="busy"):
        e.submit(ps[0], greedy(5))
    with pytest.raises(PromptTooLong):
        e.submit(words(tok, 31), greedy(5))
    for g in gens:
        g.result(60)
    # the step's report follows its deltas
    reports = wait_until(lambda: watcher.reports if watcher.reports[-1].running == 0 else None, 30, "the last report")
    assert watcher.rejections == ["queue_full", "context_length_exceeded"]
    assert sum(r.prefill_tokens for r in reports) == 19 and sum(r.decode_tokens for r in reports) == 2 * 4
    assert sorted(g.id for r in reports for g, _ in r.first_tokens) == sorted(g.id for g in gens)
    assert len([s for r in reports for _, s in r.token_gaps]) == 2 * 4
    assert all(s >= 0 for r in reports for _, s in r.token_gaps + r.first_tokens)
    assert sorted(g.id for r in reports for g in r.finished) == sorted(g.id for g in gens)
    # the most in use: both rows after their 4th step (a row's last token is never written, and it leaves then)
    assert max(r.cache_tokens for r in reports) == 7 + 3 + 12 + 3
    assert reports[-1].running == 0 and reports[-1].cache_tokens == 0 and reports[-1].cache_capacity_tokens > 0


# --- the sampler, on logits made here ---------------------------------------------------------------

def choose(rows: list[SamplingParams], logits: torch.Tensor, sampler: Sampler | None = None):
    sampler = sampler or Sampler(logits.shape[-1], len(rows), torch.device("cpu"))
    return sampler.choose(logits, [sampler.row(p, i) for i, p in enumerate(rows)])


def test_logit_bias_and_penalties_move_the_choice_as_openai_defines_them():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]] * 3)
    out = choose([greedy(1, logit_bias={3: 5.0}), SamplingParams(1, seed=1, logit_bias={2: 100.0}),
                  greedy(1, logit_bias={0: -100.0})], logits.clone())  # processed in place
    assert [t for t, _ in out] == [3, 2, 1]  # type: ignore[misc]
    sampler = Sampler(4, 1, torch.device("cpu"))
    params = greedy(5, logprobs=0, presence_penalty=0.4, frequency_penalty=0.3)
    row = sampler.row(params, 0)
    picks, logprobs = [], []
    for _ in range(4):
        (token, lp), = sampler.choose(logits[:1].clone(), [row])  # type: ignore[misc]
        sampler.accepted([row], [token])
        picks.append(token)
        logprobs.append(lp.logprob)
    # token 0: 2.0, then 2.0 - 0.4 - 0.3 = 1.3 (still first), then 1.0 (ties with 1's 1.0: argmax takes the first),
    # then 0.7 < token 1's 1.0
    assert picks == [0, 0, 0, 1]
    counts = torch.tensor([3.0, 0, 0, 0])
    want = torch.log_softmax(logits[0] - 0.3 * counts - 0.4 * (counts > 0), -1)[1]
    assert logprobs[-1] == pytest.approx(float(want), abs=1e-6)


def test_a_constraint_masks_sees_the_token_and_ends_the_request(tiny, engine):
    """A TokenConstraint (the protocol structured output builds on): its mask applies to its row only,
    `accept` gets each chosen token, and `done` ends the request with "stop"."""
    tok = tiny[1]
    allowed = tok.convert_tokens_to_ids(["cat", "dog", "mat"])

    class ThreeWords:
        def __init__(self):
            self.seen: list[int] = []

        def mask(self, logits):
            keep = logits[allowed].clone()
            logits.fill_(float("-inf"))
            logits[allowed] = keep

        def accept(self, token):
            self.seen.append(token)

        def done(self):
            return len(self.seen) == 3

    e = engine(max_batch=2)
    c = ThreeWords()
    free = e.submit(words(tok, 6), greedy(6))
    g = e.submit(words(tok, 6), SamplingParams(max_tokens=10, temperature=1.0, seed=3, constraint=c))
    assert g.result(60)[1] == "stop" and g.tokens == c.seen and set(c.seen) <= set(allowed)
    free.result(60)
    assert not set(free.tokens) <= set(allowed)  # the other row was not constrained


def test_sampled_tokens_follow_temperature_and_top_p():
    """Draws with 4,000 seeds against the distribution: softmax(logits / T), renormalized over the
    smallest set of most probable tokens reaching top_p; nothing outside that set."""
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -3.0])
    n = 4000
    for params, p in ((dict(temperature=0.7), torch.softmax(logits / 0.7, -1)),
                      (dict(temperature=1.0, top_p=0.8), None)):
        rows = [SamplingParams(1, seed=s, **params) for s in range(n)]
        out = choose(rows, logits.expand(n, -1).clone())
        counts = torch.bincount(torch.tensor([t for t, _ in out]), minlength=6).double() / n  # type: ignore[misc]
        if p is None:  # top_p 0.8 of softmax(logits): tokens 0, 1 and 2 (their cumulative mass first reaches 0.8)
            q = torch.softmax(logits, -1)
            p = torch.zeros(6)
            p[:3] = q[:3] / q[:3].sum()
        assert counts[p == 0].sum() == 0
        assert torch.allclose(counts, p.double(), atol=0.03), (counts, p)


def test_logprobs_are_those_of_the_distribution_drawn_from():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -3.0]] * 3)
    rows = [greedy(1, logprobs=2), SamplingParams(1, temperature=0.5, seed=4, logprobs=3),
            SamplingParams(1, temperature=1.0, top_p=0.8, seed=5, logprobs=5)]
    (g_tok, g_lp), (s_tok, s_lp), (p_tok, p_lp) = choose(rows, logits.clone())  # type: ignore[misc]
    full = torch.log_softmax(logits[0], -1)
    assert g_tok == 0 and g_lp.logprob == pytest.approx(float(full[0]), abs=1e-6)
    assert [t for t, _ in g_lp.top] == [0, 1] and g_lp.top[1][1] == pytest.approx(float(full[1]), abs=1e-6)
    scaled = torch.log_softmax(logits[0] / 0.5, -1)
    assert s_lp.logprob == pytest.approx(float(scaled[s_tok]), abs=1e-6) and len(s_lp.top) == 3
    nucleus = torch.softmax(logits[0], -1)[:3]
    want = torch.log(nucleus / nucleus.sum())
    assert p_tok in (0, 1, 2) and p_lp.logprob == pytest.approx(float(want[p_tok]), abs=1e-5)
    assert [t for t, _ in p_lp.top] == [0, 1, 2]  # outside the nucleus: probability 0, left out
    assert math.fsum(math.exp(v) for _, v in p_lp.top) == pytest.approx(1.0, abs=1e-5)


def test_the_grafana_dashboard_reads_the_metrics_the_engine_exports():
    """cluster/grafana/generate.json: every series it queries is one workflows.tasks.chat.serving.metrics defines,
    with the suffix Prometheus gives its kind, and every metric has a panel."""
    import json
    import re

    from tests.conftest import ROOT
    from workflows.tasks.chat.serving.metrics import METRICS

    suffixes = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",), "gauge": ("",)}
    exported = {f"ray_{name}{suffix}": key for key, (kind, name, _, _) in METRICS.items() for suffix in suffixes[kind]}
    dashboard = json.loads((ROOT / "cluster" / "grafana" / "generate.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {m for e in exprs for m in re.findall(r"ray_workflows_generate_\w+", e)}
    assert queried and queried <= set(exported), queried - set(exported)
    assert {exported[m] for m in queried} == set(METRICS)


def test_serves_admission_agrees_with_the_engines():
    """A chat model's deployment (and the Serve config file written for it): a replica takes the batch,
    the queue and as many again (its engine answers those 429 at once), Serve keeps a batch's worth more
    waiting, then answers 429 with the engine's Retry-After itself; valid for Serve's schema."""
    from ray.serve.schema import ServeDeploySchema

    from tests.conftest import ROOT
    from workflows.config import load_config
    from workflows.serve.app import deployment_options
    from workflows.serve.deploy_config import serve_config

    cfg = load_config(ROOT / "configs" / "chat.yaml", ["serve.generate.max_batch=16", "serve.generate.max_queue=64",
                                                       "serve.generate.retry_after_s=3"])
    opts = deployment_options(cfg)
    assert opts["max_ongoing_requests"] == 2 * 16 + 64 and opts["max_queued_requests"] == 16
    assert opts["backpressure_config"] == {"status_code": 429, "retry_after_s": 3}
    doc = serve_config(cfg, str(ROOT / "configs" / "chat.yaml"), [], ["chat:1"])
    ServeDeploySchema.model_validate(doc)
    assert doc["applications"][0]["deployments"][0]["backpressure_config"]["status_code"] == 429
    quickstart = deployment_options(load_config(ROOT / "configs" / "quickstart.yaml", []))
    assert "max_queued_requests" not in quickstart and quickstart["max_ongoing_requests"] >= 32


def test_packed_linears_compute_with_their_weights_and_follow_changes_to_them():
    """The engine's fp32 CPU linears compute with a oneDNN-packed copy of their weights (engine.linear): the
    same outputs; a weight changed in place, gradients on, or another dtype use the weight itself."""
    import torch.nn.functional as F

    from workflows.tasks.chat.engine.linear import PackedLinear, pack_linears, packing_available

    if not packing_available():
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8, bias=False))
    x = torch.randn(3, 5, 24)
    before = model(x)
    assert pack_linears(model) == 4 * (24 * 40 + 40 * 8)  # the weights' bytes, held a second time
    assert all(type(m) is PackedLinear for m in (model[0], model[2])) and isinstance(model[0], torch.nn.Linear)
    with torch.inference_mode():
        assert torch.allclose(model(x), before, atol=1e-5)
        assert model[0]._packed is not None
    with torch.no_grad():
        model[2].weight.mul_(2)  # in place: the packed copy is stale and is not used
    with torch.inference_mode():
        assert torch.allclose(model(x), 2 * before, atol=1e-5)
    pack_linears(model)  # packs it again
    with torch.inference_mode():
        assert torch.allclose(model(x), 2 * before, atol=1e-5)
    import copy

    twin = copy.deepcopy(model)  # a copy leaves the packed weight out (oneDNN's opaque tensor) and computes
    assert twin[0]._packed is None and model[0]._packed is not None
    with torch.inference_mode():
        assert torch.allclose(twin(x), 2 * before, atol=1e-5)
    model(x).sum().backward()  # training: the weights themselves, with their gradients
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0
    assert pack_linears(model.to(torch.bfloat16)) == 0  # bf16 is not packed (slower packed on CPU)
    with torch.inference_mode():
        xb = x.bfloat16()
        assert torch.equal(model[0](xb), F.linear(xb, model[0].weight, model[0].bias))


@pytest.mark.parametrize("unpacked_rows", [None, 2])
def test_a_packed_linear_computes_packed_beyond_unpacked_rows_and_with_the_weight_up_to_them(monkeypatch,
                                                                                               unpacked_rows):
    """By default (UNPACKED_ROWS 0) every row count runs oneDNN's packed op, a single row's too (faster there
    than MKL's matrix-vector path: docs/BENCHMARKS.md); with UNPACKED_ROWS set, up to that many rows run
    F.linear on the weight itself."""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from workflows.tasks.chat.engine import linear
    from workflows.tasks.chat.engine.linear import pack_linears, packing_available

    if unpacked_rows is not None:
        monkeypatch.setattr(linear, "UNPACKED_ROWS", unpacked_rows)
    limit = linear.UNPACKED_ROWS
    if not packing_available():
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40)
    pack_linears(torch.nn.Sequential(layer))
    ran = {}
    with torch.inference_mode():
        for rows in (1, 2, 3, 16):
            x = torch.randn(rows, 1, 24)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                y = layer(x)
            ran[rows] = any(e.name == "mkldnn::_linear_pointwise" for e in prof.events())
            assert torch.allclose(y, F.linear(x, layer.weight, layer.bias), atol=1e-5)
    assert ran == {rows: rows > limit for rows in (1, 2, 3, 16)}
    assert limit == (0 if unpacked_rows is None else unpacked_rows)


def test_the_engine_packs_fp32_cpu_linears_unless_told_not_to(tmp_path):
    from workflows.tasks.chat.engine.linear import PackedLinear, packing_available

    model, tokenizer = build_tiny_chat(tmp_path)
    e = Engine(model, tokenizer, prepack=False)
    try:
        assert e.packed_bytes == 0 and not any(isinstance(m, PackedLinear) for m in model.modules())
    finally:
        e.close()
    e = Engine(model, tokenizer)
    try:
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert e.packed_bytes == (sum(m.weight.numel() * 4 for m in linears) if packing_available() else 0)
        assert all(type(m) is PackedLinear for m in linears) or not packing_available()
        tokens = e.submit(words(tokenizer, 6), greedy(5)).result(timeout=60)
        assert tokens
    finally:
        e.close()


def test_the_bench_times_the_engines_decode_steps_with_every_row_decoding(tiny, engine):
    """bench generate's decode step (decode_vs_roofline): the wall time of each step that decoded every
    client's row and prefilled nothing, read from the engine's step reports; its own watcher still sees
    every step."""
    from workflows.bench.generate_local import engine_run

    e = engine(max_batch=4)
    seen = []
    e.metrics = type("Watch", (EngineMetrics,), {"step": lambda self, r: seen.append(r)})()
    # the four clients' threads start as the machine lets them: held until all four wait, they join in one step
    release, out = hold(e), []
    prompts = [words(tiny[1], 5 + i) for i in range(4)]
    runner = threading.Thread(target=lambda: out.append(engine_run(e, prompts, 12, 4)))
    runner.start()
    wait_until(lambda: len(e.scheduler.waiting) == 4, 30, "the four clients' requests")
    release.set()
    runner.join(120)
    steps = out[0]["decode_steps_s"]
    full = [r for r in seen if r.decode_tokens == 4 and not r.prefill_tokens]
    assert len(steps) == len(full) >= 6 and all(s > 0 for s in steps)  # 12 tokens: most steps decode all 4
    assert [r.seconds for r in full] == steps and type(e.metrics).__name__ == "Watch"  # the watcher is back

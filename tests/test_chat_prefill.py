"""The prefill budget in time (#71): a step beside decoding rows takes the prompt tokens whose cost,
learned from the steps that ran, keeps it within serve.generate.mixed_step_ratio of a decode-only step,
so a long prompt joining running streams never stalls them, however fast or slow steps are."""

from __future__ import annotations

import statistics

import pytest
import torch

from tests.chat_serve_task import build_tiny_chat
from tests.helpers import wait_until
from workflows.tasks.chat.engine import Engine, SamplingParams
from workflows.tasks.chat.engine.costs import FLOOR, READY, REFIT, WINDOW, StepCosts, StepShape
from workflows.tasks.chat.engine.measure import gaps_while_prefilled
from workflows.tasks.chat.engine.metrics import EngineMetrics


def test_the_costs_are_learned_and_the_budget_keeps_a_step_within_the_ratio():
    """Mixed steps of a known cost over the decode-only step (plus noise, and a few stalls the fit must
    leave out): the fit finds it, and the tokens it grants a prompt at any position cost at most
    ratio - 1 times the decode-only step, long contexts taking fewer."""
    decode = 0.005
    truth = (0.0015, 0.00002, 2e-8, 0.0002)  # seconds: any prefill, a prompt token, an attended position, an ending
    costs, rng = StepCosts(1.7), torch.Generator().manual_seed(0)
    for _ in range(5):
        costs.observe(StepShape(8, 0, 0, 0), decode)
    assert not costs.ready
    for i in range(8 * REFIT):
        prompt = int(torch.randint(1, 600, (1,), generator=rng))
        position = int(torch.randint(0, 1500, (1,), generator=rng))
        ended = int(torch.rand((), generator=rng) < 0.3)
        shape = StepShape(8, prompt, prompt * position + prompt * (prompt + 1) // 2, ended)
        extra = sum(c * f for c, f in zip(truth, shape.features()))
        stall = 0.04 if i % 9 == 4 else 0.0  # a collection, a preempted core
        costs.observe(shape, decode + extra * (1 + 0.02 * float(torch.randn((), generator=rng))) + stall)
    assert costs.ready and READY <= 2 * REFIT
    assert costs.coef is not None and all(abs(c - t) <= 0.15 * t for c, t in zip(costs.coef[:3], truth)), costs.coef
    for prompt, position in ((1, 0), (24, 100), (300, 1200)):  # what it predicts, the ending's small term too
        shape = StepShape(8, prompt, prompt * position + prompt * (prompt + 1) // 2, 1)
        true = sum(c * f for c, f in zip(truth, shape.features()))
        assert costs.coef[0] + costs.cost(prompt, position, ends=True) == pytest.approx(true, rel=0.1)
    allowance = costs.allowance(8)
    assert costs.bias == pytest.approx(1.0, abs=0.05)  # the fit right, the recent steps' correction near none
    assert allowance == pytest.approx(0.7 * decode / costs.bias - costs.coef[0])
    granted = []
    for position in (0, 500, 1400):
        k, cost = costs.prompt_tokens(allowance, position, remaining=1500)
        assert 1 <= k < 1500 and cost <= allowance
        assert costs.cost(k + 1, position, ends=False) > allowance
        granted.append(k)
    assert granted[0] > granted[1] > granted[2]
    assert costs.prompt_tokens(allowance, 0, remaining=5)[0] == 5
    assert costs.prompt_tokens(0.0, 1000, remaining=50)[0] == 1  # every prompt advances
    for size in range(1, 2 * WINDOW + 1):  # then only steps whose prompt tokens look free (a loaded machine's noise)
        costs.observe(StepShape(8, size % 100 + 1, size % 100 + 1, 0), decode + 0.004 - 0.00002 * (size % 100))
        if size == WINDOW:  # the window holds those alone: its fits find the tokens free
            learned = list(costs.coef)
    assert costs.ready and list(costs.coef) == learned  # the last fit that priced them stays


def test_adapted_steps_are_priced_against_adapted_decode_steps():
    """A replica serving base and LoRA adapter rows in turn: an adapted step computes the adapters' deltas, so
    its decode-only step takes longer. Its mixed steps' prompt tokens are priced over the adapted decode step,
    not the base one (which would make every prompt token look dear and shrink the adapter rows' budget), and
    an adapted step's allowance is a share of the adapted decode step."""
    base_decode, adapted_decode, per_token = 0.060, 0.080, 0.001
    costs, rng = StepCosts(1.7), torch.Generator().manual_seed(0)
    for _ in range(5):
        costs.observe(StepShape(16, 0, 0, 0), base_decode)
        costs.observe(StepShape(16, 0, 0, 0, adapted=True), adapted_decode)
    for i in range(8 * REFIT):
        adapted = i % 2 == 1
        prompt = int(torch.randint(4, 60, (1,), generator=rng))
        shape = StepShape(16, prompt, prompt * (prompt + 1) // 2, 0, adapted=adapted)
        costs.observe(shape, (adapted_decode if adapted else base_decode) + 0.002 + per_token * prompt)
    assert costs.ready and costs.coef is not None
    assert costs.coef[1] == pytest.approx(per_token, rel=0.1)
    assert costs.decode_step(16, adapted=True) == adapted_decode
    assert costs.decode_step(15, adapted=False) == base_decode  # the nearest row count of the kind
    assert costs.allowance(16, adapted=True) == pytest.approx(0.7 * adapted_decode / costs.bias - costs.coef[0])
    assert costs.allowance(16, adapted=True) > costs.allowance(16)
    fresh = StepCosts(1.7)
    fresh.observe(StepShape(4, 0, 0, 0), base_decode)
    assert fresh.decode_step(4, adapted=True) == base_decode  # no adapted step yet: the other kind's


def test_mixed_steps_of_more_rows_than_measured_alone_are_priced_again_once_they_are():
    """A replica's load grows from 8 streams to 16: its first mixed steps of 16 rows come before any
    decode-only step of 16, so they are priced over the step of 8 and their prompt tokens look dear (a
    fixed cost of the 16 rows' extra 20 ms). Once decode-only steps of 16 are measured, the next fit prices
    the window's steps over them: the fixed cost is the true one again, not for WINDOW steps more. Between
    measured row counts the decode-only step is the line between them."""
    decode8, decode16, fixed, per_token = 0.040, 0.060, 0.002, 0.001
    costs, rng = StepCosts(1.7), torch.Generator().manual_seed(0)
    for _ in range(5):
        costs.observe(StepShape(8, 0, 0, 0), decode8)

    def mixed(rows: int, decode: float) -> None:
        prompt = int(torch.randint(4, 60, (1,), generator=rng))
        costs.observe(StepShape(rows, prompt, prompt * (prompt + 1) // 2, 0), decode + fixed + per_token * prompt)

    for _ in range(4 * REFIT):
        mixed(16, decode16)
    assert costs.coef is not None and costs.coef[0] > fixed + 0.01  # priced over the step of 8 rows: too dear
    for _ in range(5):
        costs.observe(StepShape(16, 0, 0, 0), decode16)
    assert costs.decode_step(12) == pytest.approx((decode8 + decode16) / 2)
    for _ in range(REFIT):
        mixed(16, decode16)
    assert costs.coef[0] == pytest.approx(fixed, abs=0.001) and costs.coef[1] == pytest.approx(per_token, rel=0.1)
    # beyond the most rows measured alone: theirs, and a prompt token's cost for each row more
    assert costs.decode_step(20) == pytest.approx(decode16 + 4 * costs.coef[1])


def test_steps_of_a_few_prompt_tokens_never_starve_the_prompts():
    """Mixed steps that each took one to three prompt tokens, with a noisy extra the fit charges to the fixed
    part: the allowance still keeps half the step's room for prompt tokens, so they get many a step, not one
    (which would keep the steps too small to learn otherwise)."""
    decode, rng = 0.045, torch.Generator().manual_seed(0)
    costs = StepCosts(1.5)
    for _ in range(5):
        costs.observe(StepShape(8, 0, 0, 0), decode)
    for _ in range(8 * REFIT):
        prompt = int(torch.randint(1, 4, (1,), generator=rng))
        costs.observe(StepShape(8, prompt, 40 * prompt, 0),
                      decode + 0.02 + 0.0005 * prompt + 0.002 * float(torch.rand((), generator=rng)))
    assert costs.coef is not None and costs.coef[0] * costs.bias >= 0.5 * decode * 0.5  # the fixed part over half
    allowance = costs.allowance(8)
    assert allowance == pytest.approx(FLOOR * 0.5 * decode / costs.bias)
    assert costs.prompt_tokens(allowance, 40, remaining=60)[0] > 4


def test_prompts_beside_streams_get_the_time_budget_and_a_wave_beside_few_streams_joins_at_once():
    """Prompts joining one decoding row, fewer than prefill_wave (2) per decoding row: the step's prompt tokens
    cost at most the allowance of a step of one decoding row. Six joining it are a wave: the step takes
    max_prefill_tokens of their prompts at once (held to the time budget, they would join a few tokens a
    step, the batch part-empty meanwhile); with prefill_wave null they get the time budget too."""
    from types import SimpleNamespace

    from workflows.tasks.chat.engine.scheduler import Row, Scheduler

    decode, truth = 0.02, (0.001, 0.0002, 1e-8, 0.0005)

    def scheduler(wave: float | None) -> Scheduler:
        made = Scheduler(max_batch=8, max_queue=0, prefill_chunk=24, max_prefill_tokens=2048, prefill_wave=wave)
        assert made.costs is not None
        made.costs.observe(StepShape(1, 0, 0, 0), decode)
        for i in range(READY + REFIT):
            prompt = 20 + 40 * i
            shape = StepShape(1, prompt, prompt * (prompt + 1) // 2, 0)
            made.costs.observe(shape, decode + sum(c * f for c, f in zip(truth, shape.features())))
        assert made.costs.ready
        return made

    def row(slot: int, prompt: int, done: int) -> Row:
        gen = SimpleNamespace(prompt=list(range(prompt)), adapter=None)
        return Row(gen, slot, sampling=None, text=None, limit=8, done=done, pos=done, last=5)  # type: ignore[arg-type]

    def granted(made: Scheduler, joining: int) -> list[int]:
        step = made.plan([row(0, 10, 10)] + [row(slot, 400, 0) for slot in range(1, joining + 1)], "base")
        assert len(step.decode) == 1
        return [n for _, _, n in step.prefills]

    for made, joining in ((scheduler(2.0), 1), (scheduler(None), 6)):
        costs = made.costs
        assert costs is not None and costs.coef is not None
        grants = granted(made, joining)
        spent = sum(costs.cost(n, 0, False) for n in grants)
        bound = (costs.ratio - 1) * decode / costs.bias - costs.coef[0]  # a step of one decoding row's allowance
        assert 0 < spent <= bound, (joining, spent, bound)
        # a later row joins only with two tokens or more: a lone token would cost its own attention call
        assert min(grants) >= 2, grants
    assert granted(scheduler(2.0), 6) == [400] * 5 + [48]  # a wave: max_prefill_tokens, in order of arrival
    assert sum(granted(scheduler(2.0), 2)) == 800  # two per decoding row: a wave too


def test_before_the_costs_are_learned_a_prompt_token_is_priced_as_a_decoding_row():
    """A replica's first mixed steps, before the fit: beside 15 decoding rows, the token budget (prefill_chunk
    plus one per decoding row, 39 tokens) makes a step of SmolLM2 on 2 cores about 2.4 times a decode-only step. Once
    decode-only steps of batches SLOPE_SPAN rows apart or more were measured, a prompt token is priced as one
    more decoding row at their slope, and a step takes those whose price keeps it within the ratio; decode-only
    steps of one batch size, or of sizes measured no dearer for more rows (noise), leave the token budget."""
    from types import SimpleNamespace

    from workflows.tasks.chat.engine.costs import SLOPE_SPAN
    from workflows.tasks.chat.engine.scheduler import Row, Scheduler

    def row(slot: int, done: int, prompt: int = 55) -> Row:
        gen = SimpleNamespace(prompt=list(range(prompt)), adapter=None)
        return Row(gen, slot, sampling=None, text=None, limit=64, done=done, pos=done, last=5)  # type: ignore[arg-type]

    def granted(made: Scheduler) -> list[int]:
        step = made.plan([row(slot, 55) for slot in range(15)] + [row(15, 0)], "base")
        assert len(step.decode) == 15
        return [n for _, _, n in step.prefills]

    def scheduler(*decode_steps: tuple[int, float]) -> Scheduler:
        made = Scheduler(max_batch=32, max_queue=0, prefill_chunk=24, max_prefill_tokens=2048, mixed_step_ratio=1.5)
        assert made.costs is not None
        for rows, seconds in decode_steps:
            made.costs.observe(StepShape(rows, 0, 0, 0), seconds)
        assert not made.costs.ready
        return made

    assert granted(scheduler()) == [24 + 15]  # nothing measured: the token budget
    assert granted(scheduler((16, 0.046))) == [39]  # one batch size: no slope
    assert granted(scheduler((16, 0.046), (16 - SLOPE_SPAN + 1, 0.040))) == [39]  # too close to tell a row's cost
    # 4 and 16 rows: a row costs (0.046 - 0.030) / 12 s; 15 rows' step is 0.0447 s; half of it buys 16 rows' worth
    per_row, step = (0.046 - 0.030) / 12, 0.030 + (0.046 - 0.030) * 11 / 12
    assert granted(scheduler((16, 0.046), (4, 0.030))) == [int(0.5 * step / per_row)] == [16]
    assert granted(scheduler((16, 0.046), (4, 0.050))) == [39]  # more rows no dearer: noise, the token budget
    # a slope that prices a token below the token budget's leaves the token budget: the budget only shrinks
    assert granted(scheduler((16, 0.046), (2, 0.045))) == [39]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny Llama wider than the other tests' (its steps cost compute, not only Python), with room for
    a 1,500-token prompt."""
    return build_tiny_chat(tmp_path_factory.mktemp("tinychat-wide"), hidden=256, context=2048)


class Steps(EngineMetrics):
    """Each step's prompt and decode tokens, as the engine reports them."""

    def __init__(self):
        self.shapes: list[tuple[int, int]] = []

    def step(self, report):
        self.shapes.append((report.prefill_tokens, report.decode_tokens))

    def rejected(self, reason, adapter=None):
        pass


def learned_engine(wide, metrics=None) -> tuple[Engine, list[int]]:
    """An engine whose token budget (prefill_chunk 256) was sized for a faster device, after its first
    mixed steps (on that budget: prompts of many lengths joining 4 streams) taught it their costs."""
    model, tokenizer = wide
    torch.set_num_threads(1)
    engine = Engine(model, tokenizer, max_batch=9, prefill_chunk=256, max_prefill_tokens=2048, metrics=metrics)
    engine.eos = set()
    vocab = [t for t in range(3, len(tokenizer)) if t != tokenizer.eos_token_id]
    prompt = [vocab[(7 * i) % len(vocab)] for i in range(1500)]
    never_ends = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    streams = [engine.submit(prompt[i:i + 8], never_ends, deadline=False) for i in range(4)]
    wait_until(lambda: all(len(r.tokens) >= 3 for r in streams), 60, "four rows decoding", every=0.02)
    for n in (40, 700, 120, 300, 1200, 600, 80, 200, 450, 20, 900, 60):
        engine.submit(prompt[:n], SamplingParams(max_tokens=2, temperature=0), deadline=False).result(120)
    for r in streams:
        r.cancel()
    wait_until(lambda: not engine._rows, 30, "the streams to leave", every=0.02)
    return engine, prompt


def join(engine: Engine, prompt: list[int], shift: int = 0) -> tuple[list[float], list[float]]:
    """8 rows decoding, then the 1,500-token prompt joins them: (the rows' token gaps while it was
    prefilled, their other gaps)."""
    rows = [engine.submit(prompt[shift + i:shift + i + 8], SamplingParams(max_tokens=300, temperature=0,
                                                                          ignore_eos=True), deadline=False)
            for i in range(8)]
    wait_until(lambda: all(len(r.tokens) >= 10 for r in rows), 60, "eight rows decoding", every=0.02)
    long = engine.submit(prompt[shift:] + prompt[:shift], SamplingParams(max_tokens=4, temperature=0), deadline=False)
    long.result(120)
    for r in rows:
        r.result(120)
    return gaps_while_prefilled(rows, long)


def test_a_long_prompt_joining_decoding_rows_is_prefilled_in_the_chunks_its_learned_costs_allow(wide):
    """The costs are learned from the replica's own steps; then a 1,500-token prompt joining 8 decoding
    rows is prefilled in chunks the time budget grants (never the token budget's 256 at once), every
    row getting a token at every step meanwhile, and the budget does not starve it."""
    steps = Steps()
    engine, prompt = learned_engine(wide, steps)
    try:
        costs = engine.scheduler.costs
        assert costs is not None and costs.ready
        first = len(steps.shapes)
        during, usual = join(engine, prompt)
        beside = [p for p, d in steps.shapes[first:] if p and d == 8]
        assert sum(beside) >= 1500 - 256 and len(beside) >= 8, beside  # chunks beside the rows, not one step
        assert max(beside) < 256, beside
        assert len(during) >= 8 * len(beside) - 8  # the rows got a token at every step of it
    finally:
        engine.close()


@pytest.mark.extended
def test_a_long_prompt_joining_decoding_rows_keeps_their_token_gaps_near_the_ratio(wide):
    """The timing (outside the gate: a timed check, on a loaded machine it is noise): while the long
    prompt is prefilled beside 8 decoding rows, their token gaps stay near mixed_step_ratio (the default) times
    their gaps before and after it. Judged on the median and the 90th percentile, the better of two
    joins: on this 2-core VM the decode-only steps of this model alone reach 1.8-4.5x their median at
    their slowest (measured), so no scheduler bounds the single slowest gap; the token budget of 256 alone
    gave 4.9x at the median."""
    engine, prompt = learned_engine(wide)
    try:
        ratios = []
        for shift in (0, 500):
            during, usual = join(engine, prompt, shift)
            typical = statistics.median(usual)
            ratios.append((statistics.median(during) / typical, statistics.quantiles(during, n=10)[-1] / typical))
        assert any(p50 <= 1.9 and p90 <= 3 for p50, p90 in ratios), ratios
    finally:
        engine.close()


def test_the_engine_defaults_are_the_configs():
    """An engine built without the config (tests, benches, a user's own code) budgets its prefill as a
    replica does by default: the engine's constants are serve.generate's defaults."""
    from workflows.config.serve import GenerateConfig
    from workflows.tasks.chat.engine.scheduler import DEFAULTS

    config = GenerateConfig()
    for name in ("prefill_chunk", "max_prefill_tokens", "mixed_step_ratio", "prefill_wave", "join_wait_s"):
        assert getattr(config, name) == getattr(DEFAULTS, name), name

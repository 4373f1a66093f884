"""Which requests run, and which of their tokens go into each step.

Admission: a request waits in a bounded queue (`room`: `max_queue` beyond the batch's free slots;
beyond it `submit` raises QueueFull at once) and joins the batch at the next step that has a free slot
(a slot of the cache: workflows.tasks.chat.engine.cache). A request past its deadline, waiting or
running, ends with "timeout"; a cancelled one with "cancelled".

A step's tokens: one per decoding row (its last sampled token), and prompt tokens of the rows still
prefilling, in order of arrival, up to a budget. While rows decode, the budget is in time: the prompt
tokens whose predicted cost keeps the step within `mixed_step_ratio` times a decode-only step of the same
rows, however many rows are joining (but for a wave: below), at least one token each step (a later row
joins a step only where what is left covers two of its tokens, or its last); the costs are
learned from the steps that ran (workflows.tasks.chat.engine.costs: a long prompt's attention over its own
context, and its logits, counted), so the bound holds however fast steps become. Until they are known (a
replica's first steps), or always with `mixed_step_ratio` None, the budget is in tokens: one per decoding
row plus `prefill_chunk`, and `prefill_chunk` more for each prefilling row beyond the decoding ones. With no
row decoding, the budget is `max_prefill_tokens` (at most that, always). A running stream's token gap so
stays within about `mixed_step_ratio` of its decode steps while others join, and a long prompt is
prefilled in chunks between decode steps. Requests that join together are prefilled together, and every
token of a step goes through the model in one forward.

Gathering: a step that would start an empty batch (no row decoding) waits for more requests while they are
coming: for the next requests of the clients whose requests the step that emptied it ended (closed-loop clients
send their next request as the last one ends, a few milliseconds apart), up to `join_wait_s` after it, and for
requests still being planned, up to `join_wait_s` after the oldest waiting request arrived. They then join in one
step: a request that started alone would get its first tokens while the others waited, and those joining after
it, beside its decoding, would be prefilled on the time budget over many steps, the batch part-empty and its
requests ending as staggered as they joined. A lone client's next request, or a request reaching an idle
engine with none being planned, never waits.

A wave: where the rows still prefilling are at least `prefill_wave` times the decoding ones, the step takes
up to `max_prefill_tokens` of their prompts, the decoding rows' gap growing by that one step. Held to the
time budget, a wave of prompts beside a few streams would join a few tokens a step over many steps: the
batch runs part-empty meanwhile, and its requests then end (and closed-loop clients' next ones arrive) as
staggered as they joined, so it stays part-empty.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from workflows.tasks.chat.engine.costs import StepCosts, StepShape
from workflows.tasks.chat.engine.requests import Generation
from workflows.tasks.chat.engine.sampler import RowSampling
from workflows.tasks.chat.engine.text import TextState


@dataclass
class Row:
    """A request in the batch: its slot, how much of its prompt is in the cache (`done`), its position
    count in the cache (`pos`) and its last sampled token, not yet in the cache (`last`, -1 before the
    first)."""

    gen: Generation
    slot: int
    sampling: RowSampling
    text: TextState
    limit: int  # max new tokens: the request's, within the model's context
    done: int = 0
    pos: int = 0
    last: int = -1

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.gen.prompt)


@dataclass
class StepTokens:
    """A step's tokens in the order they enter the model: prefill chunks first (`prefills`: row, first
    index, count), then decode tokens (`decode`: their indices); `keep` marks the tokens whose logits
    are needed (a decode token, a prompt's last token), `sampled` their rows in that order."""

    ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    keep: list[bool] = field(default_factory=list)
    prefills: list[tuple[Row, int, int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    decoding: list[Row] = field(default_factory=list)
    sampled: list[Row] = field(default_factory=list)

    def add(self, row: Row, ids: list[int], start: int, adapter: str, keep_last: bool) -> None:
        n = len(ids)
        self.ids += ids
        self.slots += [row.slot] * n
        self.positions += range(start, start + n)
        self.adapters += [adapter] * n
        self.keep += [False] * (n - 1) + [keep_last]
        if keep_last:
            self.sampled.append(row)

    def adapted(self, base: str) -> bool:
        """Some token of the step has a LoRA adapter (`base`: peft's name for none): the step computes deltas."""
        return any(a != base for a in self.adapters)


@dataclass(frozen=True)
class Defaults:  # serve.generate's defaults (workflows.config.serve), for an engine built without the config
    prefill_chunk: int = 24
    max_prefill_tokens: int = 2048
    mixed_step_ratio: float = 1.5
    prefill_wave: float = 2.0
    join_wait_s: float = 0.1


DEFAULTS = Defaults()


class Scheduler:
    def __init__(self, max_batch: int, max_queue: int, prefill_chunk: int, max_prefill_tokens: int,
                 mixed_step_ratio: float | None = DEFAULTS.mixed_step_ratio,
                 prefill_wave: float | None = DEFAULTS.prefill_wave, join_wait_s: float = DEFAULTS.join_wait_s):
        if prefill_chunk < 1 or max_prefill_tokens < prefill_chunk:
            raise ValueError(f"prefill_chunk ({prefill_chunk}) must be at least 1 and at most max_prefill_tokens "
                             f"({max_prefill_tokens})")
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefill_chunk, self.max_prefill_tokens = prefill_chunk, max_prefill_tokens
        self.waiting: deque[Generation] = deque()
        self.costs = StepCosts(mixed_step_ratio) if mixed_step_ratio else None  # None: the token budget always
        self.planning = 0  # requests admitted but still being planned (template, tokens, grammar): they wait too
        self.wave = prefill_wave  # prefilling rows per decoding one from which a step takes a wave; None: never
        self.join_wait_s = join_wait_s
        self.expected, self.emptied = 0, 0.0  # requests an emptied batch's step waits for, and when it emptied

    def room(self, running: int) -> bool:
        """Whether one more request may wait: a request the batch can take at its next step does not
        count against max_queue; one still being planned does."""
        return len(self.waiting) + self.planning < self.max_queue + max(0, self.max_batch - running)

    def observe(self, step: StepTokens, seconds: float, base: str) -> None:
        """What a step of these tokens cost (`seconds`): the next steps' prefill budget (`costs`)."""
        if self.costs is not None:
            n = sum(k for _, _, k in step.prefills)  # prompt tokens lead the step: theirs are its first positions
            ends = sum(step.keep[first + k - 1] for _, first, k in step.prefills)
            self.costs.observe(StepShape(len(step.decoding), n, sum(step.positions[:n]) + n, ends, step.adapted(base)),
                               seconds)

    def stepped(self, ended: int, running: int, started: float, now: float) -> None:
        """After a step (from `started` to `now`) that ended `ended` requests, `running` left in the batch: an
        emptied batch expects the next requests of the clients of those that ended, beside those that were
        waiting before the step (one submitted during it may be such a next request: its client heard the end
        as the step sent it)."""
        if ended and not running:
            before = sum(g.times["submitted"] < started for g in self.waiting)
            self.expected, self.emptied = ended + before, now
        else:
            self.expected = 0

    def idle_s(self, running: int, free_slots: int, now: float) -> float:
        """Seconds the decode thread should wait before its next step (0: step now): for ever with nothing to
        do; with requests waiting and no row in the batch, while fewer wait than expected (at most the free
        slots) or some are still being planned, up to join_wait_s (Gathering, above)."""
        if not (running or self.waiting):
            return math.inf
        if running or not self.join_wait_s:
            return 0.0
        # the clients whose requests ended are waited for join_wait_s after the batch emptied, those being planned
        # join_wait_s after the oldest waiting request arrived
        clients = len(self.waiting) < min(self.expected, free_slots) and now < self.emptied + self.join_wait_s
        if not (clients or self.planning):
            return 0.0
        until = max(self.emptied if clients else 0.0, self.waiting[0].times["submitted"] if self.planning else 0.0)
        return max(0.0, until + self.join_wait_s - now)

    def take(self, free_slots: int, now: float) -> tuple[list[Generation], list[Generation], list[Generation]]:
        """(cancelled, expired, joining) among the waiting: the cancelled and those past their deadline
        leave the queue; up to `free_slots` of the rest join, oldest first."""
        cancelled = [g for g in self.waiting if g.cancelled]
        expired = [g for g in self.waiting if not g.cancelled and g.deadline is not None and g.deadline <= now]
        for g in cancelled + expired:
            self.waiting.remove(g)
        joining = [self.waiting.popleft() for _ in range(min(len(self.waiting), free_slots))]
        return cancelled, expired, joining

    def plan(self, rows: list[Row], base: str) -> StepTokens:
        """The tokens of the next step of `rows` (in the order they joined); `base`: peft's name for no adapter."""
        step = StepTokens()
        step.decoding = decoding = [r for r in rows if not r.prefilling]
        budget = self.max_prefill_tokens
        wave = self.wave is not None and len(rows) - len(decoding) >= self.wave * len(decoding)
        held = bool(decoding) and not wave  # beside decoding rows, no wave joining: a budget below max_prefill_tokens
        costs = self.costs if held and self.costs is not None and self.costs.ready else None
        # the step's kind: adapted where a row that may take part has an adapter (its graph computes the deltas)
        seconds = costs.allowance(len(decoding), any(r.gen.adapter not in (None, base) for r in rows)) \
            if costs is not None else 0.0
        if held and costs is None:
            excess = len(rows) - 2 * len(decoding)  # prefilling rows beyond the decoding ones
            budget = min(budget, len(decoding) + self.prefill_chunk * max(1, excess))
            # a fit not yet ready: the time budget still, each prompt token priced as a decoding row (a step with
            # no row prefilling has nothing to price)
            prefilling = len(rows) > len(decoding)
            priced = self.costs.unlearned_tokens(len(decoding)) if self.costs is not None and prefilling else None
            budget = min(budget, priced or budget)
        for row in rows:
            if budget <= 0 or costs is not None and seconds <= 0 and step.prefills:
                break
            if not row.prefilling:
                continue
            prompt = row.gen.prompt
            n = min(budget, len(prompt) - row.done)
            if costs is not None:
                n, cost = costs.prompt_tokens(seconds, row.done, n)
                # a later row joins the step only where the rest of the allowance covers two of its tokens (or
                # its last): for a single token it would add its own attention call for little progress
                if step.prefills and (cost > seconds or n < min(2, len(prompt) - row.done)):
                    break
                seconds -= cost
            first = len(step.ids)
            step.add(row, prompt[row.done:row.done + n], row.done, row.gen.adapter or base, row.done + n == len(prompt))
            step.prefills.append((row, first, n))
            budget -= n
        for row in decoding:
            step.decode.append(len(step.ids))
            step.add(row, [row.last], row.pos, row.gen.adapter or base, True)
        return step

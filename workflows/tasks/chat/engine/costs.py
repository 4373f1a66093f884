"""What prompt tokens cost beside decoding rows, learned from the steps that ran: the scheduler's prefill
budget in time.

Two measurements, both of this replica's own steps: a decode-only step's seconds, the median of the
recent ones per number of decoding rows and per kind of step, with LoRA adapters' rows or without
(`decode_seconds`: an adapted step computes every adapter's deltas, so the same rows take longer, and a
mixed step measured against the other kind's decode step would price its prompt tokens wrongly: far too
dear for adapted rows, whose budget then shrinks and their prompts crawl); and what prompt tokens add to
a step of decoding rows, the extra of each such mixed step over the decode-only step of its rows (and
kind; `decode_step`: between the row counts measured, the line between them), priced again at each fit
over the decode-only steps measured by then (the first mixed steps of more rows than any decode-only step
so far, as a replica's load grows, would otherwise leave a fixed cost too dear in the window, and its
prompts would crawl for WINDOW steps), fitted by least squares (kept non-negative, and refitted once
without the steps it misses by far: a collection or a preempted core is not a cost of prompt tokens) over
the last WINDOW mixed steps as s + p·prompt + q·attended + r·ended: `s` what any prefill adds to a step
(the prompt rows' attention calls and masks: measured a third of a decode step on a tiny model, little on
a real one), `prompt` the prompt tokens, `attended` the positions they attend over (each its context so
far: a long prompt's later chunks cost more), `ended` the prompts the step finishes (their logits).
Fitting mixed steps alone measures what the budget spends, as it is spent (a lone prefill step costs less
than the same tokens beside decoding rows).

The budget of a step beside decoding rows (`allowance`, `prompt_tokens`): the prompt tokens whose
predicted extra, at the position where each prefilling row's prompt continues, is within `ratio - 1`
times those rows' decode-only step of the step's kind (`decode_step`; the other kind's where this kind
has not run at all), however many rows are joining (a wave of them beside a few streams is prefilled over
more steps, the streams' gaps bounded as ever), and at least one token (a step's first prompt row always
advances; the scheduler gives a later row two tokens or none), and at most TRUST times the most prompt
tokens a measured mixed step had (the fit is trusted near what it saw; the room grows as larger steps are
measured). Until READY mixed steps have been seen (a replica's first), the scheduler's token budget
applies, and its steps are the first measurements.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

WINDOW, REFIT, READY = 128, 4, 6
RECENT = 15  # decode-only steps per row count, and mixed steps' misses, whose median is taken
MISS = (0.5, 2.0)  # the bounds of the correction the recent mixed steps apply to the fit
OUTLIER = 4.0  # a step whose residual exceeds this many times the median residual is left out of the refit
# a prompt row takes at most this many times the most prompt tokens a measured mixed step had: the fit is
# trusted near what it saw (the token budget's first steps all alike, what any prefill costs and what a
# token costs are not told apart), and the room grows as larger steps are measured
TRUST = 2
FLOOR = 0.5  # the share of a step's room beside decoding rows kept for prompt tokens, whatever the fixed part
SLOPE_SPAN = 4  # decode-only steps this many rows apart price a row before the fit (`unlearned_tokens`)


@dataclass(frozen=True)
class StepShape:
    decoding: int  # decoding rows
    prompt: int  # prompt tokens prefilled
    attended: int  # positions the prompt tokens attend over, summed
    ended: int  # prompts the step finishes (their logits computed)
    adapted: bool = False  # some token of the step has a LoRA adapter (the step computes adapters' deltas)

    def features(self) -> list[float]:
        return [1.0, float(self.prompt), float(self.attended), float(self.ended)]


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0, by dropping the most negative term and refitting
    (four terms at most: no solver needed)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(0)
    while active:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all():
            break
        del active[int(np.argmin(coef))]
    out = np.zeros(x.shape[1])
    out[active] = coef
    return out


class StepCosts:
    """The measured decode-only step, the fitted cost of prompt tokens beside it, and the prompt tokens a
    prefilling row may take (`prompt_tokens`)."""

    def __init__(self, ratio: float):
        self.ratio = ratio
        # (decoding rows, adapted) -> their recent decode-only steps' seconds, and the median of those
        self._decode: dict[tuple[int, bool], deque[float]] = {}
        self.decode_seconds: dict[tuple[int, bool], float] = {}
        # the recent mixed steps: their features, seconds, decoding rows and kind; each fit prices them over the
        # decode-only steps measured by then (a step of rows not yet measured alone is priced again once they are)
        self._mixed: deque[tuple[list[float], float, int, bool]] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self.widest = 0  # the most prompt tokens of a mixed step in the window, at the last fit
        # s, p, q, r: seconds any prefill, a prompt token, an attended position, a prompt's ending
        self.coef: np.ndarray | None = None
        self._misses: deque[float] = deque(maxlen=RECENT)  # recent mixed steps' extra over the fit's prediction
        self.bias = 1.0  # the median of those, bounded: what the fit misses as the steps come

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not shape.decoding:
            return  # a prefill-only step: nothing decoding waits on it
        if not shape.prompt:  # medians, not means: a collection or a preempted core is not the step's cost
            key = (shape.decoding, shape.adapted)
            recent = self._decode.setdefault(key, deque(maxlen=RECENT))
            recent.append(seconds)
            self.decode_seconds[key] = float(np.median(recent))
            return
        base = self.decode_step(shape.decoding, shape.adapted)
        if base is None:
            return
        extra = seconds - base
        if self.coef is not None:  # what the fit misses as the steps come (a context longer than it saw)
            predicted = float(np.dot(self.coef, shape.features()))
            if predicted > 0:
                self._misses.append(extra / predicted)
                self.bias = min(max(float(np.median(self._misses)), MISS[0]), MISS[1])
        self._mixed.append((shape.features(), seconds, shape.decoding, shape.adapted))
        self._since_fit += 1
        if self._since_fit >= REFIT and len(self._mixed) >= READY:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        x = np.array([f for f, *_ in self._mixed])
        self.widest = int(x[:, 1].max())
        decode = {k: self.decode_step(*k) or 0.0 for k in {(rows, adapted) for _, _, rows, adapted in self._mixed}}
        y = np.array([s - decode[rows, adapted] for _, s, rows, adapted in self._mixed])
        coef = _nonnegative_fit(x, y)
        residual = np.abs(x @ coef - y)
        kept = residual <= OUTLIER * max(float(np.median(residual)), 1e-6)
        if kept.sum() >= READY and not kept.all():
            coef = _nonnegative_fit(x[kept], y[kept])
        # prompt tokens must cost something to budget them: a fit that finds them free (the window's steps drowned
        # in a loaded machine's noise) keeps the last fit that did not, so a budget learned is not lost to noise
        if coef[1] > 0 or coef[2] > 0:
            self.coef = coef

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def decode_step(self, rows: int, adapted: bool = False) -> float | None:
        """The decode-only step of `rows` rows of this kind (`adapted`; the other kind's where this one has
        not run), None before any: as measured, or between two measured row counts the line between them;
        below the fewest measured, theirs (a smaller step reads the same weights); beyond the most, theirs
        and what a prompt token costs for each row more (as fitted: a decoding row is one more token through
        the same matmuls), so a step of more rows than any that ran alone is not priced as a smaller one."""
        measured = sorted((k[0], v) for k, v in self.decode_seconds.items() if k[1] == adapted) or \
            sorted((k[0], v) for k, v in self.decode_seconds.items())
        if not measured:
            return None
        below = [m for m in measured if m[0] <= rows]
        above = [m for m in measured if m[0] >= rows]
        if not below:
            return above[0][1]
        r0, s0 = below[-1]
        if not above:
            return s0 + (rows - r0) * (self.coef[1] if self.coef is not None else 0.0)
        r1, s1 = above[0]
        return s0 if r1 == r0 else s0 + (s1 - s0) * (rows - r0) / (r1 - r0)

    def unlearned_tokens(self, decode_rows: int) -> int | None:
        """Before the fit (`ready`): the prompt tokens a step beside `decode_rows` decoding rows may take,
        each priced as one more decoding row, at the slope of the decode-only steps measured so far (a
        decoding row is one more token through the same matmuls), between the fewest and the most rows of
        at least two (a lone row's step may run a graph of its own), SLOPE_SPAN rows apart at least; None
        where none such were measured yet (the scheduler's token budget then)."""
        measured = sorted((k[0], v) for k, v in self.decode_seconds.items() if k[0] >= 2 and not k[1])
        if len(measured) < 2 or measured[-1][0] - measured[0][0] < SLOPE_SPAN:
            return None
        (r0, s0), (r1, s1) = measured[0], measured[-1]
        per_row = (s1 - s0) / (r1 - r0)
        step = self.decode_step(decode_rows)
        if per_row <= 0 or step is None:  # noise: the steps of more rows measured no dearer
            return None
        return max(1, int((self.ratio - 1) * step / per_row))

    def allowance(self, decode_rows: int, adapted: bool = False) -> float:
        """Seconds a step of `decode_rows` decoding rows (`adapted`: with LoRA adapters' rows) may spend
        on prompt tokens, beyond what any prefill adds to it: at least half the step's room (FLOOR). Steps
        that each took a token or a few cannot tell what any prefill adds from what a token costs (the two
        grow together), and a fit that charged the whole room to the first would grant a token a step: the
        prompts crawl, decoding rows drain while they wait, and the steps stay too small to learn otherwise
        (measured: a closed loop of 16 fell to 4 decoding rows and 12 prompts a token at a time)."""
        assert self.coef is not None
        spare = (self.ratio - 1) * (self.decode_step(decode_rows, adapted) or 0.0) / self.bias
        return spare - min(self.coef[0], (1 - FLOOR) * spare)

    def cost(self, tokens: int, position: int, ends: bool) -> float:
        """Predicted seconds `tokens` prompt tokens add to a step beyond its fixed prefill cost,
        continuing at `position` (their logits counted when they end the prompt)."""
        assert self.coef is not None
        _, p, q, r = self.coef
        return p * tokens + q * (tokens * position + tokens * (tokens + 1) / 2) + (r if ends else 0.0)

    def prompt_tokens(self, allowance: float, position: int, remaining: int) -> tuple[int, float]:
        """(tokens, their predicted seconds) of a prompt continuing at `position` with `remaining` tokens
        left, within `allowance` seconds: the largest k whose cost is within it, at least 1."""
        assert self.coef is not None
        _, p, q, _ = self.coef
        # the root of q/2·k² + (p + q·(position + 1/2))·k = allowance, then one down if the logits tip it over
        a, b = q / 2, p + q * (position + 0.5)
        room = max(allowance, 0.0)
        k = room / b if a == 0 else (-b + (b * b + 4 * a * room) ** 0.5) / (2 * a)
        k = max(1, min(remaining, int(k), TRUST * self.widest))
        if k > 1 and self.cost(k, position, k == remaining) > allowance:
            k -= 1
        return k, self.cost(k, position, k == remaining)

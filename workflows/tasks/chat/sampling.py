"""What one generated sequence needs besides the model: its sampling settings, the choice of its next
token (greedy, or temperature and top-p with its own seeded generator), and its text as tokens come
(incremental detokenization, stop strings, the text held back while it may still become a stop string).

Pure torch and a tokenizer: the engine (workflows.tasks.chat.engine) calls these from its decode thread.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

MAX_LOGPROBS = 20  # top alternatives a request may ask for with each token (OpenAI's top_logprobs limit)


class TokenConstraint(Protocol):
    """A request's own grammar state (workflows.tasks.chat.grammar): which tokens may come next."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the disallowed tokens of this request's logits row [vocab] to -inf, in place."""

    def accept(self, token: int) -> None:
        """Advance past the chosen token."""

    def done(self) -> bool:
        """Complete: nothing more may follow (the request ends with finish reason "stop")."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings (OpenAI's meaning): `temperature` 0 (or below MIN_TEMPERATURE)
    is greedy; `top_p` keeps the smallest set of most probable tokens whose probabilities reach it;
    `seed` makes sampling repeatable (the same seed, prompt and settings give the same tokens, alone or
    beside other requests); `stop`: strings that end the text (not included in it); `logprobs`: None, or
    0..MAX_LOGPROBS (each chosen token's logprob and that many most likely alternatives); the penalties
    and `logit_bias` as OpenAI defines them (over the generated tokens); `constraint`: this request's
    grammar state, if any. A row's logits go through logit_bias, the penalties, the constraint's mask,
    then temperature and top-p."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    constraint: TokenConstraint | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {self.max_tokens}")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be between 0 and 2, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be above 0 and at most 1, not {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("a stop string must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, not {self.logprobs}")

    @property
    def processed(self) -> bool:
        """Whether a row's logits need more than temperature and top-p (they are then handled alone)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.constraint is not None or self.logprobs is not None)


def generator(seed: int | None) -> torch.Generator:
    """A CPU generator of its own per request: its draws do not depend on what else is in the batch."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else random.SystemRandom().randrange(2**63))
    return g


MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy: dividing by less overflows the logits


def next_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The next token from one row of logits [vocab]. Numerically safe for any valid temperature: the
    logits less their maximum, in float64, so no division overflows and softmax has no NaN; a
    temperature below MIN_TEMPERATURE is greedy (what such a temperature means in the limit)."""
    if params.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    scaled = (logits.double() - logits.max().double()) / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the more probable tokens
        sorted_probs[before >= params.top_p] = 0  # the most probable token always stays
        return int(order[torch.multinomial(sorted_probs, 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def process(logits: torch.Tensor, params: SamplingParams, generated: list[int]) -> torch.Tensor:
    """One row's logits [vocab] in float32, a copy: logit_bias added, the presence and frequency penalties
    subtracted for the tokens generated so far (OpenAI's formula: count * frequency + (count > 0) *
    presence), then the constraint's mask."""
    out = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=out.device)
        out[ids] += torch.tensor(list(params.logit_bias.values()), device=out.device)
    if (params.presence_penalty or params.frequency_penalty) and generated:
        counts = Counter(generated)
        ids = torch.tensor(list(counts), device=out.device)
        n = torch.tensor(list(counts.values()), dtype=out.dtype, device=out.device)
        out[ids] -= n * params.frequency_penalty + params.presence_penalty
    if params.constraint is not None:
        params.constraint.mask(out)
    return out


def token_logprobs(logits: torch.Tensor, params: SamplingParams, token: int) -> tuple[int, float, list]:
    """(token, its logprob, [(id, logprob)] of the `params.logprobs` most likely) under the distribution
    the token was drawn from: the processed logits at the request's temperature (1 when greedy), before
    top-p."""
    t = params.temperature if params.temperature >= MIN_TEMPERATURE else 1.0
    lp = torch.log_softmax(logits.double() / t, dim=-1)
    top: list = []
    if params.logprobs:
        values, ids = torch.topk(lp, min(params.logprobs, lp.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist()))
    return token, float(lp[token]), top


@dataclass
class TextState:
    """A sequence's generated text, built token by token. Detokenizing the new tokens alone can split a
    character made of several tokens (a byte-level BPE's UTF-8 pieces), so each step decodes a short
    window (from `prefix` to the end) and keeps its new characters once they no longer end in U+FFFD.
    `emitted` counts the characters handed out: text that may still be the start of a stop string waits."""

    stop: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    prefix: int = 0  # window start (tokens)
    read: int = 0  # tokens whose text is in `text`
    stopped: bool = False

    def add(self, token: int, tokenizer) -> None:
        """Append a token; finds a stop string in the text (then `stopped`, and the text ends before it)."""
        self.ids.append(token)
        before = tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        window = tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return  # a character still incomplete (or a special token): wait for the next token
        start = len(self.text)
        self.text += window[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        cut = min((i for s in self.stop if (i := self.text.find(s, max(0, start - len(s) + 1))) >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True

    def delta(self, final: bool) -> str:
        """The text not yet handed out, less (unless `final`) the end that may begin a stop string."""
        end = len(self.text) if final or self.stopped else len(self.text) - self.held_back()
        out, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return out

    def held_back(self) -> int:
        """Characters at the end of the text that are a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

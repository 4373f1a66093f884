"""What a request asks of the engine besides its prompt: its sampling settings (`SamplingParams`, with the
per-request hook of structured output, `TokenConstraint`) and its own seeded generator.

The engine applies the settings of every row of a step together, on the model's device (`sampler`);
this module is plain Python.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy: dividing by less overflows the logits
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs


@runtime_checkable
class TokenConstraint(Protocol):
    """A request's constraint on its tokens (a grammar, a tool call's JSON schema), one object per request,
    stateful. The engine calls, for that request's row only, at each step: `mask(logits)` on the row's
    logits [vocab] (on the model's device, after logit_bias and the penalties) to set the tokens it does
    not allow to -inf in place; then, with the token chosen, `accept(token)`; then `done()`, and ends the
    request with finish reason "stop" once it is True. An exception from any of them fails that request
    alone (the others in the batch go on)."""

    def mask(self, logits: torch.Tensor) -> None: ...

    def accept(self, token: int) -> None: ...

    def done(self) -> bool: ...


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings (OpenAI's meaning): `temperature` 0 (or below MIN_TEMPERATURE)
    is greedy; `top_p` keeps the smallest set of most probable tokens whose probabilities reach it;
    `seed` makes sampling repeatable (the same seed, prompt and settings give the same tokens, alone or
    beside other requests); `stop`: strings that end the text (not included in it); `ignore_eos`: the
    end-of-sequence token does not end it (it runs to max_tokens or a stop string: fixed lengths, for
    benchmarks, as vLLM's and llama.cpp's servers take the same field).

    `logprobs`: None for none; 0..20 for the chosen token's log probability and that many most probable
    alternatives, from the distribution the token was drawn from. `presence_penalty`,
    `frequency_penalty` (-2..2): subtracted from a token's logit once if it was generated before, and
    per time it was (the generated tokens only, not the prompt). `logit_bias`: token id -> -100..100,
    added to that token's logit. `constraint`: a TokenConstraint, or None. Order per row: logit_bias,
    penalties, the constraint's mask, then temperature, top_p and the draw."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    constraint: TokenConstraint | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be between -2 and 2, not {getattr(self, name)}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias: a token id is an integer of at least 0, not {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: a bias is between -100 and 100, not {bias} (token {token})")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


def generator(seed: int | None):
    """A CPU generator of its own per request: its draws do not depend on what else is in the batch."""
    import torch

    g = torch.Generator()
    g.manual_seed(seed if seed is not None else random.SystemRandom().randrange(2**63))
    return g

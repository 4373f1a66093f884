"""What a caller of the engine holds: a `Generation` per request (its deltas, its timings, its usage),
the `Delta`s it yields, and the errors `Engine.submit` raises before a request is queued."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from workflows.tasks.chat.engine.loop import Engine
    from workflows.tasks.chat.engine.params import SamplingParams

# Why a generation ended (Delta.finish_reason, Generation.finish_reason):
#   "stop"      the model's end of sequence, a stop string, or its TokenConstraint done
#   "length"    max_tokens, or the model's context
#   "timeout"   the request's deadline (serve.generate.timeout_s) passed, waiting or generating
#   "cancelled" the caller cancelled it (a client that left)
#   "error"     the engine failed it (the exception is raised to the caller instead of a last Delta)
FINISH_REASONS = ("stop", "length", "timeout", "cancelled", "error")


class QueueFull(Exception):
    """The engine's waiting queue is full: answer 429 with Retry-After."""

    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"the server is busy: {waiting} requests are waiting; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class PromptTooLong(ValueError):
    """A prompt over serve.generate.max_prompt_tokens, or leaving no room in the model's context (HTTP 400,
    OpenAI's code context_length_exceeded); raised before any compute."""


class EngineStopped(RuntimeError):
    """The engine's decode thread has stopped (closed, or died): no request is taken (HTTP 503)."""


class ModelNotFound(LookupError):
    """A request's "model" is neither the served one nor an adapter of it (HTTP 404)."""


class TokenLogprob(NamedTuple):
    """A generated token's log probability and the `top` most probable alternatives [(token, logprob)],
    most probable first (tokens of probability 0, outside top_p's nucleus or masked, are left out)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """One step's news for a request: new text (maybe empty: it may be held back while it could begin a
    stop string, or a character may be incomplete), the token ids generated at this step (the end of
    sequence token left out) with their log probabilities when the request asked (`logprobs`), and, on
    its last delta, why it ended (FINISH_REASONS). The text of a token may come in a later delta."""

    text: str
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class Generation:
    """One request: iterate it (async) for its deltas, or wait for all (`result`); `cancel` ends it."""

    def __init__(self, engine: Engine, prompt: list[int], params: SamplingParams, adapter: str | None,
                 deadline_s: float | None = None, arrived: float | None = None):
        self.id = next(engine._ids)
        self.prompt, self.params, self.adapter = prompt, params, adapter
        self.prompt_tokens, self.completion_tokens = len(prompt), 0
        self.tokens: list[int] = []  # generated token ids (EOS included), written by the engine thread
        self.steps: tuple[int, int] = (-1, -1)  # the engine's step count when it joined the batch and when it ended
        # perf_counter() at submit, first token sampled, end: time to first token and tokens/s for benchmarks
        self.times: dict[str, float] = {"submitted": time.perf_counter()}
        self.token_times: list[float] = []  # perf_counter() as each token was sampled: inter-token latency
        # perf_counter() seconds: from the request's arrival (before its planning), else its submission
        self.deadline = (arrived or self.times["submitted"]) + deadline_s if deadline_s else None
        self.finish_reason: str | None = None
        self.cancelled = False
        self._engine = engine
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._aq: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        except RuntimeError:  # a caller without an event loop (batch work, tests)
            self._loop = None
        self._q: queue.SimpleQueue[Delta | BaseException] = queue.SimpleQueue()

    def _push(self, item: Delta | BaseException) -> None:  # from the engine thread
        if self._loop is None:
            self._q.put(item)
        else:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
            except RuntimeError:  # the loop has closed: nobody listens
                pass

    def cancel(self) -> None:
        """Stop generating for this request (and only it) at the next step; safe from any thread."""
        if self.finish_reason is None:
            self.cancelled = True
            self._engine._wake()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        if self._loop is None:
            raise RuntimeError("submitted outside an event loop: use result()")
        while True:
            item = await self._aq.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> tuple[str, str]:
        """(the whole text, finish reason), blocking; for a request submitted without an event loop."""
        parts = []
        while True:
            item = self._q.get(timeout=timeout)
            if isinstance(item, BaseException):
                raise item
            parts.append(item.text)
            if item.finish_reason is not None:
                return "".join(parts), item.finish_reason

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

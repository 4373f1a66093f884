"""What the engine reports as it runs, once per step, to whoever watches (`Engine.metrics`): the serving
replica sends it to Prometheus (workflows.tasks.chat.serving.metrics); the default watches nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from workflows.tasks.chat.engine.requests import Generation


@dataclass
class StepReport:
    """One step: tokens prefilled and decoded, the batch and the queue after it, the cache's tokens in
    use and allocated, its wall time (joining, the forward, sampling, the rows' text), and per request
    the time to its first token, the gaps between its tokens, and the requests that ended (their
    `finish_reason` and `times` are set)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    running: int = 0
    waiting: int = 0
    cache_tokens: int = 0
    cache_capacity_tokens: int = 0
    seconds: float = 0.0
    first_tokens: list[tuple[Generation, float]] = field(default_factory=list)
    token_gaps: list[tuple[Generation, float]] = field(default_factory=list)
    finished: list[Generation] = field(default_factory=list)


class EngineMetrics:
    """The no-op watcher; subclasses override what they record. Called in the decode thread (`step`) and
    in the caller's (`rejected`): keep both cheap."""

    def step(self, report: StepReport) -> None:
        pass

    def rejected(self, reason: str, adapter: str | None = None) -> None:
        """A request refused before it ran: "queue_full", "context_length_exceeded", ..."""

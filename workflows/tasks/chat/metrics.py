"""The engine's metrics on Prometheus, per model, from a serving replica (Ray Serve metrics, exported by
Ray's metrics agent as `ray_workflows_generate_*`; docs/OBSERVABILITY.md, cluster/grafana/generate.json).

`ServeMetrics` watches the replica's engine (workflows.tasks.chat.engine.EngineMetrics): once per step it
observes each request's time to first token and the gaps between its tokens, each ended request's
latency and finish reason, counts the prompt and decode tokens through the model, and sets the batch,
the queue and the cache's tokens; `rejected` counts requests refused before they ran, by reason. The
"model" tag is the request's model: the served NAME:VERSION, or the adapter's.
"""

from __future__ import annotations

from collections.abc import Callable

from workflows.cluster_scoped import per_cluster
from workflows.tasks.chat.engine import EngineMetrics, Generation, StepReport

SECONDS_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]


@per_cluster  # a replica lives in one cluster; an in-process app (tests) may see two
def generate_metrics() -> dict:
    from ray.serve import metrics

    model, reason = ("model",), ("model", "reason")
    return {
        "ttft": metrics.Histogram("workflows_generate_time_to_first_token_s", boundaries=SECONDS_BOUNDARIES,
                                  description="from a request's arrival at the engine to its first token (s)",
                                  tag_keys=model),
        "itl": metrics.Histogram("workflows_generate_inter_token_latency_s", boundaries=SECONDS_BOUNDARIES,
                                 description="between two tokens of a request (s)", tag_keys=model),
        "latency": metrics.Histogram("workflows_generate_request_latency_s", boundaries=SECONDS_BOUNDARIES,
                                     description="from a request's arrival at the engine to its end (s)",
                                     tag_keys=("model", "finish_reason")),
        "running": metrics.Gauge("workflows_generate_running", description="requests in the batch",
                                 tag_keys=model),
        "waiting": metrics.Gauge("workflows_generate_waiting", description="requests waiting for a place",
                                 tag_keys=model),
        "cache_tokens": metrics.Gauge("workflows_generate_cache_tokens",
                                      description="positions of the KV cache in use (all requests' tokens)",
                                      tag_keys=model),
        "cache_capacity": metrics.Gauge("workflows_generate_cache_capacity_tokens",
                                        description="positions of the KV cache allocated (slots x their length)",
                                        tag_keys=model),
        "prefill_tokens": metrics.Counter("workflows_generate_prefill_tokens",
                                          description="prompt tokens through the model", tag_keys=model),
        "decode_tokens": metrics.Counter("workflows_generate_decode_tokens",
                                         description="generated tokens through the model", tag_keys=model),
        "rejected": metrics.Counter("workflows_generate_rejections",
                                    description="requests refused before they ran, by reason", tag_keys=reason),
    }


class ServeMetrics(EngineMetrics):
    """`served`: the replica's NAME:VERSION (the engine-wide figures' tag); `model_of`: a request's adapter
    name (None for the base) -> its model id."""

    def __init__(self, served: str, model_of: Callable[[str | None], str]):
        self.served, self.model_of = served, model_of

    def _model(self, gen: Generation) -> str:
        return self.model_of(gen.adapter)

    def step(self, report: StepReport) -> None:
        m, own = generate_metrics(), {"model": self.served}
        for gen, seconds in report.first_tokens:
            m["ttft"].observe(seconds, tags={"model": self._model(gen)})
        for gen, seconds in report.token_gaps:
            m["itl"].observe(seconds, tags={"model": self._model(gen)})
        for gen in report.finished:
            seconds = gen.times.get("finished", 0.0) - gen.times["submitted"]
            m["latency"].observe(seconds, tags={"model": self._model(gen), "finish_reason": str(gen.finish_reason)})
        if report.prefill_tokens:
            m["prefill_tokens"].inc(report.prefill_tokens, tags=own)
        if report.decode_tokens:
            m["decode_tokens"].inc(report.decode_tokens, tags=own)
        m["running"].set(report.running, tags=own)
        m["waiting"].set(report.waiting, tags=own)
        m["cache_tokens"].set(report.cache_tokens, tags=own)
        m["cache_capacity"].set(report.cache_capacity_tokens, tags=own)

    def rejected(self, reason: str, adapter: str | None = None) -> None:
        generate_metrics()["rejected"].inc(1, tags={"model": self.model_of(adapter), "reason": reason})

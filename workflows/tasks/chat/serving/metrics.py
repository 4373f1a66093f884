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


# key: (kind, name, description, tag keys); exported as ray_<name>, counters with _total, histograms with
# _bucket, _count and _sum (cluster/grafana/generate.json reads them)
METRICS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "ttft": ("histogram", "workflows_generate_time_to_first_token_s",
             "from a request's arrival at the engine to its first token (s)", ("model",)),
    "itl": ("histogram", "workflows_generate_inter_token_latency_s", "between two tokens of a request (s)",
            ("model",)),
    "latency": ("histogram", "workflows_generate_request_latency_s",
                "from a request's arrival at the engine to its end (s), by finish reason", ("model", "finish_reason")),
    "running": ("gauge", "workflows_generate_running", "requests in the batch", ("model",)),
    "waiting": ("gauge", "workflows_generate_waiting", "requests waiting for a place in the batch", ("model",)),
    "cache_tokens": ("gauge", "workflows_generate_cache_tokens",
                     "positions of the KV cache in use (the requests' tokens)", ("model",)),
    "cache_capacity": ("gauge", "workflows_generate_cache_capacity_tokens",
                       "positions of the KV cache allocated (slots x their length)", ("model",)),
    "prefill_tokens": ("counter", "workflows_generate_prefill_tokens", "prompt tokens through the model", ("model",)),
    "decode_tokens": ("counter", "workflows_generate_decode_tokens", "generated tokens through the model",
                      ("model",)),
    "rejected": ("counter", "workflows_generate_rejections", "requests refused before they ran, by reason",
                 ("model", "reason")),
}


@per_cluster  # a replica lives in one cluster; an in-process app (tests) may see two
def generate_metrics() -> dict:
    from ray.serve import metrics

    made: dict = {}
    for key, (kind, name, description, tags) in METRICS.items():
        if kind == "histogram":
            made[key] = metrics.Histogram(name, description=description, boundaries=SECONDS_BOUNDARIES,
                                          tag_keys=tags)
        else:
            made[key] = (metrics.Gauge if kind == "gauge" else metrics.Counter)(name, description=description,
                                                                                tag_keys=tags)
    return made


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

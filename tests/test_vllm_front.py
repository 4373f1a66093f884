"""serve.generate.engine=vllm, what is ours in front of vLLM (vllm_engine.engine.VllmEngine: the deadline, a
caller's cancel, admission, a worker that dies) over the worker's own stream code (worker.VllmWorker's
`_run`, `outputs` and `abort`, in a real Ray actor), with a counting model in vLLM's place: a token every
STEP_S. vLLM is not installed in the gate; tests/test_chat_vllm.py (extended) runs these paths on it over
HTTP, and this file keeps them in the gate, including the deadline that one takes a minute to reach."""

from __future__ import annotations

import asyncio
import sys
import time
from types import SimpleNamespace

import pytest

from workflows.tasks.chat.engine import EngineMetrics, EngineStopped, QueueFull, SamplingParams
from workflows.tasks.chat.vllm_engine.engine import VllmEngine
from workflows.tasks.chat.vllm_engine.worker import VllmWorker

pytestmark = pytest.mark.integration
STEP_S = 0.05
EOS = 0


class CountingLLM:
    """What VllmWorker calls of vLLM's AsyncLLM: `generate` streams one delta per step (token 10 + i,
    text " t<i>"), `abort` is recorded."""

    def __init__(self):
        self.aborted: list[str] = []

    async def generate(self, prompt, sampling, request_id, lora_request=None):
        for i in range(sampling.max_tokens):
            await asyncio.sleep(STEP_S)
            last = i + 1 == sampling.max_tokens
            yield SimpleNamespace(finished=last, outputs=[SimpleNamespace(
                text=f" t{i}", token_ids=[10 + i], logprobs=None, finish_reason="length" if last else None)])

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        pass


class CountingWorker(VllmWorker):
    """VllmWorker over CountingLLM: its own `_run`, `outputs` and `abort`; `submit` without vLLM's
    SamplingParams (the one line of it that imports vLLM)."""

    def __init__(self):  # no super(): it builds vLLM's engine
        self.llm, self.loras = CountingLLM(), {}
        self._news: asyncio.Queue = asyncio.Queue()
        self._tasks: dict[str, asyncio.Future] = {}

    async def submit(self, request_id, prompt, params, adapter):
        sampling = SimpleNamespace(max_tokens=params["max_tokens"], logprobs=None)
        self._tasks[request_id] = asyncio.ensure_future(self._run(request_id, prompt, sampling, None))

    async def aborted(self) -> list[str]:
        await asyncio.sleep(0.2)  # an abort is sent without waiting for it
        return self.llm.aborted


class Recorded(EngineMetrics):
    """The refusals and ended requests the engine reports (serving.metrics turns them into Prometheus')."""

    def __init__(self):
        self.refused: list[str] = []
        self.finished: list[str | None] = []

    def step(self, report) -> None:
        self.finished += [g.finish_reason for g in report.finished]

    def rejected(self, reason: str, adapter: str | None = None) -> None:
        self.refused.append(reason)


@pytest.fixture
def front(ray_cluster, tmp_path):
    """(a VllmEngine over a CountingWorker actor: 2 running, 1 waiting, a 1 s deadline; the actor)."""
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the cluster's workers do not import tests/
    actor = ray.remote(CountingWorker).options(num_cpus=0, max_concurrency=100).remote()
    engine = VllmEngine(actor, {"vocab_size": 100, "max_model_len": 256}, {EOS}, max_batch=2, max_queue=1,
                        retry_after_s=1, max_prompt_tokens=128, timeout_s=1.0, work_dir=str(tmp_path / "work"))
    ray.get(actor.__ray_ready__.remote())  # started, as launch's ready() waits for vLLM's engine
    engine.metrics = Recorded()
    try:
        yield engine, actor
    finally:
        engine.close(timeout=5)


def test_the_deadline_ends_a_request_with_its_text_so_far_and_aborts_it_in_vllm(front):
    import ray

    engine, actor = front
    t0 = time.perf_counter()
    gen = engine.submit([1, 2, 3], SamplingParams(max_tokens=200, temperature=0))  # 10 s of tokens
    text, reason = gen.result(timeout=30)
    assert reason == "timeout" and 0.9 < time.perf_counter() - t0 < 10
    assert text.startswith(" t0 t1") and gen.completion_tokens == len(text.split()) == len(gen.tokens)
    assert len(ray.get(actor.aborted.remote())) == 1
    assert engine.load() == {"running": 0, "waiting": 0, "planning": 0} and engine.metrics.finished == ["timeout"]


def test_a_whole_answer_then_a_cancel_that_aborts_only_its_request(front):
    import ray

    engine, actor = front
    done = engine.submit([1], SamplingParams(max_tokens=5, temperature=0), deadline=False)
    assert done.result(timeout=30) == (" t0 t1 t2 t3 t4", "length") and done.tokens == [10, 11, 12, 13, 14]

    async def cancel_after_two():
        gen = engine.submit([1], SamplingParams(max_tokens=200, temperature=0))
        other = engine.submit([2], SamplingParams(max_tokens=8, temperature=0), deadline=False)
        seen = []
        async for delta in gen:
            seen.append(delta)
            if len(seen) == 2:
                gen.cancel()
        rest = "".join([d.text async for d in other])
        return gen, seen, other, rest

    gen, seen, other, rest = asyncio.run(cancel_after_two())
    assert gen.finish_reason == "cancelled" and seen[-1].finish_reason == "cancelled" and len(seen) <= 4
    assert other.finish_reason == "length" and rest == " t0 t1 t2 t3 t4 t5 t6 t7"
    assert len(ray.get(actor.aborted.remote())) == 1


def test_a_full_front_refuses_at_once_and_takes_again_when_a_request_ends(front):
    """The refusal is ours, at once; a request cancelled as soon as it was submitted (its client gone before
    its task first ran) ends, cancelled, and gives its place back instead of holding it for good."""
    engine, _ = front
    long = [engine.submit([1], SamplingParams(max_tokens=200, temperature=0)) for _ in range(3)]  # 2 run, 1 waits
    t0 = time.perf_counter()
    with pytest.raises(QueueFull) as refused:
        engine.submit([1], SamplingParams(max_tokens=4, temperature=0))
    assert time.perf_counter() - t0 < 0.1 and refused.value.retry_after_s == 1
    assert engine.metrics.refused == ["queue_full"]
    long[0].cancel()
    assert long[0].result(timeout=30) == ("", "cancelled")
    again = engine.submit([1], SamplingParams(max_tokens=2, temperature=0), deadline=False)
    assert again.result(timeout=30)[1] == "length"
    assert "cancelled" in engine.metrics.finished and "length" in engine.metrics.finished


def test_a_dead_worker_fails_what_waits_and_stops_the_engine(front):
    import ray

    engine, actor = front
    gen = engine.submit([1], SamplingParams(max_tokens=200, temperature=0), deadline=False)
    while not gen.tokens:  # running in the worker
        time.sleep(0.05)
    ray.kill(actor)
    with pytest.raises(EngineStopped):
        gen.result(timeout=30)
    assert engine.stopped and "restart" in engine.stopped
    with pytest.raises(EngineStopped):
        engine.submit([1], SamplingParams(max_tokens=2, temperature=0))

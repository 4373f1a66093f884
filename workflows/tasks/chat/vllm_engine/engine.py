"""`VllmEngine`: the builtin engine's interface (`admit`, `submit` -> Generation, `call`, `load`, `close`,
`metrics`, `stopped`) over vLLM's engine in a Ray actor (worker.VllmWorker), so the OpenAI routes, their
limits and metrics serve either engine.

Ours here, on purpose: admission (max_batch running in vLLM, max_queue waiting beyond them, else QueueFull
at once: vLLM's own admission answers 503 only past its limits), the prompt cap, the deadline (an abort
past timeout_s, finish_reason "timeout") and the per-request figures of serving.metrics. vLLM's: batching,
its KV cache, sampling, stop strings, detokenizing, grammars (its guidance backend), LoRA.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import shutil
import threading
import time
from concurrent.futures import Future
from typing import Any

from workflows.errors import UserError
from workflows.tasks.chat.engine import (
                                         Delta,
                                         EngineMetrics,
                                         EngineStopped,
                                         Generation,
                                         PromptTooLong,
                                         QueueFull,
                                         SamplingParams,
                                         StepReport,
                                         TokenLogprob,
)
from workflows.tasks.chat.vllm_engine.grammar_text import GrammarText
from workflows.tasks.chat.vllm_engine.model_files import checked_adapter

log = logging.getLogger(__name__)


class VllmEngine:
    """Requests to one vLLM engine (`actor`: a started worker.VllmWorker); `info`: its `ready()` answer;
    `eos`: the model's end-of-sequence ids (left out of a delta's token ids, as the builtin engine does);
    `max_lora_rank`: the largest adapter rank vLLM was started for, None when it takes no adapters."""

    constraints_as_text = True  # grammars go to vLLM as Lark text (GrammarText), not as our matchers

    def __init__(self, actor, info: dict[str, Any], eos: set[int], *, max_batch: int, max_queue: int,
                 retry_after_s: int, max_prompt_tokens: int, timeout_s: float | None, work_dir: str,
                 max_lora_rank: int | None = 16):
        self.actor, self.eos, self.work_dir, self.max_lora_rank = actor, eos, work_dir, max_lora_rank
        self.vocab_size, self.max_context = int(info["vocab_size"]), int(info["max_model_len"])
        self.max_prompt_tokens = min(max_prompt_tokens, self.max_context - 1)
        self.max_batch, self.max_queue, self.retry_after_s = max_batch, max_queue, retry_after_s
        self.timeout_s = timeout_s
        self.metrics = EngineMetrics()
        self.stopped: str | None = None
        self._ids = itertools.count()
        self._lora_ids = itertools.count(1)  # vLLM's adapter ids: 1 and up
        self._lock = threading.Lock()
        self._in_flight: dict[int, tuple[Generation, asyncio.Task | None]] = {}  # its task once started
        self._planning = 0
        self._closed = False
        self._live: dict[str, tuple[Generation, asyncio.Future]] = {}  # request id -> (its request, its end)
        self._loop = asyncio.new_event_loop()  # drives the worker's stream, whatever thread submits
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-streams", daemon=True)
        self._thread.start()
        self._listener = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)

    # --- callers' side (the builtin engine's contract) ---------------------------------------------
    def admit(self, adapter: str | None = None) -> None:
        with self._lock:
            self._refuse_if_full(adapter)
            self._planning += 1

    def release(self) -> None:
        with self._lock:
            self._planning -= 1

    def submit(self, prompt: list[int], params: SamplingParams, adapter: str | None = None, *,
               deadline: bool = True, arrived: float | None = None, admitted: bool = False) -> Generation:
        try:
            gen = self._checked(prompt, params, adapter, self.timeout_s if deadline else None, arrived)
            with self._lock:
                self._planning -= admitted
                admitted = False
                self._refuse_if_full(adapter)
                self._in_flight[gen.id] = (gen, None)
        except BaseException:
            if admitted:
                self.release()
            raise
        asyncio.run_coroutine_threadsafe(self._start(gen), self._loop)
        return gen

    def _checked(self, prompt, params, adapter, deadline_s, arrived) -> Generation:
        if not prompt:
            raise ValueError("the prompt is empty")
        n = len(prompt)
        if n > self.max_prompt_tokens:
            self.metrics.rejected("context_length_exceeded", adapter)
            raise PromptTooLong(f"the prompt is {n} tokens; the most this server takes is {self.max_prompt_tokens}")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias: token {max(params.logit_bias)} is not in the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        return Generation(self, list(prompt), params, adapter, deadline_s, arrived)  # type: ignore[arg-type]

    def _refuse_if_full(self, adapter: str | None) -> None:  # under the lock
        if self._closed or self.stopped:
            raise EngineStopped(self.stopped or "the engine is closed")
        waiting = len(self._in_flight) + self._planning - self.max_batch
        if waiting >= self.max_queue:
            self.metrics.rejected("queue_full", adapter)
            raise QueueFull(max(waiting, 0), self.retry_after_s)

    def call(self, fn) -> Future:
        """Run `fn` in the engine's stream loop (adapters load through it); a Future of its result."""
        fut: Future = Future()

        async def run():
            try:
                result = fn()
                fut.set_result(await result if inspect.isawaitable(result) else result)
            except BaseException as e:
                fut.set_exception(e)

        asyncio.run_coroutine_threadsafe(run(), self._loop)
        return fut

    def add_adapter(self, name: str, model_dir: str) -> Future:
        """Load the registered adapter in `model_dir` into vLLM as `name` (a Future): its files as our
        checks read them (model_files.checked_adapter), never the bucket's as they are."""
        if self.max_lora_rank is None:
            refused: Future = Future()
            refused.set_exception(UserError("this replica's vLLM engine takes no LoRA adapters "
                                            "(serve.generate.vllm_engine_args.enable_lora is false)"))
            return refused
        lora_id, max_rank = next(self._lora_ids), self.max_lora_rank

        async def add():
            folder = await asyncio.to_thread(checked_adapter, model_dir, self.work_dir, max_rank)
            await self.actor.add_lora.remote(name, lora_id, folder)
            return name

        return self.call(add)

    def remove_adapter(self, name: str) -> Future:
        return self.call(lambda: self.actor.remove_lora.remote(name))

    def load(self) -> dict[str, int]:
        with self._lock:
            n = len(self._in_flight)
            return {"running": min(n, self.max_batch), "waiting": max(n - self.max_batch, 0),
                    "planning": self._planning}

    def close(self, timeout: float = 10) -> None:
        import ray

        self._closed = True
        for _, task in list(self._in_flight.values()):
            if task is not None:
                self._loop.call_soon_threadsafe(task.cancel)
        self._listener.cancel()
        try:
            ray.get(self.actor.shutdown.remote(), timeout=timeout)
        except Exception as e:  # the actor is gone already
            log.warning("vLLM worker shutdown: %r", e)
        ray.kill(self.actor)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def _wake(self) -> None:
        """A Generation was cancelled: end its stream (and vLLM's request) now."""
        self._loop.call_soon_threadsafe(self._cancel_cancelled)

    def _cancel_cancelled(self) -> None:
        for gen, task in list(self._in_flight.values()):
            if task is not None and gen.cancelled:
                task.cancel()

    # --- the stream loop --------------------------------------------------------------------------
    async def _start(self, gen: Generation) -> None:
        task = asyncio.ensure_future(self._drive(gen))
        task.add_done_callback(lambda _: self._end_unstarted(gen))
        with self._lock:
            self._in_flight[gen.id] = (gen, task)
        if gen.cancelled:
            task.cancel()

    def _end_unstarted(self, gen: Generation) -> None:
        """A task cancelled before its first step never ran `_drive` (nor its cleanup), and nothing of it
        reached vLLM: its request ends here, cancelled, instead of holding a place in the batch for good."""
        if gen.finish_reason is None:
            with self._lock:
                self._in_flight.pop(gen.id, None)
            self._end(gen, "cancelled", Delta("", "cancelled"))

    async def _listen(self) -> None:
        """The worker's one stream of every request's news: each batch (what came since the last) advances
        its requests and is reported as one step (the metrics' calls once per batch, not per request). If
        the stream ends (the worker died) the engine has stopped: nothing pending waits, /healthz says so."""
        try:
            async for ref in self.actor.outputs.remote():
                report = StepReport()
                for request_id, item in await ref:
                    live = self._live.get(request_id)
                    if live is None or live[1].done():  # ended here already (cancelled, its deadline)
                        continue
                    gen, done = live
                    if "error" in item:
                        done.set_exception(RuntimeError(item["error"]))
                    elif self._news(gen, item, report):
                        done.set_result(None)
                load = self.load()
                report.running, report.waiting = load["running"], load["waiting"]
                self.metrics.step(report)
            raise RuntimeError("the stream ended")
        except BaseException as e:
            if not self._closed:
                log.critical("the vLLM worker's stream ended: %r", e)
                self.stopped = f"the vLLM engine's worker stopped ({type(e).__name__}); the replica must restart"
            for _, done in list(self._live.values()):
                if not done.done():
                    done.set_exception(EngineStopped(self.stopped or "the engine is closed"))
            if isinstance(e, asyncio.CancelledError):
                raise

    async def _drive(self, gen: Generation) -> None:
        """One request: submitted to the worker, then waited on (the listener advances it) until it ends, its
        deadline passes (aborted in vLLM, "timeout") or its caller cancels it ("cancelled")."""
        request_id = f"{gen.id}-{id(self)}"
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._live[request_id] = (gen, done)
        reason: str | None = None
        try:
            left = gen.deadline - time.perf_counter() if gen.deadline is not None else None
            async with asyncio.timeout(left):
                await self.actor.submit.remote(request_id, gen.prompt, vllm_params(gen.params), gen.adapter)
                await done
                return
        except TimeoutError:
            reason = "timeout"
        except asyncio.CancelledError:
            reason = "cancelled"
        except Exception as e:  # that request's alone
            log.error("request %d failed in vLLM: %r", gen.id, e)
            self._end(gen, "error", e)
            return
        finally:
            self._live.pop(request_id, None)
            with self._lock:
                self._in_flight.pop(gen.id, None)
        self.actor.abort.remote(request_id)
        self._end(gen, reason, Delta("", reason))

    def _news(self, gen: Generation, item: dict, report: StepReport) -> bool:
        """One output of vLLM's for a request: its tokens timed and counted, its delta sent, its figures in
        `report`; whether it ended the request."""
        now = time.perf_counter()
        ids = item["token_ids"]
        for _ in ids:
            if not gen.token_times:
                gen.times["first_token"] = now
                report.first_tokens.append((gen, now - gen.times["submitted"]))
                report.prefill_tokens += gen.prompt_tokens
            else:
                report.token_gaps.append((gen, now - gen.token_times[-1]))
            gen.token_times.append(now)
        gen.tokens.extend(ids)
        gen.completion_tokens += len(ids)
        report.decode_tokens += len(ids)
        logprobs = ([TokenLogprob(t, lp, [tuple(x) for x in top]) for t, lp, top in item["logprobs"]]
                    if item["logprobs"] is not None else None)
        shown = [t for t in ids if t not in self.eos or gen.params.ignore_eos]
        if logprobs is not None:
            logprobs = [lp for t, lp in zip(ids, logprobs) if t in shown]
        delta = Delta(item["text"], item["finish_reason"], shown, logprobs)
        if item["finish_reason"] is None:
            gen._push(delta)
            return False
        self._end(gen, item["finish_reason"], delta, report)
        return True

    def _end(self, gen: Generation, reason: str, last: Delta | BaseException, report: StepReport | None = None) -> None:
        gen.finish_reason = reason
        gen.times["finished"] = time.perf_counter()
        gen._push(last)
        if report is not None:
            report.finished.append(gen)  # reported by its caller
        else:
            self.metrics.step(StepReport(finished=[gen]))


def vllm_params(params: SamplingParams) -> dict[str, Any]:
    """A request's settings as vLLM's SamplingParams fields (and `grammar`, a GrammarText's Lark text)."""
    out: dict[str, Any] = {
        "max_tokens": params.max_tokens, "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p, "seed": params.seed, "stop": list(params.stop), "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "logit_bias": {int(k): float(v) for k, v in params.logit_bias.items()} or None}
    if params.constraint is not None:
        if not isinstance(params.constraint, GrammarText):
            raise TypeError("the vLLM engine takes a grammar as text (GrammarText), not a token matcher")
        out["grammar"] = params.constraint.lark
    return out

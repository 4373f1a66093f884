"""The decode loop: one thread per engine runs steps over a Hugging Face causal LM (optionally a peft
model with LoRA adapters, mixed per request) while callers submit requests from any thread.

A step (modules of workflows.tasks.chat.engine): requests join free slots; the `scheduler` picks its
tokens (one per decoding row, prompt chunks of the rows prefilling); one `forward` computes them all; the
`sampler` picks each row's next token; texts advance (detokenized, stop strings found), rows that ended
leave their slots, and what the step cost is learned for the next ones' prefill budget (`costs`).

Every tensor the engine makes is made on the model's device, so the cache and the logits stay there;
only the chosen token ids (and requested log probabilities) come back to the host, once per step.
Detokenizing and stop strings run in the decode thread, bounded per token (TextState). Requests'
tokens go back through their `Generation` (an async iterator, or `result()`). A step's Exception fails
the requests of that step and the engine goes on; anything else that ends the decode thread (a
BaseException, such as a tokenizer's Rust panic) fails every pending request at once and leaves the
engine `stopped`, which the replica's health check reports (workflows.tasks.chat.serving).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from workflows.tasks.chat.engine.cache import SlotCache, check_full_attention, use_slot_attention
from workflows.tasks.chat.engine.compiled import build as build_compiled
from workflows.tasks.chat.engine.device import model_device, model_dtype
from workflows.tasks.chat.engine.forward import step_logits
from workflows.tasks.chat.engine.linear import pack_linears
from workflows.tasks.chat.engine.metrics import EngineMetrics, StepReport
from workflows.tasks.chat.engine.params import SamplingParams
from workflows.tasks.chat.engine.requests import (
    Delta,
    EngineStopped,
    Generation,
    PromptTooLong,
    QueueFull,
    TokenLogprob,
)
from workflows.tasks.chat.engine.sampler import Sampler
from workflows.tasks.chat.engine.scheduler import DEFAULTS, Row, Scheduler, StepTokens
from workflows.tasks.chat.engine.text import TextState
from workflows.tasks.chat.engine.threads import release_openmp_pool

log = logging.getLogger(__name__)
BASE = "__base__"  # peft's name for "no adapter" in a mixed-adapter batch


class Engine:
    """The decode loop over a causal LM; `submit` from any thread, `call` to change the model between
    steps (load or delete an adapter), `close` to stop.

    max_batch: requests decoded together (the cache's slots); max_queue: requests waiting beyond the batch's free
    slots (one more is QueueFull); max_context: positions one request may use, its prompt and its answer (at most
    the model's); max_prompt_tokens: the longest prompt taken (PromptTooLong beyond); mixed_step_ratio,
    prefill_chunk, max_prefill_tokens, prefill_wave, join_wait_s: the scheduler's (prefill budgets per step, and how
    long an empty batch's step waits for requests to gather); timeout_s: each request's deadline from its arrival
    ("timeout" after it); prepack: on a CPU, fp32 Linear layers compute with a packed copy of their weights
    (engine.linear); forward ("compiled", "auto" or "eager") and one_token_graph ("auto", "on", "off"):
    engine.compiled; attention_kernel ("auto", "kernel", "torch"): engine.kernels (workflows.tasks.chat.engine)."""

    def __init__(self, model, tokenizer, *, max_batch: int = 8, max_queue: int = 32, max_context: int | None = None,
                 retry_after_s: int = 1, max_prompt_tokens: int | None = None,
                 prefill_chunk: int = DEFAULTS.prefill_chunk, max_prefill_tokens: int = DEFAULTS.max_prefill_tokens,
                 mixed_step_ratio: float | None = DEFAULTS.mixed_step_ratio,
                 prefill_wave: float | None = DEFAULTS.prefill_wave, join_wait_s: float = DEFAULTS.join_wait_s,
                 timeout_s: float | None = None, metrics: EngineMetrics | None = None, prepack: bool = True,
                 forward: str = "eager", one_token_graph: str = "auto", attention_kernel: str = "auto"):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.device = model_device(model)  # where every tensor the engine makes goes
        check_full_attention(model.config)
        use_slot_attention(model)
        self.packed_bytes = pack_linears(model) if prepack and self.device.type == "cpu" else 0  # logged there
        self.max_batch, self.max_queue, self.retry_after_s = max_batch, max_queue, retry_after_s
        context = int(getattr(model.config, "max_position_embeddings", 2048))
        self.max_context, self.timeout_s = min(max_context or context, context), timeout_s
        self.max_prompt_tokens = min(max_prompt_tokens or self.max_context, self.max_context - 1)
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.vocab_size = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        self.cache = SlotCache(model.config, max_batch, self.max_context, self.device, model_dtype(model),
                               attention_kernel)
        self.compiled = build_compiled(model, forward, self.cache, one_token_graph)  # before any request
        self.sampler = Sampler(self.vocab_size, max_batch, self.device)
        self.scheduler = Scheduler(max_batch, max_queue, prefill_chunk, max_prefill_tokens, mixed_step_ratio,
                                   prefill_wave, join_wait_s)
        # for benchmarks and tests (row_steps: decoding rows summed over steps; over decode_steps, the mean batch)
        self.stats = {"steps": 0, "tokens": 0, "row_steps": 0, "decode_steps": 0, "prefills": 0, "max_rows": 0,
                      "prefill_tokens": 0, "decode_tokens": 0, "compiled_steps": 0}
        self.metrics = metrics or EngineMetrics()
        self.on_finish: Callable[[Generation], None] | None = None  # called in the decode thread as one ends
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._rows: list[Row] = []  # in the order they joined
        self._joining: list[Generation] = []  # taken from the queue for the step running now
        self._closed = False
        self.stopped: str | None = None  # why the decode thread ended, once it has
        release_openmp_pool()  # the steps' OpenMP threads: the decode thread's alone (engine.threads)
        self._thread = threading.Thread(target=self._run, name="generate", daemon=True)
        self._thread.start()

    # --- callers' side ----------------------------------------------------------------------------
    def admit(self, adapter: str | None = None) -> None:
        """Count a request still being planned (template, tokens, grammar) as waiting, or raise QueueFull
        at once: a replica at capacity refuses before it plans. Its `submit(admitted=True)`, or
        `release` if it is refused meanwhile, ends the count."""
        with self._cond:
            self._refuse_if_full(adapter)
            self.scheduler.planning += 1

    def release(self) -> None:
        with self._cond:
            self.scheduler.planning -= 1
            self._cond.notify()  # a step gathering an empty batch's requests waits on those being planned

    def submit(self, prompt: list[int], params: SamplingParams, adapter: str | None = None, *,
               deadline: bool = True, arrived: float | None = None, admitted: bool = False) -> Generation:
        """Queue a request (`adapter`: a peft adapter's name; `deadline`: whether timeout_s applies, from
        `arrived` (perf_counter; default now), as to a client's request, not to batch work that waits its
        turn; `admitted`: counted by `admit`). Raises before any compute: PromptTooLong (a ValueError) for
        a prompt over max_prompt_tokens or leaving no room in the context, ValueError for an empty prompt
        or a logit_bias outside the vocabulary, QueueFull when max_queue requests already wait beyond what
        the batch has room for, EngineStopped once the engine is closed or its thread has died."""
        try:
            gen = self._checked(prompt, params, adapter, self.timeout_s if deadline else None, arrived)
        except BaseException:
            if admitted:
                self.release()
            raise
        with self._cond:
            self.scheduler.planning -= admitted
            self._refuse_if_full(adapter)
            self.scheduler.waiting.append(gen)
            self._cond.notify()
        return gen

    def _checked(self, prompt: list[int], params: SamplingParams, adapter: str | None, deadline_s: float | None,
                 arrived: float | None) -> Generation:
        if not prompt:
            raise ValueError("the prompt is empty")
        n = len(prompt)
        if n >= self.max_context or n > self.max_prompt_tokens:
            self.metrics.rejected("context_length_exceeded", adapter)
            if n >= self.max_context:
                raise PromptTooLong(f"the prompt is {n} tokens; this model's context is {self.max_context}")
            raise PromptTooLong(f"the prompt is {n} tokens; the most this server takes is {self.max_prompt_tokens}")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias: token {max(params.logit_bias)} is not in the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        return Generation(self, list(prompt), params, adapter, deadline_s, arrived)

    def _refuse_if_full(self, adapter: str | None) -> None:  # under the lock
        if self._closed or self.stopped:
            raise EngineStopped(self.stopped or "the engine is closed")
        if not self.scheduler.room(len(self._rows)):
            self.metrics.rejected("queue_full", adapter)
            raise QueueFull(len(self.scheduler.waiting) + self.scheduler.planning, self.retry_after_s)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` in the decode thread between two steps (the model is not in use then)."""
        fut: Future = Future()
        with self._cond:
            if self._closed or self.stopped:
                fut.set_exception(EngineStopped(self.stopped or "the engine is closed"))
                return fut
            self._commands.append((fn, fut))
            self._cond.notify()
        return fut

    def load(self) -> dict[str, int]:
        """Requests in the batch, waiting, and admitted while being planned (a snapshot)."""
        with self._cond:
            return {"running": len(self._rows), "waiting": len(self.scheduler.waiting),
                    "planning": self.scheduler.planning}

    def close(self, timeout: float = 10) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # --- the decode thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
            self._fail_pending(EngineStopped("the engine was closed"))
        except BaseException as e:  # the thread ends: nothing pending may wait for it
            log.critical("the engine's decode thread died: %r", e)
            self.stopped = f"the engine's decode thread died ({type(e).__name__}); the replica must restart"
            self._fail_pending(EngineStopped(self.stopped))
        finally:
            release_openmp_pool()  # an ended engine leaves no OpenMP threads to throttle the next one's

    def _fail_pending(self, error: BaseException) -> None:
        """Fail every request in the batch or waiting, and every command queued: the thread is ending."""
        with self._cond:
            self._closed = True
            pending = [g for g in [r.gen for r in self._rows] + self._joining if g.finish_reason is None]
            pending += list(self.scheduler.waiting)
            self.scheduler.waiting.clear()
            commands, self._commands = self._commands, []
        for gen in pending:
            gen.finish_reason = "error"
            gen._push(error)
        for _, fut in commands:
            if not fut.done():
                fut.set_exception(error)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._commands) and \
                        (idle := self.scheduler.idle_s(len(self._rows), self.cache.free_slots(), time.perf_counter())):
                    self._cond.wait(None if idle == math.inf else idle)  # for work, or an empty batch's to gather
                if self._closed:
                    break
                commands, self._commands = self._commands, []
                cancelled, expired, joining = self.scheduler.take(self.cache.free_slots(), time.perf_counter())
                self._joining = joining
            for fn, fut in commands:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # the caller gets it
                    fut.set_exception(e)
            report = StepReport()
            for gen, reason in [(g, "cancelled") for g in cancelled] + [(g, "timeout") for g in expired]:
                self._finish(gen, Delta("", reason), report)
            started = time.perf_counter()
            try:
                with torch.inference_mode():  # the cache, the logits and the sampler's state: no autograd
                    self._step(joining, report)
            except Exception as e:  # a failed forward: fail what was running, keep serving
                log.exception("generation step failed")
                for gen in [r.gen for r in self._rows] + joining:
                    if gen.finish_reason is None:
                        self._fail(gen, e)
                for row in self._rows:
                    self.cache.release(row.slot)
                self._rows = []
            report.seconds = time.perf_counter() - started
            report.running, report.waiting = len(self._rows), len(self.scheduler.waiting)
            with self._cond:  # the waiting requests' queue, which submit() appends to
                self.scheduler.stepped(len(report.finished), len(self._rows), started, time.perf_counter())
            report.cache_tokens = sum(r.pos for r in self._rows)
            report.cache_capacity_tokens = self.cache.slots * self.cache.capacity
            try:
                self.metrics.step(report)
            except Exception:  # a watcher's failure is not the batch's
                log.exception("engine metrics failed")

    def _join(self, joining: list[Generation], report: StepReport) -> None:
        """Give each joining request a slot and its row (or end it: cancelled, adapter gone, bad settings)."""
        adapters = getattr(self.model, "peft_config", None) or {}
        for gen in joining:
            if gen.cancelled:
                self._finish(gen, Delta("", "cancelled"), report)
                continue
            if gen.adapter and gen.adapter not in adapters:
                self._fail(gen, LookupError(f"adapter {gen.adapter} is not loaded; retry the request"))
                continue
            slot = self.cache.allocate()
            try:
                sampling = self.sampler.row(gen.params, slot)
            except Exception as e:
                self.cache.release(slot)
                self._fail(gen, e)
                continue
            limit = min(gen.params.max_tokens, self.max_context - len(gen.prompt))
            self._rows.append(Row(gen, slot, sampling, TextState(gen.params.stop), limit))
            gen.steps = (self.stats["steps"], -1)
            gen.times["admitted"] = time.perf_counter()

    def _step(self, joining: list[Generation], report: StepReport) -> None:
        t0 = time.perf_counter()
        for row in list(self._rows):  # rows that end before the step: cancelled, or past their deadline
            if row.gen.cancelled:
                self._end(row, Delta("", "cancelled"), report)
            elif row.gen.deadline is not None and row.gen.deadline <= t0:
                self._end(row, Delta(row.text.delta(final=True), "timeout"), report)
        self._join(joining, report)
        if not self._rows:
            return
        use_slot_attention(self.model)  # a command may have wrapped the model (peft) or unwrapped it
        start = time.perf_counter()  # from here on, what the step's tokens cost (planned, computed, sampled)
        step = self.scheduler.plan(self._rows, BASE)
        plan = self.cache.plan(step.slots, step.positions, step.decode, [(first, n) for _, first, n in step.prefills])
        logits, ran_compiled = step_logits(self.model, self.device, step, plan, BASE, self.compiled)
        stats = self.stats
        stats["steps"] += 1  # a row that ends now ends at this count, one that joins next starts there
        stats["compiled_steps"] += ran_compiled
        for row, _, n in step.prefills:
            row.done += n
            row.pos = row.done
            report.prefill_tokens += n
        for row in step.decoding:
            row.pos += 1
        report.decode_tokens = len(step.decoding)
        stats["max_rows"] = max(stats["max_rows"], len(self._rows))  # requests in the batch (holding slots)
        self._sample(step, logits, report)
        seconds = time.perf_counter() - start
        self.scheduler.observe(step, seconds, BASE)  # what this step cost: the next steps' prefill budget
        stats["row_steps"] += len(step.decoding)
        stats["decode_steps"] += bool(step.decoding)
        stats["prefill_tokens"] += report.prefill_tokens
        stats["decode_tokens"] += report.decode_tokens
        log.debug("step: %d decoding, %d prompt tokens, %.1f ms", len(step.decoding), report.prefill_tokens,
                  1000 * (time.perf_counter() - t0))

    def _sample(self, step: StepTokens, logits: torch.Tensor, report: StepReport) -> None:
        """Choose the next token of each row that needs one, and advance those rows."""
        rows = step.sampled
        if not rows:
            return
        choices = self.sampler.choose(logits, [r.sampling for r in rows])
        ok = [(r, c) for r, c in zip(rows, choices) if not isinstance(c, BaseException)]
        for r, c in zip(rows, choices):
            if isinstance(c, BaseException):  # one row's failure to choose fails that request only
                self._end(r, None, report, error=c)
        errors = self.sampler.accepted([r.sampling for r, _ in ok], [c[0] for _, c in ok])  # type: ignore[index]
        now = time.perf_counter()
        for (row, (token, logprob)), error in zip(ok, errors):  # type: ignore[misc]
            if error is not None:
                self._end(row, None, report, error=error)
                continue
            self._advance(row, token, logprob, now, report)

    def _advance(self, row: Row, token: int, logprob: TokenLogprob | None, now: float, report: StepReport) -> None:
        """A row's new token: counted, its text advanced, its delta sent, or the row ended."""
        gen = row.gen
        if row.last < 0:
            gen.times["first_token"] = now
            report.first_tokens.append((gen, now - gen.times["submitted"]))
            self.stats["prefills"] += 1
        else:
            report.token_gaps.append((gen, now - gen.token_times[-1]))
        row.last = token
        gen.completion_tokens += 1
        gen.tokens.append(token)
        gen.token_times.append(now)
        self.stats["tokens"] += 1
        if token in self.eos and not gen.params.ignore_eos:
            self._end(row, Delta(row.text.delta(final=True), "stop"), report)
            return
        row.text.add(token, self.tokenizer)
        ids, logprobs = [token], ([logprob] if logprob is not None else None)
        constraint = gen.params.constraint
        try:
            finished = constraint is not None and constraint.done()
        except Exception as e:  # that request's alone
            self._end(row, None, report, error=e)
            return
        if row.text.stopped or finished:
            self._end(row, Delta(row.text.delta(final=True), "stop", ids, logprobs), report)
        elif gen.completion_tokens >= row.limit:
            self._end(row, Delta(row.text.delta(final=True), "length", ids, logprobs), report)
        else:
            gen._push(Delta(row.text.delta(final=False), None, ids, logprobs))

    def _end(self, row: Row, last: Delta | None, report: StepReport, error: BaseException | None = None) -> None:
        """A row leaves the batch before its caller hears (so neither load() nor admission counts it once its
        answer is out): its slot is free (nothing is copied); its request ends with `last`, or fails."""
        self._rows = [r for r in self._rows if r is not row]
        self.cache.release(row.slot)
        if error is not None:
            self._fail(row.gen, error)
            report.finished.append(row.gen)
        else:
            assert last is not None
            self._finish(row.gen, last, report)

    def _fail(self, gen: Generation, e: BaseException) -> None:
        log.error("request %d failed: %r", gen.id, e)
        self._ended(gen, "error", e)

    def _ended(self, gen: Generation, reason: str | None, last: Delta | BaseException) -> None:
        gen.finish_reason, gen.steps = reason, (gen.steps[0], self.stats["steps"])
        gen.times["finished"] = time.perf_counter()
        gen._push(last)

    def _finish(self, gen: Generation, last: Delta, report: StepReport) -> None:
        self._ended(gen, last.finish_reason, last)
        report.finished.append(gen)
        if self.on_finish is not None:
            try:
                self.on_finish(gen)
            except Exception:  # a hook's failure is not the batch's
                log.exception("on_finish hook failed")

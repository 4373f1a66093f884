"""Continuous batching for a Hugging Face causal LM (optionally a peft model with LoRA adapters): every
request in flight shares each decoding step; one that ends leaves the batch at once, and a waiting one
joins at the next step without the batch draining first.

Our own scheduler, not transformers' (`model.init_continuous_batching`, 5.23): that manager takes one
generation config and one seed for all its requests (no per-request seed, so no repeatable sampling
beside other requests), has no stop strings, and runs one model, where requests here pick a LoRA adapter
each (peft's mixed-adapter batches, `adapter_names=`). It was also measured at about half the tokens/s
of static batching with plain `generate` on CPU (26 against 50 at 16 prompts, SmolLM2-135M), with a
warm-up of several seconds on its first call.

How a step works. The batch holds one KV cache (a DynamicCache, [rows, heads, T, dim] per layer) whose
rows are left-padded to a common length T, with a 0/1 attention mask [rows, T] and each row's next
position id (its count of real tokens), so a row computes what it would alone: the padding is masked
out and the rotary positions are the row's own. A joining request is prefilled alone (its prompt, no
padding), its first token sampled, and its cache rows padded on the left and concatenated to the batch;
then one forward of every row's last token gives each its next token. A row that ends (EOS, a stop
string, max_tokens, its context, a cancel) is dropped from the cache between steps, and the columns no
remaining row uses are trimmed from the left.

Every tensor the engine makes (ids, mask, positions, the rows kept) is made on the model's device, so the
cache and the logits stay there; only the chosen token ids come back to the host (greedy rows' argmax in
one transfer a step; a sampled row's logits to the CPU, where its own seeded generator draws).

The loop runs in a thread of its own, never on the event loop; each request's tokens go back through
its `Generation` (an async iterator, or `result()` for a caller without a loop). The waiting queue is
bounded: `submit` raises `QueueFull` when it is full, for the caller to answer 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from workflows.tasks.chat.sampling import (
    MIN_TEMPERATURE,
    SamplingParams,
    TextState,
    generator,
    next_token,
    process,
    token_logprobs,
)

log = logging.getLogger(__name__)
BASE = "__base__"  # peft's name for "no adapter" in a mixed-adapter batch


def model_device(model) -> torch.device:
    """Where the model's weights are (a Hugging Face or peft model's `device`, else its first parameter's;
    the CPU for a model without parameters)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def choose_tokens(logits: torch.Tensor, params: list[SamplingParams], rngs: list[torch.Generator],
                  generated: list[list[int]] | None = None, logprobs: list | None = None) -> list:
    """Each row's next token (an int), or the exception choosing it raised, from the logits [rows, vocab]
    wherever they are: the greedy rows' argmax in one transfer; a sampled row by `next_token` on the CPU
    (its generator is a CPU one), in float32 where the model ran in lower precision. A row whose params
    ask for more (logit_bias, penalties over its `generated` tokens, a constraint, logprobs) is processed
    alone (sampling.process); `logprobs`, when given, receives each row's (token, logprob, top) or None."""
    greedy = [p.temperature < MIN_TEMPERATURE for p in params]
    picked = logits.argmax(-1).tolist() if any(g and not p.processed for g, p in zip(greedy, params)) else []
    host = None
    out: list = []
    for i, (p, rng) in enumerate(zip(params, rngs)):
        details = None
        try:
            if p.processed:
                row = process(logits[i], p, generated[i] if generated else [])
                token = int(torch.argmax(row)) if greedy[i] else next_token(row.cpu(), p, rng)
                if p.logprobs is not None:
                    details = token_logprobs(row, p, token)
                if p.constraint is not None:
                    p.constraint.accept(token)
            elif greedy[i]:
                token = int(picked[i])
            else:
                if host is None:
                    host = logits if logits.device.type == "cpu" else logits.float().cpu()
                token = next_token(host[i], p, rng)
            out.append(token)
        except Exception as e:  # that row's alone
            out.append(e)
        if logprobs is not None:
            logprobs.append(details)
    return out


class QueueFull(Exception):
    """The engine's waiting queue is full: answer 503 (or 429) with Retry-After."""

    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"the server is busy: {waiting} requests are waiting; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ModelNotFound(LookupError):
    """A request's "model" is neither the served one nor an adapter of it (HTTP 404)."""


@dataclass
class Delta:
    """One step's news for a request: new text (maybe empty) and, on its last delta, why it ended."""

    text: str
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" at the end, else None
    token_ids: list[int] = field(default_factory=list)  # the tokens sampled since the last delta
    # with params.logprobs: per token of token_ids, (id, logprob, [(top id, top logprob), ...])
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


class Generation:
    """One request: iterate it (async) for its deltas, or wait for all (`result`); `cancel` ends it."""

    def __init__(self, engine: Engine, prompt: list[int], params: SamplingParams, adapter: str | None):
        self.id = next(engine._ids)
        self.prompt, self.params, self.adapter = prompt, params, adapter
        self.prompt_tokens, self.completion_tokens = len(prompt), 0
        self.tokens: list[int] = []  # generated token ids (EOS included), written by the engine thread
        self.steps: tuple[int, int] = (-1, -1)  # the engine's step count when it joined the batch and when it ended
        # perf_counter() at submit, first token sampled, end: time to first token and tokens/s for benchmarks
        self.times: dict[str, float] = {"submitted": time.perf_counter()}
        self.token_times: list[float] = []  # perf_counter() as each token was sampled: inter-token latency
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


@dataclass
class _Row:
    """A request in the batch: its last sampled token (not yet in the cache) and its next position."""

    gen: Generation
    state: TextState
    rng: torch.Generator
    last: int
    pos: int
    limit: int  # max new tokens: the request's, within the model's context
    pending: list[int] = field(default_factory=list)  # tokens sampled, not yet in a delta
    pending_logprobs: list = field(default_factory=list)
    last_logprobs: Any = None  # the logprob details of `last`

    def delta(self, text: str, reason: str | None = None) -> Delta:
        """A delta of `text` carrying the tokens sampled since the last one (and their logprobs)."""
        d = Delta(text, reason, self.pending, self.pending_logprobs if self.gen.params.logprobs is not None else None)
        self.pending, self.pending_logprobs = [], []
        return d


class Engine:
    """The decode loop over a causal LM; `submit` from any thread, `call` to change the model between
    steps (load or delete an adapter), `close` to stop."""

    def __init__(self, model, tokenizer, *, max_batch: int = 8, max_queue: int = 32, max_context: int | None = None,
                 retry_after_s: int = 1):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.device = model_device(model)  # where every tensor the engine makes goes
        self.max_batch, self.max_queue, self.retry_after_s = max_batch, max_queue, retry_after_s
        self.max_context = max_context or int(getattr(model.config, "max_position_embeddings", 2048))
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.stats = {"steps": 0, "tokens": 0, "row_steps": 0, "prefills": 0, "max_rows": 0}  # for benchmarks
        self.on_finish: Callable[[Generation], None] | None = None  # called in the decode thread as one ends
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._waiting: deque[Generation] = deque()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="generate", daemon=True)
        self._thread.start()

    # --- callers' side ----------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, adapter: str | None = None) -> Generation:
        """Queue a request; QueueFull when max_queue requests already wait beyond what the batch has room
        for, ValueError for a prompt that leaves no room in the model's context."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_context:
            raise ValueError(f"the prompt is {len(prompt)} tokens; this model's context is {self.max_context}")
        gen = Generation(self, list(prompt), params, adapter)
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            # a request the batch can take at its next step does not wait: only those beyond count
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - len(self._rows)):
                raise QueueFull(len(self._waiting), self.retry_after_s)
            self._waiting.append(gen)
            self._cond.notify()
        return gen

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` in the decode thread between two steps (the model is not in use then)."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                fut.set_exception(RuntimeError("the engine is closed"))
                return fut
            self._commands.append((fn, fut))
            self._cond.notify()
        return fut

    def load(self) -> dict[str, int]:
        """Requests in the batch and waiting (a snapshot)."""
        with self._cond:
            return {"running": len(self._rows), "waiting": len(self._waiting)}

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
        while True:
            with self._cond:
                while not (self._closed or self._waiting or self._rows or self._commands):
                    self._cond.wait()
                if self._closed:
                    break
                commands = list(self._commands)
                self._commands.clear()
                cancelled = [g for g in self._waiting if g.cancelled]
                for g in cancelled:
                    self._waiting.remove(g)
                joining = [self._waiting.popleft() for _ in range(min(len(self._waiting),
                                                                       self.max_batch - len(self._rows)))]
            for fn, fut in commands:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # the caller gets it
                    fut.set_exception(e)
            for g in cancelled:
                self._finish_gen(g, "cancelled", "")
            try:
                self._step(joining)
            except Exception as e:  # a failed forward: fail what was running, keep serving
                log.exception("generation step failed")
                for gen in [r.gen for r in self._rows] + joining:
                    if gen.finish_reason is None:
                        gen.finish_reason = "error"
                        gen._push(e)
                self._rows, self._cache, self._mask = [], None, None
        for gen in [r.gen for r in self._rows] + list(self._waiting):
            gen._push(RuntimeError("the engine was closed"))
        with self._cond:  # commands queued but never run: their callers must not wait forever
            commands = list(self._commands)
            self._commands.clear()
        for _, fut in commands:
            fut.set_exception(RuntimeError("the engine was closed"))

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache, adapters: list[str]):
        kwargs: dict[str, Any] = {}
        if getattr(self.model, "peft_config", None):  # a peft model: each row's adapter (or none)
            kwargs["adapter_names"] = adapters
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                             use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[:, -1, :], out.past_key_values

    def _step(self, joining: list[Generation]) -> None:
        t0 = time.perf_counter()
        device = self.device
        done = [i for i, r in enumerate(self._rows) if r.gen.cancelled]
        self._drop(done, "cancelled")
        new = []
        for gen in joining:
            if gen.cancelled:
                self._finish_gen(gen, "cancelled", "")
                continue
            if gen.adapter and gen.adapter not in (getattr(self.model, "peft_config", None) or {}):
                gen.finish_reason = "error"  # unloaded between its request's load and this step
                gen._push(LookupError(f"adapter {gen.adapter} is not loaded; retry the request"))
                continue
            try:  # a joining request's failure (its prefill, its first token) is its own
                n = len(gen.prompt)
                ids = torch.tensor([gen.prompt], device=device)
                logits, cache = self._forward(ids, torch.ones_like(ids), torch.arange(n, device=device)[None], None,
                                              [gen.adapter or BASE])
                self.stats["prefills"] += 1
                limit = min(gen.params.max_tokens, self.max_context - n)
                row = _Row(gen, TextState(gen.params.stop), generator(gen.params.seed), -1, n, limit)
                gen.steps = (self.stats["steps"], -1)
                first_details: list = []
                first = choose_tokens(logits, [gen.params], [row.rng], [[]], first_details)[0]
                if isinstance(first, Exception):
                    raise first
                row.last, row.last_logprobs = first, first_details[0]
            except Exception as e:
                self._fail(gen, e)
                continue
            new.append((row, cache))
            gen.times["first_token"] = time.perf_counter()
        if new:
            self._merge(new, device)
            self._advance(list(range(len(self._rows) - len(new), len(self._rows))))
        if not self._rows:
            return
        assert self._mask is not None
        ids = torch.tensor([[r.last] for r in self._rows], device=device)
        mask = torch.cat([self._mask, torch.ones(len(self._rows), 1, dtype=self._mask.dtype, device=device)], dim=1)
        positions = torch.tensor([[r.pos] for r in self._rows], device=device)
        logits, self._cache = self._forward(ids, mask, positions, self._cache,
                                            [r.gen.adapter or BASE for r in self._rows])
        self._mask = mask
        failed = []
        details: list = []
        chosen = choose_tokens(logits, [r.gen.params for r in self._rows], [r.rng for r in self._rows],
                               [r.gen.tokens for r in self._rows], details)
        for i, (r, token) in enumerate(zip(self._rows, chosen)):
            r.pos += 1
            if isinstance(token, Exception):  # one row's failure to choose its token fails that request only
                self._fail(r.gen, token)
                failed.append(i)
            else:
                r.last, r.last_logprobs = token, details[i]
        self._drop(failed, None)
        self.stats["steps"] += 1
        self.stats["row_steps"] += len(self._rows)
        self.stats["max_rows"] = max(self.stats["max_rows"], len(self._rows))
        self._advance(list(range(len(self._rows))))
        log.debug("step of %d rows in %.1f ms", len(self._rows), 1000 * (time.perf_counter() - t0))

    def _advance(self, indices: list[int]) -> None:
        """Count each row's newly sampled token (`last`), send its text, drop the rows that ended."""
        ended: dict[int, str] = {}
        now = time.perf_counter()
        for i in indices:
            r = self._rows[i]
            r.gen.completion_tokens += 1
            r.gen.tokens.append(r.last)
            r.gen.token_times.append(now)
            self.stats["tokens"] += 1
            r.pending.append(r.last)
            if r.last_logprobs is not None:
                r.pending_logprobs.append(r.last_logprobs)
            if r.last in self.eos:
                ended[i] = "stop"
                continue
            r.state.add(r.last, self.tokenizer)
            constraint = r.gen.params.constraint
            if r.state.stopped or (constraint is not None and constraint.done()):
                ended[i] = "stop"
            elif r.gen.completion_tokens >= r.limit:
                ended[i] = "length"
            elif text := r.state.delta(final=False):
                r.gen._push(r.delta(text))
        for i, reason in ended.items():
            row = self._rows[i]
            self._finish_gen(row.gen, reason, row.state.delta(final=True), row)
        self._drop(sorted(ended), None)

    def _fail(self, gen: Generation, e: Exception) -> None:
        log.error("request %d failed: %r", gen.id, e)
        gen.finish_reason = "error"
        gen.times["finished"] = time.perf_counter()
        gen._push(e)

    def _finish_gen(self, gen: Generation, reason: str, text: str, row: _Row | None = None) -> None:
        gen.finish_reason = reason
        gen.steps = (gen.steps[0], self.stats["steps"])
        gen.times["finished"] = time.perf_counter()
        gen._push(row.delta(text, reason) if row is not None else Delta(text, reason))
        if self.on_finish is not None:
            try:
                self.on_finish(gen)
            except Exception:  # a hook's failure is not the batch's
                log.exception("on_finish hook failed")

    def _drop(self, indices: list[int], reason: str | None) -> None:
        """Remove rows from the batch (telling each `reason`, if given), and the columns left unused."""
        if not indices:
            return
        for i in indices:
            if reason is not None:
                self._finish_gen(self._rows[i].gen, reason, "")
        keep = [i for i in range(len(self._rows)) if i not in set(indices)]
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        assert self._mask is not None
        index = torch.tensor(keep, device=self._mask.device)
        self._mask = self._mask[index]
        first = int(self._mask.any(dim=0).int().argmax())  # the first column a remaining row uses
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]
        self._mask = self._mask[:, first:]

    def _merge(self, new: list[tuple[_Row, Any]], device: torch.device) -> None:
        """Append prefilled rows to the batch: every row's cache left-padded to the longest."""
        parts: list[tuple[Any, Any]] = ([(self._cache, self._mask)] if self._rows else []) + [
            (cache, torch.ones(1, row.pos, dtype=torch.long, device=device)) for row, cache in new]
        width = max(mask.shape[1] for _, mask in parts)
        caches = [c for c, _ in parts]
        base = caches[0]
        if any(type(layer).__name__ != "DynamicLayer" for layer in base.layers):  # sliding windows, linear attention
            raise NotImplementedError(f"cache layers {sorted({type(x).__name__ for x in base.layers})}: the engine "
                                      "pads and trims full-attention layers (DynamicLayer) only")
        for li, layer in enumerate(base.layers):
            keys, values = [], []
            for c in caches:
                k, v = c.layers[li].keys, c.layers[li].values
                pad = width - k.shape[2]
                keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            layer.keys, layer.values = torch.cat(keys), torch.cat(values)
        self._mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for _, m in parts])
        self._cache = base
        self._rows += [row for row, _ in new]

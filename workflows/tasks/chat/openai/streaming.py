"""One completion's answer, as OpenAI shapes it: a JSON body once its generations end, or Server-Sent
Events as they go (`data: {chunk}` per delta of any choice, a last chunk per choice with its finish
reason, optionally one with the usage, then `data: [DONE]`). Each choice is shaped by
workflows.tasks.chat.openai.choices.

Whatever way the answer ends (done, a client gone, the replica's task cancelled), the generations still
running are cancelled, and the request stops counting as in flight (the drain waits on that) and
as a user of its adapter, exactly once.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.responses import JSONResponse, StreamingResponse

from workflows.tasks.chat.engine import Delta, EngineStopped, Generation
from workflows.tasks.chat.openai.choices import AnswerShape, Choice


def engine_error(e: Exception, retry_after_s: int = 1) -> tuple[int, dict, dict]:
    """(status, OpenAI's error body, headers) for a generation the engine failed: an adapter unloaded
    under the request (LookupError) or an engine that stopped (its replica restarts) is a 503 to retry,
    anything else a 500; one line, no traceback."""
    message = (str(e).splitlines() or [type(e).__name__])[0]
    if isinstance(e, EngineStopped):
        return 503, {"error": {"message": message, "type": "server_error", "param": None,
                               "code": "engine_stopped"}}, {"Retry-After": "5"}
    if isinstance(e, LookupError):
        return 503, {"error": {"message": message, "type": "server_error", "param": None,
                               "code": "model_unavailable"}}, {"Retry-After": str(retry_after_s)}
    return 500, {"error": {"message": f"generation failed: {message}", "type": "server_error", "param": None,
                           "code": "generation_failed"}}, {}


class Completion:
    """The answer of one request: its generations (one per choice; prompt-major for several prompts), each
    shaped by `choices.Choice` as `shape` says (logprobs, tool calls, echo)."""

    def __init__(self, kind: str, model: str, gens: Generation | list[Generation], server,
                 release: Callable[[], None], include_usage: bool = False, shape: AnswerShape | None = None):
        self.kind, self.model, self.server = kind, model, server
        self.gens = gens if isinstance(gens, list) else [gens]
        self.gen = self.gens[0]
        self.release, self.include_usage = release, include_usage
        self.shape = shape or AnswerShape()
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        per = self.shape.choices_per_prompt
        echo = self.shape.echo
        self.choices = [Choice(i, kind, self.shape, echo[i // per] if echo else "") for i in range(len(self.gens))]
        self._done = False

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        for gen in self.gens:
            if gen.finish_reason is None:
                gen.cancel()
        self.server.in_flight -= 1
        self.release()

    def _retry_after_s(self) -> int:
        return int(getattr(getattr(self.gen, "_engine", None), "retry_after_s", 1))

    def usage(self) -> dict:
        """Each prompt's tokens once (its n choices share it), every choice's completion tokens."""
        per = self.shape.choices_per_prompt
        prompt = sum(g.usage["prompt_tokens"] for g in self.gens[::per])
        completion = sum(g.usage["completion_tokens"] for g in self.gens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _envelope(self, choices: list, **extra) -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    async def json_response(self) -> JSONResponse:
        async def collect(gen: Generation, choice: Choice) -> str | None:
            reason = None
            async for d in gen:
                choice.take(d)
                reason = d.finish_reason
            return reason

        try:
            try:
                reasons = await asyncio.gather(*(collect(g, c) for g, c in zip(self.gens, self.choices)))
            except Exception as e:  # the engine failed a generation
                status, body, headers = engine_error(e, self._retry_after_s())
                return JSONResponse(body, status_code=status, headers=headers)
            choices = [c.final(r) for c, r in zip(self.choices, reasons)]
            return JSONResponse(self._envelope(choices, usage=self.usage()))
        finally:
            self.finish()

    def _chunk(self, choice: dict) -> str:
        body = self._envelope([choice])
        if self.kind == "chat":
            body["object"] = "chat.completion.chunk"
        if self.include_usage:
            body["usage"] = None
        if self.shape.obfuscation:
            body["obfuscation"] = secrets.token_urlsafe(random.randint(1, 24))
        return f"data: {json.dumps(body)}\n\n"

    def _delta_chunks(self, choice: Choice, d: Delta) -> list[str]:
        text, calls, logprobs = choice.take(d)
        if d.finish_reason is not None and (text or calls) and self.kind == "chat":
            # OpenAI's last chunk carries the finish reason and no content
            return [self._chunk(choice.chunk(text, calls, logprobs, None)),
                    self._chunk(choice.chunk("", [], None, d.finish_reason))]
        # a token whose text is held back (it may begin a stop string, a character is incomplete, a special
        # token shows nothing) still gets its chunk, with empty content, as vLLM streams it: a client sees
        # each token when it is generated; only the tool-call reader's held text waits for its call
        if text or calls or logprobs or d.finish_reason is not None or (d.token_ids and choice.reader is None):
            return [self._chunk(choice.chunk(text, calls, logprobs, d.finish_reason))]
        return []

    async def events(self) -> AsyncIterator[str]:
        try:
            for c in self.choices:
                if self.kind == "chat":
                    yield self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None})
                elif c.prompt_text:
                    yield self._chunk({"index": c.index, "text": c.prompt_text, "logprobs": None,
                                       "finish_reason": None})
            try:
                async for i, d in self._merged():
                    for chunk in self._delta_chunks(self.choices[i], d):
                        yield chunk
            except Exception as e:  # the engine failed it mid-stream: an error event, then the end
                yield f"data: {json.dumps(engine_error(e, self._retry_after_s())[1])}\n\n"
                yield "data: [DONE]\n\n"
                return
            if self.include_usage:
                usage = self._envelope([], usage=self.usage())
                if self.kind == "chat":
                    usage["object"] = "chat.completion.chunk"
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.finish()

    async def _merged(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) from every generation as they come; the first failure is raised."""
        if len(self.gens) == 1:
            async for d in self.gen:
                yield 0, d
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: Generation) -> None:
            try:
                async for d in gen:
                    q.put_nowait((i, d))
            except Exception as e:
                q.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.gens)]
        try:
            left = len(self.gens)
            while left:
                i, item = await q.get()
                if isinstance(item, Exception):
                    raise item
                if item.finish_reason is not None:
                    left -= 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def stream_response(self) -> StreamingResponse:
        return _Stream(self.events(), self.finish, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Stream(StreamingResponse):
    """A streaming response that always runs `cleanup` once it is over, even if its body never started
    (a client that left before the first chunk)."""

    def __init__(self, content, cleanup: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()

"""One completion's answer, as OpenAI shapes it: a JSON body once the generation ends, or Server-Sent
Events as it goes (`data: {chunk}` per delta, a last chunk with the finish reason, optionally one with
the usage, then `data: [DONE]`).

Whatever way the answer ends (done, a client gone, the replica's task cancelled), the generation is
cancelled if still running, and the request stops counting as in flight (the drain waits on that) and
as a user of its adapter, exactly once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.responses import JSONResponse, StreamingResponse

from workflows.tasks.chat.engine import Delta, Generation


def engine_error(e: Exception, retry_after_s: int = 1) -> tuple[int, dict, dict]:
    """(status, OpenAI's error body, headers) for a generation the engine failed: an adapter unloaded
    under the request (LookupError) is a 503 to retry, anything else a 500; one line, no traceback."""
    message = (str(e).splitlines() or [type(e).__name__])[0]
    if isinstance(e, LookupError):
        return 503, {"error": {"message": message, "type": "server_error", "param": None,
                               "code": "model_unavailable"}}, {"Retry-After": str(retry_after_s)}
    return 500, {"error": {"message": f"generation failed: {message}", "type": "server_error", "param": None,
                           "code": "generation_failed"}}, {}


class Completion:
    def __init__(self, kind: str, model: str, gen: Generation, server, release: Callable[[], None],
                 include_usage: bool = False):
        self.kind, self.model, self.gen, self.server = kind, model, gen, server
        self.release, self.include_usage = release, include_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._done = False

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self.gen.finish_reason is None:
            self.gen.cancel()
        self.server.in_flight -= 1
        self.release()

    def _retry_after_s(self) -> int:
        return int(getattr(getattr(self.gen, "_engine", None), "retry_after_s", 1))

    def _envelope(self, choices: list, **extra) -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    async def json_response(self) -> JSONResponse:
        try:
            parts, reason = [], None
            try:
                async for d in self.gen:
                    parts.append(d.text)
                    reason = d.finish_reason
            except Exception as e:  # the engine failed this generation
                status, body, headers = engine_error(e, self._retry_after_s())
                return JSONResponse(body, status_code=status, headers=headers)
            text = "".join(parts)
            if self.kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                          "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            return JSONResponse(self._envelope([choice], usage=self.gen.usage))
        finally:
            self.finish()

    def _chunk(self, delta: Delta | None, first: bool = False) -> str:
        reason = delta.finish_reason if delta else None
        if self.kind == "chat":
            content: dict = {"role": "assistant", "content": ""} if first else (
                {"content": delta.text} if delta and delta.text else {})
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": reason}
            body = self._envelope([choice])
            body["object"] = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta.text if delta else "", "logprobs": None, "finish_reason": reason}
            body = self._envelope([choice])
        if self.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        try:
            if self.kind == "chat":
                yield self._chunk(None, first=True)
            try:
                async for d in self.gen:
                    if d.finish_reason is not None and d.text and self.kind == "chat":
                        yield self._chunk(Delta(d.text))  # OpenAI's last chunk carries the reason, no content
                        d = Delta("", d.finish_reason)
                    if d.text or d.finish_reason is not None:
                        yield self._chunk(d)
            except Exception as e:  # the engine failed it mid-stream: an error event, then the end
                yield f"data: {json.dumps(engine_error(e, self._retry_after_s())[1])}\n\n"
                yield "data: [DONE]\n\n"
                return
            if self.include_usage:
                usage = self._envelope([], usage=self.gen.usage)
                if self.kind == "chat":
                    usage["object"] = "chat.completion.chunk"
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.finish()

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

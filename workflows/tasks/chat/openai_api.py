"""The chat task's HTTP contract: OpenAI-compatible routes, mounted on the replica's FastAPI app by
`OpenAIContract.add_routes` (workflows.serve.app calls it for any task's contract; this one has no /predict).

GET  /v1/models             the served model (NAME:VERSION) and the adapters this replica holds
POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "max_tokens", "temperature", "top_p",
                            "seed", "stop", "stream", "stream_options": {"include_usage"}, "ignore_eos"}
POST /v1/completions        the same with "prompt" (a string, or a list of one) instead of "messages"

`"stream": true` answers Server-Sent Events, one `data: {chunk}` per delta in OpenAI's chunk format,
then `data: [DONE]`. Every answer carries `finish_reason` ("stop": end of sequence or a stop string;
"length": max_tokens or the model's context; "timeout": serve.generate.timeout_s passed, with the text
so far) and `usage`. A bad request gets a 4xx with OpenAI's error body, {"error": {"message", "type",
"param", "code"}}: a prompt over serve.generate.max_prompt_tokens (or the model's context) a 400 with
code context_length_exceeded, before any compute; more than 4 stop strings, or one over
serve.generate.max_stop_chars, a 400 naming `stop`. A full engine queue is a 429 with Retry-After, at
once; an adapter unloaded under the request a 503 with Retry-After; a generation the engine failed a
500 (a stream sends the error as its last event before `data: [DONE]`); a failure to prefill or sample
one request fails it alone. A client that disconnects ends its own generation only. The bearer token,
the drain on shutdown (503 once stopping, open streams finish) and the request metrics apply as to
every route of the app; the engine's own metrics are workflows.tasks.chat.metrics'.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request  # at module level: FastAPI resolves the routes' string annotations here
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workflows.errors import UserError
from workflows.tasks.chat.engine import ModelNotFound, PromptTooLong, QueueFull
from workflows.tasks.chat.sampling import SamplingParams
from workflows.tasks.chat.streaming import Completion
from workflows.tasks.contract import MAX_BODY_BYTES, HttpContract, register_schema

if TYPE_CHECKING:
    from workflows.config.serve import GenerateConfig

# --- request models ---------------------------------------------------------------------------------


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(..., description="text, or text parts (images are not read)")

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerateRequest(BaseModel):
    """What both routes read; other fields OpenAI clients send (user, logprobs: false, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(..., min_length=1, description="the served NAME:VERSION (or NAME), or an adapter's "
                       "(NAME:VERSION, or NAME@ALIAS: the version the alias holds now)")
    max_tokens: int | None = Field(None, ge=1, description="capped at serve.generate.max_tokens")
    temperature: float = Field(1.0, ge=0, le=2, description="0 (or below 1e-5) is greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    ignore_eos: bool = Field(False, description="not OpenAI's (vLLM's and llama.cpp's): generate past the "
                             "end-of-sequence token, up to max_tokens or a stop string (fixed lengths, for benchmarks)")

    def stops(self, max_chars: int) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s or len(s) > max_chars for s in stops):
            raise BadRequest(f"stop: up to 4 non-empty strings of at most {max_chars} characters each", "stop")
        return tuple(stops)


class ChatRequest(GenerateRequest):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' newer name")


class CompletionRequest(GenerateRequest):
    prompt: str | list[str]

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise BadRequest("prompt: one prompt per request (a string or a list of one)", "prompt")
        return self.prompt[0]


# --- errors -------------------------------------------------------------------------------------------


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          headers: dict | None = None):
    from fastapi.responses import JSONResponse

    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}
    return JSONResponse(status_code=status, content=body, headers=headers)


def as_openai_error(response):
    """The app's {"error": "..."} answer (401, 503 while stopping) in OpenAI's error shape, headers kept."""
    message = json.loads(bytes(response.body)).get("error", "")
    headers = {k: v for k, v in response.headers.items() if k.lower() in ("www-authenticate", "retry-after",
                                                                           "connection")}
    return error(response.status_code, message, headers=headers)


def validation_error(e: ValidationError) -> BadRequest:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "json_invalid":
        return BadRequest(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if not loc:
        return BadRequest(f"the body must be a JSON object: {err['msg']}")
    return BadRequest(f"{loc}: {err['msg']}", loc)


async def read_json(request, model: type[BaseModel], limit: int = MAX_BODY_BYTES) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the body is {declared} bytes; the limit is {limit}", status=413)
    body, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the body is over {limit} bytes", status=413)
        body.append(chunk)
    try:
        return model.model_validate_json(b"".join(body))
    except ValidationError as e:
        raise validation_error(e) from None


# --- the contract -------------------------------------------------------------------------------------


class OpenAIContract(HttpContract):
    """OpenAI's chat and text completions; no /predict (`predict_route`)."""

    predict_route = False
    main_route = "/v1/chat/completions"
    request_model = ChatRequest
    response_model = None

    def __init__(self, card, gen: GenerateConfig):
        self.card, self.gen = card, gen

    def openapi(self, document: dict, path: str) -> dict:
        """Declare the request bodies of the routes, which read them themselves (for OpenAI's error shape)."""
        for route, model in (("/v1/chat/completions", ChatRequest), ("/v1/completions", CompletionRequest)):
            ref, _ = register_schema(document, model)
            document["paths"][route]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}
        return document

    def example(self) -> dict:
        return {"model": f"{self.card.name}:{self.card.version}", "messages": [{"role": "user", "content": "Hi"}]}

    def demo(self, url: str, instance: dict, headers: dict) -> tuple[str, dict]:
        """A streamed chat completion of the instance's `messages`, greedy: {"text", "finish_reason",
        "chunks"} (the pipeline's requests once it has deployed the model)."""
        import requests

        body = {"model": f"{self.card.name}:{self.card.version}", "messages": instance["messages"],
                "temperature": 0, "stream": True}
        text, reason, chunks = [], None, 0
        with requests.post(f"{url}/v1/chat/completions", json=body, headers=headers, stream=True, timeout=60) as r:
            r.raise_for_status()
            for raw in r.iter_lines():
                line = raw.decode()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                for choice in json.loads(line.removeprefix("data: ")).get("choices", []):
                    text.append(choice["delta"].get("content") or "")
                    reason = choice.get("finish_reason") or reason
        return "POST /v1/chat/completions (stream)", {"text": "".join(text), "finish_reason": reason,
                                                      "chunks": chunks}

    def add_routes(self, api, server) -> None:
        from ray import serve

        predictor = server.predictor
        engine = getattr(predictor, "engine", None)  # loads the model now: the replica is healthy once it can answer
        if engine is not None:  # its figures on Prometheus, per model
            from workflows.tasks.chat.metrics import ServeMetrics

            engine.metrics = ServeMetrics(predictor.base_id, predictor.model_id)
        adapters = Adapters(server)

        async def load_adapter(model_id: str) -> AdapterRef:  # a function: Serve keeps its cache on it
            return await adapters.load(model_id)

        loader = serve.multiplexed(max_num_models_per_replica=self.gen.max_adapters)(load_adapter)
        created = int(time.time())

        def entry(model_id: str) -> dict:
            return {"id": model_id, "object": "model", "created": created, "owned_by": "workflows"}

        @api.get("/v1/models", summary="The served model and the LoRA adapters this replica holds (OpenAI's list)")
        async def list_models(request: Request):
            if (refused := server.guard(request)) is not None:
                return as_openai_error(refused)
            return {"object": "list", "data": [entry(predictor.base_id)] + [entry(m) for m in predictor.adapters]}

        async def generate(request: Request, kind: str):
            if (refused := server.guard(request)) is not None:
                return as_openai_error(refused)
            server.in_flight += 1  # until the answer ends (workflows.serve.drain waits on it): Completion.finish
            handed = False
            try:
                req = await read_json(request, ChatRequest if kind == "chat" else CompletionRequest)
                model_id = predictor.resolve(await pinned(server, req.model))
                header = serve.get_multiplexed_model_id()
                if header and header != (model_id or predictor.base_id) and header != req.model:
                    raise BadRequest(f"the serve_multiplexed_model_id header ({header[:80]}) is not the body's "
                                     f"model ({req.model[:80]})", "model")
                params = SamplingParams(max_tokens=min(self.max_tokens(req), self.gen.max_tokens),
                                        temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                        stop=req.stops(self.gen.max_stop_chars), ignore_eos=req.ignore_eos)
                if kind == "chat":
                    ids = await predictor.encode(predictor.chat_ids, [m.as_template_input() for m in req.messages])
                else:
                    ids = await predictor.encode(predictor.prompt_ids, req.text())
                adapter = None
                if model_id is not None:
                    adapter = await loader(model_id)  # multiplexed: loaded once, least recently used unloaded
                    predictor.using(model_id, +1)
                try:
                    gen = predictor.engine.submit(ids, params, adapter.name if adapter else predictor.served_adapter)
                except BaseException:
                    predictor.using(model_id, -1)
                    raise
                completion = Completion(kind, req.model, gen, server, lambda: predictor.using(model_id, -1),
                                        include_usage=bool(req.stream_options and req.stream_options.include_usage))
                handed = True
            except BadRequest as e:
                if engine is not None:
                    engine.metrics.rejected("invalid_request")
                return error(e.status, str(e), e.param, e.code)
            except ModelNotFound as e:
                return error(404, str(e), "model", "model_not_found")
            except QueueFull as e:
                return error(429, str(e), code="server_busy", headers={"Retry-After": str(e.retry_after_s)})
            except PromptTooLong as e:
                return error(400, str(e), "messages" if kind == "chat" else "prompt", "context_length_exceeded")
            except ValueError as e:  # no chat template, a logit_bias outside the vocabulary
                return error(400, str(e), "messages" if kind == "chat" else "prompt")
            finally:
                if not handed:
                    server.in_flight -= 1
            return completion.stream_response() if req.stream else await completion.json_response()

        @api.post("/v1/chat/completions", summary="Chat completion (OpenAI's API; streams with \"stream\": true)")
        async def chat_completions(request: Request):
            return await generate(request, "chat")

        @api.post("/v1/completions", summary="Text completion (OpenAI's legacy API; streams with \"stream\": true)")
        async def completions(request: Request):
            return await generate(request, "text")

    @staticmethod
    def max_tokens(req: GenerateRequest) -> int:
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        return asked if asked is not None else 2**31


async def pinned(server, model: str) -> str:
    """A request's NAME@ALIAS as the NAME:VERSION the alias holds (an adapter follows its alias)."""
    try:
        return await server.pin(model)
    except Exception as e:  # the registry's UserError: no such model or alias
        raise ModelNotFound(str(e).splitlines()[0]) from None


class Adapters:
    """The multiplexed loader of a replica's LoRA adapters (Ray Serve calls `load` once per model id it
    does not hold, and the returned object's `__del__` when it unloads it)."""

    def __init__(self, server):
        self.server = server

    async def load(self, model_id: str) -> AdapterRef:
        import asyncio

        predictor = self.server.predictor
        loop = asyncio.get_running_loop()
        try:  # the card first: nothing is downloaded for a version this replica cannot serve
            card = await loop.run_in_executor(None, self.server.read_card, model_id)
        except Exception as e:  # the registry's UserError: no such model or version
            raise ModelNotFound(str(e).splitlines()[0]) from None
        # off the loop: a served whole model's base is identified by hashing its weights, once
        await loop.run_in_executor(None, predictor.check_card, model_id, card)
        try:
            model_dir, card = await loop.run_in_executor(None, self.server.fetch_model, model_id)
        except Exception as e:
            raise ModelNotFound(str(e).splitlines()[0]) from None
        await loop.run_in_executor(None, predictor.check_adapter, model_id, model_dir, card)
        try:
            name = await asyncio.wrap_future(predictor.add_adapter(model_id, model_dir))
        except UserError as e:  # load_adapter's refusal: the file and key, never where it lies
            raise ModelNotFound(f"model {model_id} cannot be served as a LoRA adapter: {e}") from None
        return AdapterRef(model_id, name, predictor, loop)


class AdapterRef:
    def __init__(self, model_id: str, name: str, predictor, loop):
        self.model_id, self.name, self._predictor, self._loop = model_id, name, predictor, loop
        self._unloaded = False

    def __del__(self):  # Serve unloads it (from a worker thread), or it is collected
        if self._unloaded:
            return
        self._unloaded = True
        try:
            self._loop.call_soon_threadsafe(self._predictor.retire, self.model_id)
        except RuntimeError:  # the loop is closed: the replica is going away
            pass

"""The chat task's HTTP contract: OpenAI-compatible routes, mounted on the replica's FastAPI app by
`OpenAIContract.add_routes` (workflows.serve.app calls it for any task's contract; this one has no /predict).

GET  /v1/models             the served model (NAME:VERSION) and the adapters this replica holds
GET  /v1/models/{id}        one of those (NAME or NAME:VERSION of the served model), OpenAI's Model object
POST /v1/chat/completions   OpenAI's chat request (workflows.tasks.chat.openai.protocol: every field honoured or a 400)
POST /v1/completions        OpenAI's text completion request ("prompt": text or token ids, one or several)

`"stream": true` answers Server-Sent Events, one `data: {chunk}` per delta in OpenAI's chunk format,
then `data: [DONE]`. Every answer carries `finish_reason` ("stop": end of sequence, a stop string or a
complete grammar; "length": max_tokens or the model's context; "tool_calls"; "timeout":
serve.generate.timeout_s passed, with the text so far) and `usage`. A bad request gets a 4xx with
OpenAI's error body, {"error": {"message", "type", "param", "code"}}: a prompt over
serve.generate.max_prompt_tokens (or the model's context) a 400 with code context_length_exceeded,
before any compute; more than 4 stop strings, or one over serve.generate.max_stop_chars, a 400 naming
`stop`. A full engine queue is a 429 with Retry-After, at once, before the request is planned (requests
being planned count as waiting; serve.generate.timeout_s counts from arrival); an adapter unloaded under
the request, or an engine that has stopped, a 503 with Retry-After; a generation the engine failed a
500 (a stream sends the error as its last event before `data: [DONE]`); a failure to prefill or sample
one request (non-finite logits included) fails it alone. A client that disconnects ends its own
generations only. The bearer token, the drain on shutdown (503 once stopping,
open streams finish) and the request metrics apply as to every route of the app; the engine's own
metrics are workflows.tasks.chat.serving.metrics'.
"""

from __future__ import annotations

import gc
import json
import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import Request  # at module level: FastAPI resolves the routes' string annotations here
from pydantic import BaseModel, ValidationError

from workflows.errors import UserError
from workflows.tasks.chat.engine import EngineStopped, ModelNotFound, PromptTooLong, QueueFull
from workflows.tasks.chat.grammar import GrammarError
from workflows.tasks.chat.openai.plan import chat_plan, text_plan
from workflows.tasks.chat.openai.protocol import BadRequest, ChatRequest, CompletionRequest, Message
from workflows.tasks.chat.openai.streaming import Completion
from workflows.tasks.contract import MAX_BODY_BYTES, HttpContract, register_schema

__all__ = ["BadRequest", "ChatRequest", "CompletionRequest", "Message", "OpenAIContract", "Adapters"]

if TYPE_CHECKING:
    from workflows.config.serve import GenerateConfig

# --- errors -------------------------------------------------------------------------------------------

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


FIELD_PREFIX = re.compile(r"^([a-z_][a-z_0-9.]*): (.*)$", re.S)  # a validator's "field: message"


def validation_error(e: ValidationError) -> BadRequest:
    """Pydantic's first error as a 400 naming the field: the path into the body (union members' type
    tags left out), extended by a validator's own "field: message". Of a union's errors (one per member)
    the deepest: the member the body came closest to (a list of parts whose second is an image)."""
    errors = e.errors()
    err = max((x for x in errors if x["loc"][:1] == errors[0]["loc"][:1]), key=lambda x: len(x["loc"]))
    loc = ".".join(str(p) for i, p in enumerate(err["loc"]) if not _type_tag(p, err["loc"][i - 1] if i else None))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "json_invalid":
        return BadRequest(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if err["type"] == "extra_forbidden":
        return BadRequest(f"{loc}: not a field of OpenAI's API that this server reads", loc)
    if err["type"] == "value_error" and (m := FIELD_PREFIX.match(msg)):
        loc, msg = (f"{loc}.{m[1]}" if loc else m[1]), m[2]
    if not loc:
        return BadRequest(f"the body must be a JSON object: {msg}")
    return BadRequest(f"{loc}: {msg}", loc)


def _type_tag(part, before) -> bool:
    """A union member's tag in pydantic's error location, not a field: a type (str, list[...], a model's
    class name) or a discriminated union's tag (response_format's type, a content part's type)."""
    if not isinstance(part, str):
        return False
    return part in ("str", "int", "float", "bool", "none") or "[" in part or part[:1].isupper() or (
        before == "response_format" or isinstance(before, int)) and part in ("text", "refusal", "json_object",
                                                                            "json_schema")


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
    # json.loads, then the model over Python objects: pydantic's own JSON mode builds each list's items again
    # for a union member or a validator that runs first, and every list is bounded before its items are
    # validated (protocol.bounded). Both run without the garbage collector, which a body of many small objects
    # otherwise sets off again and again over the replica's whole heap. What a body costs so:
    # benchmarks.request_bodies
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        return model.model_validate(json.loads(b"".join(body)))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    except ValidationError as e:
        raise validation_error(e) from None
    finally:
        if gc_was_on:
            gc.enable()


# --- the contract -------------------------------------------------------------------------------------


# the pipeline's demo asks for this too: what `client.chat.completions.parse(response_format=Answer)` sends
# for `class Answer(BaseModel): answer: str`
DEMO_FORMAT: dict[str, Any] = {"name": "Answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "title": "Answer"}}, "required": ["answer"],
    "title": "Answer", "additionalProperties": False}}


class OpenAIContract(HttpContract):
    """OpenAI's chat and text completions; no /predict (`predict_route`)."""

    predict_route = False
    card_route = False  # GET /v1/models/{id} is OpenAI's Model object here
    main_route = "/v1/chat/completions"
    request_model = ChatRequest
    response_model = None

    def __init__(self, card, gen: GenerateConfig):
        self.card, self.gen = card, gen
        self.engine = None  # the replica's engine, once the routes are mounted

    def unhealthy(self) -> str | None:
        """The engine's decode thread has died (a request's tokenizer panicked): nothing can be answered."""
        return self.engine.stopped if self.engine is not None else None

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
        """A streamed chat completion of the instance's `messages`, greedy, and the same asked for as
        JSON in DEMO_SCHEMA (what `chat.completions.parse` sends for a pydantic model with one `answer`
        string): {"text", "finish_reason", "chunks", "json" (the parsed object, or None if the answer was
        cut short), "json_finish_reason"} (the pipeline's requests once it has deployed the model)."""
        import requests

        model = f"{self.card.name}:{self.card.version}"
        structured = requests.post(f"{url}/v1/chat/completions", headers=headers, timeout=60, json={
            "model": model, "messages": instance["messages"], "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": DEMO_FORMAT}})
        structured.raise_for_status()
        answer = structured.json()["choices"][0]
        try:
            parsed = json.loads(answer["message"]["content"])
        except json.JSONDecodeError:  # cut by max_tokens
            parsed = None
        body = {"model": model, "messages": instance["messages"], "temperature": 0, "stream": True}
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
        return "POST /v1/chat/completions (stream; json_schema)", {
            "text": "".join(text), "finish_reason": reason, "chunks": chunks, "json": parsed,
            "json_finish_reason": answer["finish_reason"]}

    def add_routes(self, api, server) -> None:
        from ray import serve

        predictor = server.predictor
        # the model loads now (the replica is healthy once it can answer), its figures go to Prometheus
        engine = self.engine = predictor.start_http() if predictor is not None else None
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

        @api.get("/v1/models/{model_id}", summary="One served model: NAME or NAME:VERSION (OpenAI's Model object)")
        async def get_model(model_id: str, request: Request):
            if (refused := server.guard(request)) is not None:
                return as_openai_error(refused)
            try:
                found = predictor.adapters.resolve(model_id)
            except ModelNotFound as e:
                return error(404, str(e), "model", "model_not_found")
            if found is not None and found not in predictor.adapters:
                return error(404, f"model {model_id[:80]!r} is not served by this replica", "model", "model_not_found")
            return entry(model_id)

        @api.post("/v1/chat/completions", summary="Chat completion (OpenAI's API; streams with \"stream\": true)")
        async def chat_completions(request: Request):
            return await self.generate(request, "chat", server, loader, engine)

        @api.post("/v1/completions", summary="Text completion (OpenAI's legacy API; streams with \"stream\": true)")
        async def completions(request: Request):
            return await self.generate(request, "text", server, loader, engine)

    async def generate(self, request: Request, kind: str, server, loader, engine):
        """One chat ("chat") or text ("text") completion: the body read, admitted by the engine (or a 429),
        planned off the event loop (its grammar compiled in a thread of its own), its adapter loaded
        through Serve's multiplexing (`loader`), its rows submitted to the engine, and the answer handed to
        a Completion (which ends the request's count in flight and of its adapter)."""
        from ray import serve

        arrived = time.perf_counter()  # the request's deadline counts from here
        if (refused := server.guard(request)) is not None:
            return as_openai_error(refused)
        predictor = server.predictor
        server.in_flight += 1  # until the answer ends (workflows.serve.drain waits on it): Completion.finish
        handed = admitted = False
        try:
            req = await read_json(request, ChatRequest if kind == "chat" else CompletionRequest)
            model_id = predictor.adapters.resolve(await pinned(server, req.model))
            header = serve.get_multiplexed_model_id()
            if header and header != (model_id or predictor.base_id) and header != req.model:
                raise BadRequest(f"the serve_multiplexed_model_id header ({header[:80]}) is not the body's "
                                 f"model ({req.model[:80]})", "model")
            predictor.engine.admit()  # QueueFull at capacity, before any planning
            admitted = True
            planner = chat_plan if kind == "chat" else text_plan
            plan = await predictor.prompts.encode(lambda r: planner(predictor.prompts, r, self.gen), req)
            if plan.grammar is not None:
                constraints = await predictor.prompts.constraints(*plan.grammar, len(plan.params))
                plan.params = [replace(p, constraint=c) for p, c in zip(plan.params, constraints)]
            adapter = None
            if model_id is not None:
                adapter = await loader(model_id)  # multiplexed: loaded once, least recently used unloaded
                predictor.adapters.using(model_id, +1)
            gens: list = []
            try:
                n = plan.shape.choices_per_prompt
                for i, params in enumerate(plan.params):
                    first, admitted = admitted, False  # the first submit ends the admission's count
                    gens.append(predictor.engine.submit(plan.prompts[i // n], params,
                                                        adapter.name if adapter else predictor.served_adapter,
                                                        arrived=arrived, admitted=first))
            except BaseException:
                for g in gens:
                    g.cancel()
                predictor.adapters.using(model_id, -1)
                raise
            completion = Completion(kind, req.model, gens, server, lambda: predictor.adapters.using(model_id, -1),
                                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                                    shape=plan.shape)
            handed = True
        except (BadRequest, GrammarError) as e:
            if engine is not None:
                engine.metrics.rejected("invalid_request")
            return error(getattr(e, "status", 400), str(e), e.param, getattr(e, "code", None))
        except ModelNotFound as e:
            return error(404, str(e), "model", "model_not_found")
        except QueueFull as e:
            return error(429, str(e), code="server_busy", headers={"Retry-After": str(e.retry_after_s)})
        except EngineStopped as e:  # the decode thread died: the health check restarts the replica
            return error(503, str(e), code="engine_stopped", headers={"Retry-After": "5"})
        except PromptTooLong as e:
            return error(400, str(e), "messages" if kind == "chat" else "prompt", "context_length_exceeded")
        except ValueError as e:  # no chat template, a logit_bias outside the vocabulary
            return error(400, str(e), "messages" if kind == "chat" else "prompt")
        finally:
            if admitted:
                predictor.engine.release()
            if not handed:
                server.in_flight -= 1
        return completion.stream_response() if req.stream else await completion.json_response()


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
        self._missing: dict[str, tuple[str, float]] = {}  # model id -> (why it cannot be read, when): kept briefly

    async def load(self, model_id: str) -> AdapterRef:
        import asyncio

        predictor = self.server.predictor
        loop = asyncio.get_running_loop()
        missing = self._missing.get(model_id)
        if missing is not None and time.monotonic() - missing[1] < self.server.cfg.serve.alias_poll_s:
            raise ModelNotFound(missing[0])  # a client repeating an unknown version costs no registry read
        try:  # the card first: nothing is downloaded for a version this replica cannot serve
            card = await loop.run_in_executor(None, self.server.read_card, model_id)
        except Exception as e:  # the registry's UserError: no such model or version
            if len(self._missing) >= 1024:
                self._missing.pop(next(iter(self._missing)))
            self._missing[model_id] = (str(e).splitlines()[0], time.monotonic())
            raise ModelNotFound(self._missing[model_id][0]) from None
        # off the loop: a served whole model's base is identified by hashing its weights, once
        await loop.run_in_executor(None, predictor.adapters.check_card, model_id, card)
        try:
            model_dir, card = await loop.run_in_executor(None, self.server.fetch_model, model_id)
        except Exception as e:
            raise ModelNotFound(str(e).splitlines()[0]) from None
        await loop.run_in_executor(None, predictor.adapters.check_files, model_id, model_dir, card)
        try:
            name = await asyncio.wrap_future(predictor.adapters.add(model_id, model_dir))
        except UserError as e:  # load_adapter's refusal: the file and key, never where it lies
            raise ModelNotFound(f"model {model_id} cannot be served as a LoRA adapter: {e}") from None
        return AdapterRef(model_id, name, predictor.adapters, loop)


class AdapterRef:
    def __init__(self, model_id: str, name: str, adapters, loop):
        self.model_id, self.name, self._adapters, self._loop = model_id, name, adapters, loop
        self._unloaded = False

    def __del__(self):  # Serve unloads it (from a worker thread), or it is collected
        if self._unloaded:
            return
        self._unloaded = True
        try:
            self._loop.call_soon_threadsafe(self._adapters.retire, self.model_id)
        except RuntimeError:  # the loop is closed: the replica is going away
            pass

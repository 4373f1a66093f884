"""The HTTP contract of a served model: pydantic request and response models built from its card,
declared in the OpenAPI document (/openapi.json, /docs) with every error the app answers.

A task's `http_contract` (an `HttpContract`, which a task's `http_contract` returns) validates a JSON body with the very
request model the document declares (`request_model.model_validate_json`: one validation path, so a
request the schema accepts is never rejected and one it rejects is never answered outside the
declared statuses), and `rejection` turns pydantic's first error into the one-line {"error": ...}
answer: 400 for bad JSON, 422 naming the bad field, a list over maxItems included (the schema's own
rule: 422 as any other violation of it, where a hand-written check once answered 413). 413 is left
for a body over the byte limit, which no JSON schema states. FastAPI's body parameter would do the
same validation, but the image route takes three content types in one operation (JSON, a raw image,
multipart), which it cannot; its RequestValidationError answers go through `rejection` too
(workflows.serve.api). `JsonInstances` is the contract of every task whose instances are JSON objects
(a text classifier's instance model: workflows.tasks.text.contract).
"""

from __future__ import annotations

import json
import re
from types import GenericAlias
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model


class HttpContract:
    """How a served model's POST /predict body becomes instances, and its OpenAPI models.

    `parse(content_type, body)` returns the instances (dicts handed to Predictor.predict), or an
    (HTTP status, one-line message) tuple for a body that is not a valid request."""

    request_model: Any  # pydantic model of the JSON body
    response_model: Any
    errors: tuple[int, ...] = (400, 401, 413, 422, 431, 503)  # the statuses POST /predict can answer
    predict_route: bool = True  # whether the app serves POST /predict with this contract
    card_route: bool = True  # whether the app serves GET /v1/models/NAME (the card) or the contract its own
    main_route: str = "/predict"  # the route a user calls first (the pipeline prints its URL)

    def add_routes(self, api, server) -> None:
        """Mount the task's own routes on the replica's FastAPI app `api` (default: none), streaming
        responses included; the app's request guard (header limits, metrics) wraps them as every route.
        `server` is the replica (workflows.serve.app.ModelServer); a route may use:
        `server.guard(request)` (None, or the 401/503 answer that every route gives first: bearer
        token, shutting down), `server.in_flight` (add 1 while a request is answered, streams until
        their last byte: the drain waits for it to reach 0), `server.predictor` (the task's predictor),
        `server.card`, and `server.fetch_model(spec)` (another registered version's local directory
        and card, blocking: call it off the event loop)."""

    def unhealthy(self) -> str | None:
        """Why the replica can no longer answer (its /healthz a 503, and Ray Serve's health check fails, so
        Serve replaces it), or None."""
        return None

    def parse(self, content_type: str | None, body: bytes) -> list[dict] | tuple[int, str]:
        raise NotImplementedError

    def openapi(self, document: dict, path: str) -> dict:
        """Declare the request body of POST `path` in a FastAPI-generated OpenAPI document."""
        raise NotImplementedError

    def example(self) -> dict:
        """One request body the /docs page shows."""
        raise NotImplementedError

    def demo(self, url: str, instance: dict, headers: dict) -> tuple[str, dict]:
        """One request the pipeline sends once the model is deployed: (the route, the prediction).
        Default: POST /predict with the instance."""
        import requests

        resp = requests.post(f"{url}/predict", json={"instances": [instance]}, headers=headers, timeout=60)
        resp.raise_for_status()
        return "POST /predict", resp.json()["predictions"][0]


MAX_BODY_BYTES = 1 << 20


class ErrorResponse(BaseModel):
    error: str = Field(..., description="what was wrong with the request, in one line")


# Every error the predict route can answer, each {"error": ...}.
ERRORS = {
    400: "the body is not valid JSON",
    401: "missing or wrong bearer token (when serve.auth_token_env is set)",
    413: "the body is over 1 MiB",
    415: "the Content-Type is not one the route accepts (the answer lists those it does)",
    422: "the body is JSON, but not an object {\"instances\": [...]} of valid instances (no more than "
         "serve.max_instances, the request's maxItems)",
    431: "request headers too large or too many",
    503: "the server is shutting down (it answers the requests it holds, then stops)",
}


def classification_prediction(labels: list[str]) -> type[BaseModel]:
    """One prediction of a classifier: the label, its probability, every label's probability."""
    # types built at run time: Any to mypy (GenericAlias(dict, ...) is dict[label, float])
    label: Any = Literal[tuple(labels)]  # type: ignore[valid-type]
    probabilities: Any = GenericAlias(dict, (label, float))
    return create_model(
        "Prediction",
        label=(label, Field(..., description="the most probable label")),
        score=(float, Field(..., ge=0, le=1, description="its probability")),
        probabilities=(probabilities, Field(..., description="every label's probability")),
    )


def response_model(card, prediction: type[BaseModel]) -> type[BaseModel]:
    """The body of a 200 answer: one prediction per instance, the model's name and version."""
    predictions: Any = GenericAlias(list, prediction)  # list[prediction]
    name: Any = Literal[card.name]  # type: ignore[valid-type]
    return create_model(
        "PredictResponse",
        predictions=(predictions, Field(..., description="one per instance, in order")),
        model=(name, ...),
        version=(int, Field(..., ge=1)),
    )


def request_model(instance: type[BaseModel], max_instances: int, example: dict) -> type[BaseModel]:
    instances: Any = GenericAlias(list, instance)  # list[instance]
    return create_model(
        "PredictRequest",
        __config__=ConfigDict(extra="forbid", json_schema_extra={"examples": [{"instances": [example]}]}),
        instances=(instances, Field(..., min_length=1, max_length=max_instances)),
    )


class JsonInstances(HttpContract):
    """POST /predict {"instances": [{...}, ...]}: each instance validated by a pydantic model, handed
    to the predictor as its dict by alias (the JSON keys)."""

    def __init__(self, instance: type[BaseModel], prediction: type[BaseModel], card, max_instances: int,
                 example: dict, max_body_bytes: int = MAX_BODY_BYTES):
        self.instance, self.max_instances, self.max_body_bytes = instance, max_instances, max_body_bytes
        self._example = example
        self.request_model = request_model(instance, max_instances, example)
        self.response_model = response_model(card, prediction)

    def example(self) -> dict:
        return {"instances": [self._example]}

    def parse(self, content_type: str | None, body: bytes) -> list[dict] | tuple[int, str]:
        if len(body) > self.max_body_bytes:
            return 413, f"request body is {len(body)} bytes; the limit is {self.max_body_bytes}"
        try:
            request = self.request_model.model_validate_json(body)
        except ValidationError as e:
            return rejection(e)
        # by alias: a column whose name is no Python identifier ("sepal length") is a field with an alias
        return [inst.model_dump(by_alias=True) for inst in request.instances]

    def openapi(self, document: dict, path: str) -> dict:
        return with_request_body(document, path, self.request_model)


# --- one-line answers for what the request model rejects -------------------------------------------

MAX_ECHO_CHARS = 60  # of a key, field name or filename quoted in a message
ENVELOPE = '(the body is {"instances": [...]})'


def json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    kinds: dict[type, str] = {dict: "an object", list: "an array", str: "a string"}
    return kinds.get(type(value), type(value).__name__)


def quote(text: str) -> str:
    """`text` as a short one-line JSON string (escapes control characters and line separators)."""
    cut = text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS] + "..."
    return json.dumps(cut)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def loc_path(prefix: str, loc: tuple) -> str:
    """A pydantic error location as the path a client reads: instances[2].image["a b"]."""
    out = prefix
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _IDENT.fullmatch(p) and len(p) <= MAX_ECHO_CHARS:
            out += f".{p}"
        else:
            out += f"[{quote(p)}]"
    return out


def rejection(e: ValidationError) -> tuple[int, str]:
    """(status, one-line message) for a body a request model {"instances": [...]} rejected: its first
    error, a list over maxItems or an unknown key of the body before the others (a misspelt
    "instances" is reported as itself, not as "instances" missing)."""

    def rank(err) -> int:
        return 0 if err["type"] == "too_long" else 1 if err["type"] == "extra_forbidden" and len(err["loc"]) == 1 else 2

    err = min(e.errors(), key=rank)  # min keeps pydantic's order among equals
    kind, loc = err["type"], tuple(err["loc"])
    if kind == "json_invalid":
        return 400, f"body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}"
    if loc == ():
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return 422, f'body must be an object {{"instances": [...]}}, not {json_kind(err["input"])}'
        return 422, f"body: {err['msg']}"
    if loc == ("instances",):
        if kind == "too_long":
            return 422, f"{err['ctx']['actual_length']} instances; at most {err['ctx']['max_length']} per request"
        if kind in ("too_short", "list_type"):
            return 422, '"instances" must be a non-empty list'
    if len(loc) == 1:  # a key of the body: missing "instances", or another one
        return 422, f"{loc_path('body', loc)}: {err['msg']} {ENVELOPE}"
    msg = err["msg"]
    if kind in ("model_type", "model_attributes_type", "dict_type"):  # pydantic's message names our classes
        msg = f"must be an object, not {json_kind(err['input'])}"
    elif kind == "value_error":  # a model validator's ValueError: its own words
        msg = str(err.get("ctx", {}).get("error", msg))
    return 422, f"{loc_path(f'instances[{loc[1]}]', loc[2:])}: {msg}"


def error_responses(*codes: int) -> dict[int | str, dict]:
    return {code: {"model": ErrorResponse, "description": ERRORS[code]} for code in codes}


def register_schema(openapi: dict, model: type[BaseModel]) -> tuple[str, dict]:
    """Add `model`'s JSON schema (and the models it uses) to the document's components; its $ref and schema."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components = openapi.setdefault("components", {}).setdefault("schemas", {})
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return f"#/components/schemas/{model.__name__}", schema


def with_request_body(openapi: dict, path: str, model: type[BaseModel]) -> dict:
    """Declare `model` as the JSON body of POST `path` in a FastAPI-generated OpenAPI document."""
    ref, schema = register_schema(openapi, model)
    op = openapi["paths"][path]["post"]
    op["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": ref}, "example": schema["examples"][0]}},
    }
    return openapi

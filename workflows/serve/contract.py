"""The HTTP contract of a served model: pydantic request and response models built from its card,
declared in the OpenAPI document (/openapi.json, /docs) with every error the app answers.

A task's `http_contract` (workflows.tasks.base.HttpContract) parses and validates bodies itself:
its status codes and messages (400 for bad JSON, 413 for too many instances, 422 naming the bad
field) are part of the contract too, and FastAPI's own body validation would answer 422 with
another shape. `JsonInstances` is the contract of every task whose instances are JSON objects.
"""

from __future__ import annotations

import json
from types import GenericAlias
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from workflows.tasks.base import HttpContract

MAX_TEXT_CHARS = 100_000
MAX_BODY_BYTES = 1 << 20


class ErrorResponse(BaseModel):
    error: str = Field(..., description="what was wrong with the request, in one line")


# Every error the predict route can answer, each {"error": ...}.
ERRORS = {
    400: "the body is not valid JSON",
    401: "missing or wrong bearer token (when serve.auth_token_env is set)",
    413: "the body is over 1 MiB, or more instances than serve.max_instances",
    415: "the Content-Type is not one the route accepts (the answer lists those it does)",
    422: "the body is JSON, but not an object {\"instances\": [...]} of valid instances",
    431: "request headers too large or too many",
    503: "the server is shutting down (it answers the requests it holds, then stops)",
}


def instance_model(text_columns: list[str]) -> type[BaseModel]:
    """One instance: the model's text columns, strings, nothing else; not all of them blank."""
    fields: dict[str, Any] = {c: (str, Field(..., max_length=MAX_TEXT_CHARS)) for c in text_columns}

    def not_all_empty(self):
        if not any(str(getattr(self, c)).strip() for c in text_columns):
            raise ValueError(f"all text fields are empty ({', '.join(text_columns)})")
        return self

    validators: dict[str, Any] = {"not_all_empty": model_validator(mode="after")(not_all_empty)}
    return create_model("Instance", __config__=ConfigDict(extra="forbid", strict=True), __validators__=validators,
                        **fields)


def example_instance(text_columns: list[str]) -> dict[str, str]:
    return {c: "Return the mean of the array elements along the given axis." for c in text_columns}


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


def predict_models(card, max_instances: int) -> tuple[type[BaseModel], type[BaseModel]]:
    """(PredictRequest, PredictResponse) of a text classifier `card` describes."""
    request = request_model(instance_model(card.text_columns), max_instances, example_instance(card.text_columns))
    return request, response_model(card, classification_prediction(card.labels))


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
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            return 400, f"body is not valid JSON: {e}"
        except RecursionError:
            return 400, "body is not valid JSON: nested too deeply"
        if not isinstance(payload, dict) or set(payload) != {"instances"}:
            return 422, 'body must be an object with exactly one key, "instances"'
        instances = payload["instances"]
        if not isinstance(instances, list) or not instances:
            return 422, '"instances" must be a non-empty list'
        if len(instances) > self.max_instances:
            return 413, f"{len(instances)} instances; at most {self.max_instances} per request"
        rows = []
        for i, inst in enumerate(instances):
            try:
                # by alias: a column whose name is no Python identifier ("sepal length") is a field with an alias
                rows.append(self.instance.model_validate(inst).model_dump(by_alias=True))
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                return 422, f"instances[{i}]{'.' + where if where else ''}: {err['msg']}"
        return rows

    def openapi(self, document: dict, path: str) -> dict:
        return with_request_body(document, path, self.request_model)


def text_contract(card, max_instances: int) -> JsonInstances:
    return JsonInstances(instance_model(card.text_columns), classification_prediction(card.labels), card,
                         max_instances, example_instance(card.text_columns))


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

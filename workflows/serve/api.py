"""The replica's FastAPI app: its routes, which call the replica (workflows.serve.app.ModelServer),
behind the guards of workflows.serve.guards, and the OpenAPI document of the served model's typed
contract (workflows.tasks.contract).

POST /predict  {"instances": [{...}]} -> {"predictions": [{...}], "model", "version"}: the instances and
               predictions of the model's task (text: {<text columns>} -> {"label", "score",
               "probabilities"}; images also take a raw image body or multipart files)
GET  /healthz  GET /v1/models/<name>  (and FastAPI's /docs, /openapi.json); with a bearer token set,
every route but /healthz requires it (guards.TokenGuard). A task's contract may mount routes of its
own and go without /predict (`HttpContract.add_routes`, `predict_route`): the chat task's
OpenAI-compatible /v1/chat/completions, /v1/completions, /v1/models.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` annotation.
import asyncio
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve

from workflows.serve.drain import watch
from workflows.serve.guards import RequestGuard, TokenGuard, error_response
from workflows.tasks.contract import ErrorResponse, error_responses, loc_path

if TYPE_CHECKING:
    from workflows.serve.app import ModelServer

# What GET /v1/models/NAME answers of the served model's card.
CARD_FIELDS = ("name", "version", "task", "labels", "text_columns", "image_size", "metrics", "lineage",
               "registered_at")


def build_api(server: "ModelServer") -> FastAPI:
    """The replica's FastAPI app: routes that call `server`, the model's typed contract in OpenAPI."""
    card, contract = server.card, server.contract
    @asynccontextmanager
    async def lifespan(_):
        task = asyncio.create_task(watch(server, serve.get_replica_context().replica_id.unique_id))
        yield
        task.cancel()

    what = f"labels {', '.join(card.labels)}" if card.labels else card.task  # a regression has no labels
    api = FastAPI(title=f"workflows model server: {card.name} v{card.version}", lifespan=lifespan,
                  description=f"Predictions of registered model {card.name}:{card.version} ({what}).")
    api.add_middleware(TokenGuard, server=server, api=api)
    api.add_middleware(RequestGuard)  # outside the token's check: its 401s are counted and timed too

    @api.exception_handler(RequestValidationError)
    async def one_line(_, exc: RequestValidationError) -> JSONResponse:
        # what FastAPI validates itself (parameters): the one-line {"error": ...} of every other 4xx,
        # not its {"detail": [...]}; bodies are validated by the contract (workflows.tasks.contract)
        err = exc.errors()[0]
        loc = tuple(err.get("loc") or ())
        return error_response(422, f"{loc_path(str(loc[0]), loc[1:]) if loc else 'request'}: {err['msg']}")

    if contract.predict_route:
        @api.post("/predict", response_class=JSONResponse, summary="Predict for instances (one prediction each)",
                  responses={200: {"model": contract.response_model, "description": "one prediction per instance"},
                             **error_responses(*contract.errors)})
        async def predict(request: Request):
            return await server.predict(request)

    @api.get("/healthz", summary="Readiness: the model is loaded and answering, and the server is not stopping",
             responses=error_responses(503))
    async def healthz():
        if server.stopping:
            return server.stopping_response()
        if (why := contract.unhealthy()) is not None:
            return error_response(503, why)
        return {"status": "ok", "model": card.name, "version": card.version}

    if contract.card_route:
        @api.get("/v1/models/{name}", summary="The served model's card: labels, columns, metrics, lineage",
                 responses={404: {"model": ErrorResponse, "description": "another model's name"},
                            **error_responses(401, 431)})
        async def model_info(name: str = PathParam(
                description="the served model's name (any other is a 404)", json_schema_extra={"enum": [card.name]})):
            if name != card.name:
                return error_response(404, f"model {name!r} is not served here")
            return {k: getattr(card, k) for k in CARD_FIELDS}

    contract.add_routes(api, server)  # a task's own routes (the chat task's OpenAI API)
    generated = api.openapi

    def openapi() -> dict:
        if api.openapi_schema is None:
            api.openapi_schema = contract.openapi(generated(), "/predict")
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
    return api

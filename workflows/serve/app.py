"""Ray Serve application: FastAPI ingress, dynamic batching, the shared predictor.

POST /predict  {"instances": [{...}]} -> {"predictions": [{...}], "model", "version"}: the instances and
               predictions of the model's task (text: {<text columns>} -> {"label", "score",
               "probabilities"}; images also take a raw image body or multipart files)
GET  /healthz  GET /v1/models/<name>  (and FastAPI's /docs, /openapi.json: the typed contract of
workflows.tasks.contract); with a bearer token set, every route but /healthz requires it (TokenGuard)
A task's contract may mount routes of its own and go without /predict (`HttpContract.add_routes`,
`predict_route`): the chat task's OpenAI-compatible /v1/chat/completions, /v1/completions, /v1/models.

Each replica builds its FastAPI app after loading the model (`__serve_build_asgi_app__`), so the
OpenAPI document declares that model's request and response models.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` annotation.
import asyncio
import hmac
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.routing import Match

from workflows import registry
from workflows.cluster_scoped import per_cluster
from workflows.config import WorkflowConfig, load_config
from workflows.console import say
from workflows.errors import UserError
from workflows.serve import ingress
from workflows.serve.drain import watch
from workflows.serve.stale_ingress import free_before_serve_starts
from workflows.storage.embedded import running_endpoint
from workflows.storage.uri import StorageContext
from workflows.tasks import check_task, task_for_card
from workflows.tasks.contract import MAX_BODY_BYTES, ErrorResponse, error_responses, loc_path

log = logging.getLogger(__name__)

# Ray Serve metrics (Prometheus, through Ray's metrics agent; docs/OBSERVABILITY.md). Created on
# first use inside a replica, so Serve adds its deployment/replica/application tags.
LATENCY_MS_BOUNDARIES = [1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000]
BATCH_SIZE_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


@per_cluster  # a replica lives in one cluster; an in-process app (tests) may see two
def serve_metrics() -> dict:
    from ray.serve import metrics

    tags = ("endpoint", "status")
    return {
        "requests": metrics.Counter(
            "workflows_serve_requests", description="HTTP requests by endpoint and status code", tag_keys=tags),
        "latency_ms": metrics.Histogram(
            "workflows_serve_request_latency_ms", description="HTTP request latency in the replica (ms)",
            boundaries=LATENCY_MS_BOUNDARIES, tag_keys=tags),
        "batch_size": metrics.Histogram(
            "workflows_serve_batch_size", description="instances per batched model call",
            boundaries=BATCH_SIZE_BOUNDARIES),
    }


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message}, headers=headers)


# Serve's HTTP proxy sets no limit on request headers; these are what common front proxies allow.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100


class RequestGuard:
    """Plain ASGI middleware (Starlette's @app.middleware("http") costs a task and a stream copy per
    request): requests with too many or too large headers get 431; every other request is counted
    and timed, tagged with its route template (e.g. /predict, /v1/models/{name}; "other" when no
    route matched) and its HTTP status ("500" if it raised)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        size = sum(len(k) + len(v) for k, v in headers)
        if len(headers) > MAX_HEADERS or size > MAX_HEADER_BYTES:
            return await _error(431, f"request headers too large: {len(headers)} headers, {size} bytes "
                                     f"(limits {MAX_HEADERS}, {MAX_HEADER_BYTES})")(scope, receive, send)
        t0, status = time.perf_counter(), "500"

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            tags = {"endpoint": getattr(route, "path", None) or "other", "status": status}
            m = serve_metrics()
            m["requests"].inc(1, tags=tags)
            m["latency_ms"].observe((time.perf_counter() - t0) * 1000, tags=tags)


# The one route answered without the token: readiness probes (Kubernetes, load balancers) call it
# without credentials, and it says only that the model is up, with its name and version.
OPEN_ROUTES = ("/healthz",)


class TokenGuard:
    """With a bearer token set, every request needs it before any route runs: /predict, the model's
    card, and FastAPI's /openapi.json, /docs and /redoc too, whose document lists the labels that
    /v1/models/NAME answers only with the token (a route added later is covered too). Only
    OPEN_ROUTES, as the app's router matches them, are answered without it."""

    def __init__(self, app, server: "ModelServer", api: FastAPI):
        self.app, self.server, self.api = app, server, api

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.server.token is not None and not self._open(scope):
            denied = self.server._denied(Request(scope))
            if denied is not None:
                return await denied(scope, receive, send)
        return await self.app(scope, receive, send)

    def _open(self, scope) -> bool:
        return any(getattr(r, "path", None) in OPEN_ROUTES and r.matches(scope)[0] == Match.FULL
                   for r in self.api.router.routes)


def bearer_token(sc) -> str | None:
    """The token requests must carry, read from the environment variable the config names."""
    if not sc.auth_token_env:
        return None
    token = os.environ.get(sc.auth_token_env, "")
    if not token:
        raise RuntimeError(
            f"serve.auth_token_env names {sc.auth_token_env}, which is not set in the replica's environment"
        )
    return token


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
        return _error(422, f"{loc_path(str(loc[0]), loc[1:]) if loc else 'request'}: {err['msg']}")

    if contract.predict_route:
        @api.post("/predict", response_class=JSONResponse, summary="Predict for instances (one prediction each)",
                  responses={200: {"model": contract.response_model, "description": "one prediction per instance"},
                             **error_responses(*contract.errors)})
        async def predict(request: Request):
            return await server.predict(request)

    @api.get("/healthz", summary="Readiness: the model is loaded and the server is not stopping",
             responses=error_responses(503))
    async def healthz():
        if server.stopping:
            return server.stopping_response()
        return {"status": "ok", "model": card.name, "version": card.version}

    if contract.card_route:
        @api.get("/v1/models/{name}", summary="The served model's card: labels, columns, metrics, lineage",
                 responses={404: {"model": ErrorResponse, "description": "another model's name"},
                            **error_responses(401, 431)})
        async def model_info(name: str = PathParam(
                description="the served model's name (any other is a 404)", json_schema_extra={"enum": [card.name]})):
            if name != card.name:
                return _error(404, f"model {name!r} is not served here")
            keep = ("name", "version", "task", "labels", "text_columns", "image_size", "metrics", "lineage",
                    "registered_at")
            return {k: getattr(card, k) for k in keep}

    contract.add_routes(api, server)  # a task's own routes (the chat task's OpenAI API)
    generated = api.openapi

    def openapi() -> dict:
        if api.openapi_schema is None:
            api.openapi_schema = contract.openapi(generated(), "/predict")
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
    return api


@serve.deployment
@serve.ingress()
class ModelServer:
    def __init__(self, cfg: dict, model_spec: str, served_as: str | None = None):
        """`model_spec`: the version to load (NAME:VERSION); `served_as`: the NAME@ALIAS it is served
        for, when an alias chose it (`workflows serve` rolls the application over when the alias moves)."""
        self.cfg = WorkflowConfig.model_validate(cfg)
        self.served_as = served_as
        self._pins: dict[str, tuple[str, float]] = {}  # NAME@ALIAS -> (NAME:VERSION, when read): `pin`
        self.storage = storage = StorageContext.from_config(self.cfg.storage)
        model_dir, _ = registry.fetch(self.cfg, storage, model_spec)
        self.card = registry.model_card(self.cfg, storage, model_spec)  # with evaluation metrics
        task = task_for_card(self.cfg, self.card)
        self.predictor = task.predictor(model_dir, self.card, threads=max(1, int(self.cfg.serve.cpus_per_replica)),
                                        precision=self.cfg.serve.precision)
        self.token = bearer_token(self.cfg.serve)
        self.contract = task.http_contract(self.card, self.cfg.serve.max_instances)
        self._predict_batch.set_max_batch_size(self.cfg.serve.max_batch_size)
        self._predict_batch.set_batch_wait_timeout_s(self.cfg.serve.batch_wait_timeout_s)
        self.stopping, self.in_flight = False, 0  # workflows.serve.drain
        # one thread: batches run one at a time, as @serve.batch hands them out
        self._model_thread = ThreadPoolExecutor(1, "model") if self.cfg.serve.model_in_thread else None
        # A contract that decodes (images) parses here, never on the event loop, which must keep answering
        # (/healthz included); a thread per CPU of the replica bounds the decoding at once. Pillow decodes
        # without the GIL.
        self.max_body_bytes = getattr(self.contract, "max_body_bytes", MAX_BODY_BYTES)
        self._parse_threads = (ThreadPoolExecutor(max(1, int(self.cfg.serve.cpus_per_replica)), "parse")
                               if getattr(self.contract, "off_loop", False) else None)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.0)  # both set from the config in __init__
    async def _predict_batch(self, rows: list[dict]) -> list[dict]:
        serve_metrics()["batch_size"].observe(len(rows))
        if self._model_thread is None:
            return self.predictor.predict(rows)
        # torch releases the GIL: the loop parses and queues the next requests meanwhile
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, self.predictor.predict, rows)

    def _denied(self, request: Request) -> JSONResponse | None:
        if self.token is None:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), self.token.encode()):
            return _error(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        return None

    def guard(self, request: Request) -> JSONResponse | None:
        """What a task's own route answers first, if anything: 503 while stopping, 401 without the token."""
        return self.stopping_response() if self.stopping else self._denied(request)

    def fetch_model(self, spec: str) -> tuple[str, Any]:
        """Another registered version (a task's adapter): its local directory and card. Blocking;
        a UserError that names the model only (`_unseen`)."""
        with _unseen(spec):
            return registry.fetch(self.cfg, self.storage, spec)

    def read_card(self, spec: str) -> Any:
        """Another registered version's card alone (one small read, nothing downloaded). Blocking;
        a UserError that names the model only (`_unseen`)."""
        with _unseen(spec):
            return registry.read_card(registry.resolve(self.cfg, self.storage, spec), self.storage)

    async def pin(self, model: str) -> str:
        """A request's model NAME@ALIAS as the NAME:VERSION the alias holds (read from the registry at
        most once per serve.alias_poll_s; a task's adapter follows its alias so); the alias this
        replica was deployed for is its own version until the rollover replaces it; anything else as
        it is. UserError for an alias that is not set."""
        if "@" not in model:
            return model
        if model == self.served_as:
            return f"{self.card.name}:{self.card.version}"
        hit = self._pins.get(model)
        if hit is not None and time.monotonic() - hit[1] < self.cfg.serve.alias_poll_s:
            return hit[0]
        ref = await asyncio.get_running_loop().run_in_executor(None, registry.resolve, self.cfg, self.storage, model)
        pinned = f"{ref.name}:{ref.version}"
        self._pins[model] = (pinned, time.monotonic())
        return pinned

    def stopping_response(self) -> JSONResponse:
        # Connection: close makes the client drop its keep-alive connection before the proxy goes.
        return _error(503, "the server is shutting down", {"Connection": "close", "Retry-After": "5"})

    async def predict(self, request: Request) -> JSONResponse:
        if self.stopping:
            return self.stopping_response()
        self.in_flight += 1
        try:  # the bearer token was checked before (TokenGuard)
            body = await read_body(request, self.max_body_bytes)
            if isinstance(body, JSONResponse):
                return body
            content_type = request.headers.get("content-type")
            if self._parse_threads is None:
                rows = self.contract.parse(content_type, body)
            else:
                rows = await asyncio.get_running_loop().run_in_executor(
                    self._parse_threads, self.contract.parse, content_type, body)
            if isinstance(rows, tuple):  # (status, message): not a valid request
                return _error(*rows)
            predictions = await asyncio.gather(*(self._predict_batch(r) for r in rows))
            return JSONResponse({"predictions": predictions, "model": self.card.name, "version": self.card.version})
        finally:
            self.in_flight -= 1


@contextmanager
def _unseen(spec: str):
    """A failure to read a registered version, as a client is told of it: the model named, never where
    the registry or the node's cache is (the registry's own message goes to the replica's log)."""
    try:
        yield
    except registry.NotRegistered as e:
        raise UserError(e.public) from None
    except Exception as e:  # the registry's UserError, or the store's or the disk's own error
        log.warning("model %s cannot be read from the registry: %s: %s", spec[:200], type(e).__name__, e)
        raise UserError(f"model {spec[:200]} cannot be read from the registry") from None


async def read_body(request: Request, limit: int) -> bytes | JSONResponse:
    """The body, or a 413 once it is over `limit` bytes: from Content-Length before anything is read
    (a 16 MiB upload is refused without receiving it), else while it streams in (chunked)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return _error(413, f"request body is {int(declared)} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return _error(413, f"request body is over {limit} bytes (at least {size}); the limit is {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def deployment_options(cfg: WorkflowConfig) -> dict:
    """Replica count or autoscaling, resources, how many requests a replica takes at once, and what its
    task adds (`Task.serve_options`: a generative model's admission)."""
    from workflows.tasks import task_class

    sc = cfg.serve
    opts: dict[str, Any] = {
        "ray_actor_options": {
            "num_cpus": sc.cpus_per_replica,
            **({"num_gpus": sc.gpus_per_replica} if sc.gpus_per_replica else {}),
        },
        # Serve's default of 5 ongoing requests would silently cap batches below max_batch_size.
        "max_ongoing_requests": max(2 * sc.max_batch_size, 32),
        "logging_config": logging_config(sc),
    }
    if sc.autoscaling is not None:
        opts["autoscaling_config"] = sc.autoscaling.model_dump()
    else:
        opts["num_replicas"] = sc.num_replicas
    opts.update(task_class(cfg.model.task)(cfg).serve_options())
    return opts


def logging_config(sc) -> dict:
    """Serve's logging for the replicas and (through serve.start) the proxy."""
    return {"enable_access_log": sc.access_log}


def application(cfg: WorkflowConfig, model_spec: str, served_as: str | None = None) -> serve.Application:
    deployment: Any = ModelServer  # a serve.Deployment (@serve.deployment), which mypy sees as the plain class
    return deployment.options(**deployment_options(cfg)).bind(cfg.model_dump(mode="json"), model_spec, served_as)


def build_app(args: dict) -> serve.Application:
    """Application builder for Serve config files (`serve run`, RayService `import_path`).

    args: config (a workflow YAML path), model (NAME[:VERSION] or NAME@ALIAS: the version the alias
    holds when the application is built), set (optional list of overrides).
    """
    cfg = _with_store_endpoint(check_task(load_config(args.get("config") or "quickstart", list(args.get("set") or []))))
    spec = str(args["model"])
    if "@" not in spec:
        return application(cfg, spec)
    ref = registry.resolve(cfg, StorageContext.from_config(cfg.storage), spec)
    return application(cfg, f"{ref.name}:{ref.version}", served_as=spec)


def _with_store_endpoint(cfg: WorkflowConfig) -> WorkflowConfig:
    """A config file names no embedded endpoint (it lives as long as the process that runs it):
    use the one running for the config's data_dir, or say what to start."""
    st = cfg.storage
    if not st.embedded.enabled or st.endpoint_url:
        return cfg
    url = running_endpoint(st.embedded.data_dir)
    if url is None:
        raise UserError(
            f"the config's store is the embedded endpoint (data in {st.embedded.data_dir}), which no process runs: "
            "start `workflows store` with the same config first, or serve from a real store "
            "(storage.embedded.enabled=false)"
        )
    return cfg.model_copy(update={"storage": st.model_copy(update={"endpoint_url": url})})


def deploy(cfg: WorkflowConfig, model_spec: str, name: str | None = None, route_prefix: str = "/",
           served_as: str | None = None) -> str:
    """Deploy the model on the running Ray cluster; returns the base URL. Deploying another version to
    the same application `name` is Serve's rolling update: the new replicas start, then the old drain."""
    sc = cfg.serve
    free_before_serve_starts(cfg, say)
    ingress.start_serve(cfg, {"host": sc.host, "port": sc.port}, logging_config(sc))
    serve.run(
        application(cfg, model_spec, served_as),
        name=name or f"model-{model_spec.split(':')[0]}",
        route_prefix=route_prefix,
        blocking=False,
    )
    return f"http://{sc.host}:{sc.port}{route_prefix.rstrip('/')}"

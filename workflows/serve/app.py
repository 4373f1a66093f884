"""The Ray Serve application of a registered model: the replica (`ModelServer`: the model loaded,
dynamic batching, requests drained on shutdown), its deployment options, and how it is deployed
(`deploy`, or `build_app` for Serve config files).

The replica answers over the FastAPI app of workflows.serve.api, which it builds after loading the
model (`__serve_build_asgi_app__`), so the OpenAPI document declares that model's request and
response models; workflows.serve.guards checks every request first (headers, bearer token, body size).
"""

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from workflows import registry
from workflows.config import WorkflowConfig, load_config
from workflows.console import say
from workflows.errors import UserError
from workflows.serve import ingress
from workflows.serve.api import build_api
from workflows.serve.guards import bearer_token, check_exposure, denied, error_response, read_body, serve_metrics
from workflows.serve.stale_ingress import free_before_serve_starts
from workflows.storage.embedded import running_endpoint
from workflows.storage.uri import StorageContext
from workflows.tasks import check_task, task_for_card
from workflows.tasks.contract import MAX_BODY_BYTES

log = logging.getLogger(__name__)
MAX_PINS = 1024  # NAME@ALIAS lookups a replica keeps (answers and failures)


@serve.deployment
@serve.ingress()
class ModelServer:
    def __init__(self, cfg: dict, model_spec: str, served_as: str | None = None):
        """`model_spec`: the version to load (NAME:VERSION); `served_as`: the NAME@ALIAS it is served
        for, when an alias chose it (`workflows serve` rolls the application over when the alias moves)."""
        self.cfg = WorkflowConfig.model_validate(cfg)
        self.served_as = served_as
        # NAME@ALIAS -> (NAME:VERSION, or the UserError of a failed lookup; when read): `pin`
        self._pins: dict[str, tuple[str | UserError, float]] = {}
        self.storage = storage = StorageContext.from_config(self.cfg.storage)
        model_dir, _ = registry.fetch(self.cfg, storage, model_spec)
        self.card = registry.model_card(self.cfg, storage, model_spec)  # with evaluation metrics
        task = task_for_card(self.cfg, self.card)
        self.predictor = task.serving.predictor(model_dir, self.card,
                                                threads=max(1, int(self.cfg.serve.cpus_per_replica)),
                                                precision=self.cfg.serve.precision)
        self.token = bearer_token(self.cfg.serve)
        self.contract = task.serving.http_contract(self.card, self.cfg.serve.max_instances)
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

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose contract can no longer answer is replaced."""
        if (why := self.contract.unhealthy()) is not None:
            raise RuntimeError(why)

    def guard(self, request: Request) -> JSONResponse | None:
        """What a task's own route answers first, if anything: 503 while stopping, 401 without the token."""
        return self.stopping_response() if self.stopping else denied(self.token, request)

    def fetch_model(self, spec: str) -> tuple[str, Any]:
        """Another registered version (a task's adapter): its local directory and card. Blocking;
        a UserError that names the model only (`_unseen`)."""
        with _unseen(spec):
            return registry.fetch(self.cfg, self.storage, spec)

    def read_card(self, spec: str) -> Any:
        """Another registered version's card alone (one small read, nothing downloaded). Blocking;
        a UserError that names the model only (`_unseen`)."""
        with _unseen(spec):
            return registry.read_card(self.cfg, self.storage, registry.resolve(self.cfg, self.storage, spec))

    async def pin(self, model: str) -> str:
        """A request's model NAME@ALIAS as the NAME:VERSION the alias holds (read from the registry at
        most once per serve.alias_poll_s; a task's adapter follows its alias so); the alias this
        replica was deployed for is its own version until the rollover replaces it; anything else as
        it is. A UserError naming the model only (`_unseen`) for an alias that is not set, kept as long as
        an answer is (a client repeating an unknown name costs no listing each time)."""
        if "@" not in model:
            return model
        if model == self.served_as:
            return f"{self.card.name}:{self.card.version}"
        hit = self._pins.get(model)
        if hit is None or time.monotonic() - hit[1] >= self.cfg.serve.alias_poll_s:
            hit = (await asyncio.get_running_loop().run_in_executor(None, self._resolve, model), time.monotonic())
            if len(self._pins) >= MAX_PINS:  # names a client makes up must not grow it without bound
                self._pins.pop(next(iter(self._pins)))
            self._pins[model] = hit
        if isinstance(hit[0], UserError):
            raise hit[0]
        return hit[0]

    def _resolve(self, model: str) -> str | UserError:
        try:
            with _unseen(model):
                ref = registry.resolve(self.cfg, self.storage, model)
        except UserError as e:
            return e
        return f"{ref.name}:{ref.version}"

    def stopping_response(self) -> JSONResponse:
        # Connection: close makes the client drop its keep-alive connection before the proxy goes.
        return error_response(503, "the server is shutting down", {"Connection": "close", "Retry-After": "5"})

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
                return error_response(*rows)
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


def deployment_options(cfg: WorkflowConfig) -> dict:
    """Replica count or autoscaling, resources, how many requests a replica takes at once, and what its
    task adds (the task's `serving.deployment_options`: a generative model's admission)."""
    from workflows.tasks import task_class

    sc = cfg.serve
    opts: dict[str, Any] = {
        "ray_actor_options": {
            "num_cpus": sc.cpus_per_replica,
            **({"num_gpus": sc.gpus_per_replica} if sc.gpus_per_replica else {}),
            # the raylet starts a worker at the niceness its runtime_env names (as Ray's job supervisor does)
            **({"runtime_env": {"env_vars": {"RAY_worker_niceness": str(sc.replica_niceness)}}}
               if sc.replica_niceness is not None else {}),
        },
        # Serve's default of 5 ongoing requests would silently cap batches below max_batch_size.
        "max_ongoing_requests": max(2 * sc.max_batch_size, 32),
        "logging_config": logging_config(sc),
    }
    if sc.autoscaling is not None:
        opts["autoscaling_config"] = sc.autoscaling.model_dump()
    else:
        opts["num_replicas"] = sc.num_replicas
    extra = dict(task_class(cfg.model.task)(cfg).serving.deployment_options())
    opts["ray_actor_options"].update(extra.pop("ray_actor_options", {}))
    opts.update(extra)
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
    check_exposure(sc)
    free_before_serve_starts(cfg, say)
    ingress.start_serve(cfg, {"host": sc.host, "port": sc.port}, logging_config(sc))
    serve.run(
        application(cfg, model_spec, served_as),
        name=name or f"model-{model_spec.split(':')[0]}",
        route_prefix=route_prefix,
        blocking=False,
    )
    return f"http://{sc.host}:{sc.port}{route_prefix.rstrip('/')}"

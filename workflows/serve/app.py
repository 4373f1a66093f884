"""Ray Serve application: FastAPI ingress, dynamic batching, the shared predictor.

POST /predict  {"instances": [{<text columns>}]} -> {"predictions": [{"label", "score", "probabilities"}]}
GET  /healthz  GET /v1/models/<name>  (and FastAPI's /docs, /openapi.json)
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` annotation.
import asyncio
import json
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from ray import serve

from workflows.config import WorkflowConfig
from workflows.storage.uri import StorageContext

MAX_BODY_BYTES = 1 << 20

api = FastAPI(title="workflows model server", description="Predictions from a registered model.")


def instance_model(text_columns: list[str]) -> type[BaseModel]:
    """Pydantic model of one instance: the model's text columns, strings, nothing else."""
    fields: dict[str, Any] = {c: (str, Field(..., max_length=100_000)) for c in text_columns}

    def not_all_empty(self):
        if not any(str(getattr(self, c)).strip() for c in text_columns):
            raise ValueError(f"all text fields are empty ({', '.join(text_columns)})")
        return self

    return create_model("Instance", __config__=ConfigDict(extra="forbid", strict=True),
                        __validators__={"not_all_empty": model_validator(mode="after")(not_all_empty)}, **fields)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message})


@serve.deployment
@serve.ingress(api)
class ModelServer:
    def __init__(self, cfg: dict, model_spec: str):
        from workflows import registry
        from workflows.serve.predictor import Predictor

        self.cfg = WorkflowConfig.model_validate(cfg)
        storage = StorageContext.from_config(self.cfg.storage)
        model_dir, _ = registry.fetch(self.cfg, storage, model_spec)
        self.meta = registry.describe(self.cfg, storage, model_spec)  # with evaluation metrics
        self.predictor = Predictor(model_dir, threads=max(1, int(self.cfg.serve.cpus_per_replica)))
        self.instance = instance_model(self.meta["text_columns"])
        self.max_instances = self.cfg.serve.max_instances
        self._predict_batch.set_max_batch_size(self.cfg.serve.max_batch_size)
        self._predict_batch.set_batch_wait_timeout_s(self.cfg.serve.batch_wait_timeout_s)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _predict_batch(self, rows: list[dict]) -> list[dict]:
        return self.predictor.predict(rows)

    @api.post("/predict")
    async def predict(self, request: Request):
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return _error(413, f"request body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}")
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            return _error(400, f"body is not valid JSON: {e}")
        if not isinstance(payload, dict) or set(payload) != {"instances"}:
            return _error(422, 'body must be an object with exactly one key, "instances"')
        instances = payload["instances"]
        if not isinstance(instances, list) or not instances:
            return _error(422, '"instances" must be a non-empty list')
        if len(instances) > self.max_instances:
            return _error(413, f"{len(instances)} instances; at most {self.max_instances} per request")
        rows = []
        for i, inst in enumerate(instances):
            try:
                rows.append(self.instance.model_validate(inst).model_dump())
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                return _error(422, f"instances[{i}]{'.' + where if where else ''}: {err['msg']}")
        predictions = await asyncio.gather(*(self._predict_batch(r) for r in rows))
        return {"predictions": predictions, "model": self.meta["name"], "version": self.meta["version"]}

    @api.get("/healthz")
    async def healthz(self):
        return {"status": "ok", "model": self.meta["name"], "version": self.meta["version"]}

    @api.get("/v1/models/{name}")
    async def model_info(self, name: str):
        if name != self.meta["name"]:
            raise HTTPException(status_code=404, detail=f"model {name!r} is not served here")
        keep = ("name", "version", "labels", "text_columns", "metrics", "lineage", "registered_at")
        return {k: self.meta.get(k) for k in keep}


def application(cfg: WorkflowConfig, model_spec: str) -> serve.Application:
    sc = cfg.serve
    return ModelServer.options(
        num_replicas=sc.num_replicas,
        ray_actor_options={"num_cpus": sc.cpus_per_replica},
        # Serve's default of 5 ongoing requests would silently cap batches below max_batch_size.
        max_ongoing_requests=max(2 * sc.max_batch_size, 32),
    ).bind(cfg.model_dump(mode="json"), model_spec)


def build_app(args: dict) -> serve.Application:
    """Application builder for Serve config files (`serve run`, RayService `import_path`).

    args: config (a workflow YAML path), model (NAME[:VERSION]), set (optional list of overrides).
    """
    from workflows.config import load_config

    cfg = load_config(args.get("config") or "configs/quickstart.yaml", list(args.get("set") or []))
    return application(cfg, str(args["model"]))


def deploy(cfg: WorkflowConfig, model_spec: str, name: str | None = None) -> str:
    """Deploy the model on the running Ray cluster; returns the base URL."""
    sc = cfg.serve
    serve.start(http_options={"host": sc.host, "port": sc.port})
    serve.run(application(cfg, model_spec), name=name or f"model-{model_spec.split(':')[0]}", route_prefix="/", blocking=False)
    return f"http://{sc.host}:{sc.port}"

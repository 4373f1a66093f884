"""What every request to a replica passes before a route answers it, and the one-line errors it may
get: header limits and request metrics (`RequestGuard`), the bearer token (`TokenGuard`, `denied`),
the body's size (`read_body`). Plain ASGI middleware: Starlette's @app.middleware("http") costs a
task and a stream copy per request.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import time
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.routing import Match

from workflows.cluster_scoped import per_cluster
from workflows.errors import UserError

if TYPE_CHECKING:
    from workflows.serve.app import ModelServer

# Ray Serve metrics (Prometheus, through Ray's metrics agent; docs/OBSERVABILITY.md). Created on
# first use inside a replica, so Serve adds its deployment/replica/application tags.
LATENCY_MS_BOUNDARIES = [1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000]
BATCH_SIZE_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]

# Serve's HTTP proxy sets no limit on request headers; these are what common front proxies allow.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100

# The one route answered without the token: readiness probes (Kubernetes, load balancers) call it
# without credentials, and it says only that the model is up, with its name and version.
OPEN_ROUTES = ("/healthz",)


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


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """Every error the replica answers itself: {"error": message}."""
    return JSONResponse(status_code=status, content={"error": message}, headers=headers)


class RequestGuard:
    """Requests with too many or too large headers get 431; every other request is counted and
    timed, tagged with its route template (e.g. /predict, /v1/models/{name}; "other" when no route
    matched) and its HTTP status ("500" if it raised)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        size = sum(len(k) + len(v) for k, v in headers)
        if len(headers) > MAX_HEADERS or size > MAX_HEADER_BYTES:
            return await error_response(431, f"request headers too large: {len(headers)} headers, {size} bytes "
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


class TokenGuard:
    """With a bearer token set, every request needs it before any route runs: /predict, the model's
    card, and FastAPI's /openapi.json, /docs and /redoc too, whose document lists the labels that
    /v1/models/NAME answers only with the token (a route added later is covered too). Only
    OPEN_ROUTES, as the app's router matches them, are answered without it."""

    def __init__(self, app, server: ModelServer, api: FastAPI):
        self.app, self.server, self.api = app, server, api

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.server.token is not None and not self._open(scope):
            refused = denied(self.server.token, Request(scope))
            if refused is not None:
                return await refused(scope, receive, send)
        return await self.app(scope, receive, send)

    def _open(self, scope) -> bool:
        return any(getattr(r, "path", None) in OPEN_ROUTES and r.matches(scope)[0] == Match.FULL
                   for r in self.api.router.routes)


def denied(token: str | None, request: Request) -> JSONResponse | None:
    """The 401 for a request without the bearer `token` (None: no token is asked for)."""
    if token is None:
        return None
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        return error_response(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
    return None


def check_exposure(sc) -> None:
    """Refuse to serve on an address beyond this machine with no bearer token, unless serve.allow_open says so:
    an open API there is a decision, never a default's side effect."""
    if sc.auth_token_env or sc.allow_open or _loopback(sc.host):
        return
    raise UserError(f"serve.host={sc.host} exposes the API beyond this machine with no serve.auth_token_env: "
                    "set a token (serve.auth_token_env) or serve.allow_open=true to serve it open")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: only localhost is known to stay on this machine
        return host == "localhost"


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


async def read_body(request: Request, limit: int) -> bytes | JSONResponse:
    """The body, or a 413 once it is over `limit` bytes: from Content-Length before anything is read
    (a 16 MiB upload is refused without receiving it), else while it streams in (chunked)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return error_response(413, f"request body is {int(declared)} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return error_response(413, f"request body is over {limit} bytes (at least {size}); the limit is {limit}")
        chunks.append(chunk)
    return b"".join(chunks)

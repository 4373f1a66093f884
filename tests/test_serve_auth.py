"""The model server's FastAPI app with a bearer token set: every route the app has, FastAPI's
/openapi.json, /docs and /redoc included, answers 401 without the token (the document lists the
model's labels, which /v1/models/NAME keeps behind it), except /healthz; and every route, fuzzed
with any method, path, header and body, never answers 5xx nor, without the token, anything but 401.
In process, no Ray: the app of workflows.serve.api.build_api over a server stub, driven over ASGI."""

from __future__ import annotations

import asyncio
import json
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workflows.model_card import ModelCard
from workflows.serve import api, guards
from workflows.serve import app as serve_app
from workflows.tasks.contract import MAX_BODY_BYTES
from workflows.tasks.text.contract import text_contract

TOKEN = "s3cret-T0ken"
LABELS = ["label-only-with-the-token", "another-hidden-label"]
CARD = ModelCard(name="tickets", version=3, task="classification", labels=LABELS, text_columns=["title"],
                 max_length=16)


class _Metric:
    def inc(self, *a, **k):
        pass

    observe = inc


def build(monkeypatch, token: str | None = TOKEN):
    """The replica's app, over a ModelServer whose model is a stub (every prediction the first label)."""
    monkeypatch.setattr(guards, "serve_metrics", lambda: dict.fromkeys(("requests", "latency_ms", "batch_size"),
                                                                       _Metric()))
    server = object.__new__(serve_app.ModelServer.func_or_class)
    server.card, server.token, server.contract = CARD, token, text_contract(CARD, 4)
    server.stopping, server.in_flight = False, 0
    server.max_body_bytes, server._parse_threads = MAX_BODY_BYTES, None

    async def predict_batch(row):
        return {"label": LABELS[0], "score": 1.0, "probabilities": dict.fromkeys(LABELS, 0.5)}

    server._predict_batch = predict_batch
    return api.build_api(server)


def call(app, method: str, path: str, headers: dict[str, str] | list[tuple[bytes, bytes]] | None = None,
         body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP request through the ASGI app: (status, body)."""
    raw = headers if isinstance(headers, list) else [(k.lower().encode(), v.encode())
                                                     for k, v in (headers or {}).items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"host", b"testserver"), (b"content-length", str(len(body)).encode()), *raw],
             "client": ("127.0.0.1", 1234), "server": ("testserver", 80)}
    sent = [{"type": "http.request", "body": body, "more_body": False}]
    out: dict = {"status": None, "body": b""}

    async def receive():
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    asyncio.run(app(scope, receive, send))
    return out["status"], out["body"]


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app has, each path parameter filled with the model's name."""
    return sorted((m, re.sub(r"\{[^}]+\}", CARD.name, r.path)) for r in app.router.routes
                  for m in sorted(getattr(r, "methods", None) or {"GET"}))


def body_for(path: str) -> bytes:
    return json.dumps({"instances": [{"title": "Invoice charged twice"}]}).encode() if path == "/predict" else b""


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_every_route_but_healthz_needs_the_token(monkeypatch):
    app = build(monkeypatch)
    found = routes(app)
    assert {p for _, p in found} >= {"/predict", "/healthz", f"/v1/models/{CARD.name}", "/openapi.json", "/docs",
                                     "/redoc", "/docs/oauth2-redirect"}, found
    for method, path in found:
        status, body = call(app, method, path, AUTH, body_for(path))
        assert status == 200, (method, path, status, body[:200])
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            status, body = call(app, method, path, headers, body_for(path))
            if path in guards.OPEN_ROUTES:
                assert status == 200 and not any(label.encode() in body for label in LABELS), (path, body)
            else:
                assert status == 401 and json.loads(body) == {"error": "missing or wrong bearer token"}, \
                    (method, path, headers, status, body[:200])
    # the document is what the token protects: the labels are in it
    assert LABELS[0].encode() in call(app, "GET", "/openapi.json", AUTH)[1]
    # no route is found without the token either (404 would tell which exist)
    assert call(app, "GET", "/nowhere")[0] == 401 and call(app, "GET", "/nowhere", AUTH)[0] == 404


def test_without_a_token_every_route_is_open(monkeypatch):
    app = build(monkeypatch, token=None)
    for method, path in routes(app):
        assert call(app, method, path, None, body_for(path))[0] == 200, (method, path)


METHODS = st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"])
SEGMENT = st.text(st.characters(codec="ascii", exclude_characters="/?#"), max_size=12)
AUTHORIZATION = st.one_of(
    st.just(f"Bearer {TOKEN}"), st.just(TOKEN), st.just(f"bearer {TOKEN}"), st.just(f"Bearer  {TOKEN}"),
    st.just(f"Bearer {TOKEN[:-1]}"), st.just(f"Bearer {TOKEN}x"), st.text(max_size=40).map(lambda t: f"Bearer {t}"),
    st.binary(max_size=40).map(lambda b: b"Bearer " + b))
HEADER_NAME = st.sampled_from([b"content-type", b"accept", b"x-forwarded-for", b"authorization", b"origin",
                               b"transfer-encoding", b"cookie"])


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_route_fuzzed_is_answered_4xx_or_2xx_and_401_without_the_token(monkeypatch, data):
    """Every route (drawn from the app's own list, docs pages included) with a random method, extra
    path segments, headers and body: never a 5xx; 2xx without the exact token only from /healthz."""
    app = build(monkeypatch)
    method, path = data.draw(st.sampled_from(routes(app)))
    method = data.draw(st.one_of(st.just(method), METHODS))
    if data.draw(st.booleans()):
        path = path.rstrip("/") + "/" + "/".join(data.draw(st.lists(SEGMENT, max_size=3)))
    headers: list[tuple[bytes, bytes]] = []
    token = data.draw(st.one_of(st.none(), AUTHORIZATION))
    if token is not None:
        headers.append((b"authorization", token if isinstance(token, bytes) else token.encode("latin-1", "replace")))
    headers += data.draw(st.lists(st.tuples(HEADER_NAME, st.binary(max_size=30)), max_size=3))
    body = data.draw(st.one_of(st.just(body_for(path)), st.binary(max_size=200),
                               st.just(b'{"instances": [{"title": "x"}]}')))
    status, answer = call(app, method, path, headers, body)
    assert status is not None and status < 500, (method, path, headers, body, status, answer[:300])
    # RFC 9110: the scheme is case-insensitive; the first Authorization header is the one read
    given = next((v for k, v in headers if k == b"authorization"), b"")
    scheme, _, value = given.partition(b" ")
    authorized = scheme.lower() == b"bearer" and value == TOKEN.encode()
    if not authorized and path not in guards.OPEN_ROUTES:
        assert status == 401, (method, path, headers, status, answer[:300])
    if 200 <= status < 300 and path != "/healthz":
        assert authorized


def test_an_open_api_beyond_loopback_is_a_decision():
    """serve.host beyond this machine with no token is refused unless serve.allow_open says so; loopback, a
    token or allow_open serve."""
    import pytest

    from workflows.config.serve import ServeConfig
    from workflows.errors import UserError

    for open_ok in ({"host": "127.0.0.1"}, {"host": "::1"}, {"host": "localhost"},
                    {"host": "0.0.0.0", "auth_token_env": "T"}, {"host": "10.0.0.5", "allow_open": True}):
        guards.check_exposure(ServeConfig(**open_ok))
    for host in ("0.0.0.0", "::", "10.0.0.5", "serve.example.com"):
        with pytest.raises(UserError, match=r"no serve.auth_token_env: .*serve.allow_open=true") as refused:
            guards.check_exposure(ServeConfig(host=host))
        assert f"serve.host={host}" in str(refused.value) and len(str(refused.value).splitlines()) == 1


def test_the_commands_refuse_an_open_api_before_anything_starts(tmp_path):
    """`workflows serve`, its --emit-config and `workflows pipeline` with serve.host=0.0.0.0 and no token: one
    line naming serve.allow_open, exit 2, no Ray started, nothing emitted; with serve.allow_open=true the
    serve command goes on (to the next refusal here: no such model)."""
    from tests.conftest import run_cli, sets

    local = [f"storage.root={tmp_path}/store", "storage.embedded.enabled=false", f"output_dir={tmp_path}/runs",
             "serve.host=0.0.0.0", "tracking.enabled=false"]
    for args in (("serve", "--model", "m"), ("serve", "--model", "m", "--emit-config", str(tmp_path / "s.yaml")),
                 ("pipeline",)):
        res = run_cli(*args, *sets(local), timeout=120)
        assert res.returncode == 2, res.stderr[-2000:]
        assert "serve.host=0.0.0.0 exposes the API beyond this machine" in res.stderr
        assert "serve.allow_open=true" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "s.yaml").exists() and not (tmp_path / "runs" / "quickstart" / "logs").exists()
    res = run_cli("serve", "--model", "m", *sets([*local, "serve.allow_open=true"]), timeout=120)
    assert res.returncode == 2 and "exposes" not in res.stderr and "model 'm'" in res.stderr, res.stderr[-2000:]

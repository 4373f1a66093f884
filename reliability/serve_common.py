"""What the Serve rows (serve_hostile_inputs, serve_hostile_images, serve_openapi_fuzz) share: the
bearer token they deploy with, the repair of a deployment whose frozen globals are missing, an
untrained model registered as training would register it, and raw HTTP requests that reach the
server exactly as written."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path
from typing import Any

TOKEN_ENV = "WORKFLOWS_RELIABILITY_TOKEN"
TOKEN = "reliability-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}
MODEL = "hostile"

def _functions(cls):
    for name, attr in vars(cls).items():
        f = getattr(attr, "__func__", attr)
        if hasattr(f, "__code__"):
            yield name, f


def _code_globals(code) -> set[str]:
    import dis
    import types

    names = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:  # nested functions, comprehensions
        if isinstance(const, types.CodeType):
            names |= _code_globals(const)
    return names


def frozen_missing_globals() -> dict[str, set[str]]:
    """Globals that ModelServer's methods load but that the copy Serve deploys does not have.

    `@serve.ingress(api)` cloudpickles the FastAPI app (and with it the class, by value) when
    app.py is imported, at the decorator: a module-level name defined below the class is not in
    that copy's globals, and the replica raises NameError when it is used."""
    import builtins

    from workflows.serve import app

    deployment: Any = app.ModelServer  # a serve.Deployment (@serve.deployment), which mypy sees as the plain class
    cls = next(c for c in deployment.func_or_class.__mro__ if "_predict_batch" in c.__dict__)
    missing = {}
    for name, f in _functions(cls):
        gone = {
            n
            for n in _code_globals(f.__code__)
            if n not in f.__globals__ and not hasattr(builtins, n) and n in vars(app)
        }
        if gone:
            missing[name] = gone
    return missing


def _patch_frozen_globals(missing: dict[str, set[str]]) -> None:
    from workflows.serve import app

    deployment: Any = app.ModelServer  # a serve.Deployment (@serve.deployment), which mypy sees as the plain class
    cls = next(c for c in deployment.func_or_class.__mro__ if "_predict_batch" in c.__dict__)
    for name, f in _functions(cls):
        for n in missing.get(name, ()):
            f.__globals__[n] = getattr(app, n)


# -- the model --------------------------------------------------------------------------------
def _register_untrained(rt, workdir: Path, text_columns: tuple[str, ...] = ("text",)) -> str:
    """The packaged MiniLM with a fresh 3-class head, exported and registered as export.py does."""
    from transformers import AutoTokenizer

    from workflows import registry
    from workflows.preprocess.encoding import resolve_model_dir
    from workflows.tasks.text.model import load_classifier

    labels = ["alpha", "beta", "gamma"]
    out = workdir / "artifact"
    out.mkdir(parents=True, exist_ok=True)
    base = resolve_model_dir("minilm")
    load_classifier(base, labels).save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(str(out))
    meta = {
        "task": "sequence-classification",
        "labels": labels,
        "text_columns": list(text_columns),
        "label_column": "label",
        "max_length": 32,
        "lineage": {"note": "untrained head, for reliability"},
    }
    (out / "workflows.json").write_text(json.dumps(meta))
    ref = registry.register(rt.cfg, rt.storage, str(out), MODEL, meta)
    rt.persist()
    return f"{ref.name}:{ref.version}"


def _wait_healthy(host: str, port: int, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st, _ = _request(host, port, "GET", "/healthz", None, {})
        if st == 200:
            return
        time.sleep(1)
    raise RuntimeError(f"the Serve app on {host}:{port} never became healthy")


# -- requests ---------------------------------------------------------------------------------
def _request(host, port, method, path, body, headers, timeout=120):
    """(status, body) or (error name, b'') for a dropped connection or a timeout."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        headers = dict(headers)
        if body is not None and not any(k.lower() in ("content-length", "transfer-encoding") for k in headers):
            headers["Content-Length"] = str(len(body))
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        if body is not None:
            conn.send(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__, b""
    finally:
        conn.close()


def _raw(host, port, data: bytes, timeout=60):
    """Bytes as they are, for requests http.client will not write; (status, body) or (error, b'')."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(data)
            chunks = []
            while True:
                try:
                    c = s.recv(65536)
                except TimeoutError:
                    break
                if not c:
                    break
                chunks.append(c)
                if b"\r\n\r\n" in b"".join(chunks):
                    head, _, rest = b"".join(chunks).partition(b"\r\n\r\n")
                    n = next(
                        (
                            int(h.split(b":", 1)[1])
                            for h in head.split(b"\r\n")[1:]
                            if h.lower().startswith(b"content-length:")
                        ),
                        None,
                    )
                    if n is not None and len(rest) >= n:
                        break
        data = b"".join(chunks)
        if not data:
            return "closed without a response", b""
        status_line, _, rest = data.partition(b"\r\n")
        return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]
    except (OSError, ValueError, IndexError) as e:
        return type(e).__name__, b""

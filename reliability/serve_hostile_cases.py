"""The hostile requests of serve_hostile_inputs (reliability.serve_hostile runs them): bodies,
headers, auth, sizes and HTTP smuggling that must each be answered 4xx with a message."""

from __future__ import annotations

import json
from typing import Any

from reliability.serve_common import AUTH, JSON, MODEL, TOKEN

# Decided (issue #32): HAProxy, Serve's default ingress, reads an unknown HTTP version as HTTP/1.1
# and forwards it (RFC 9112 allows that; the replica only ever sees HTTP/1.1). The row names that
# answer as accepted ingress behaviour instead of counting it as a failure.
ACCEPTED_HTTP_VERSION = "the ingress reads an unknown HTTP version as HTTP/1.1 (RFC 9112 allows it)"


def hostile_cases(valid: bytes) -> list[dict]:
    """>= 100 requests that must all be answered 4xx with a message."""
    H = {**JSON, **AUTH}
    cases: list[dict] = []

    def post(name, body, headers=H, path="/predict", auth=False):
        cases.append({"name": name, "method": "POST", "path": path, "body": body, "headers": headers, "auth": auth})

    # authentication
    post("no token", valid, JSON, auth=True)
    post("wrong token", valid, {**JSON, "Authorization": "Bearer nope"}, auth=True)
    post("token as Basic", valid, {**JSON, "Authorization": f"Basic {TOKEN}"}, auth=True)
    post("token without scheme", valid, {**JSON, "Authorization": TOKEN}, auth=True)
    post("token prefix", valid, {**JSON, "Authorization": f"Bearer {TOKEN[:-1]}"}, auth=True)
    post("token + suffix", valid, {**JSON, "Authorization": f"Bearer {TOKEN}x"}, auth=True)
    post("token in the query string", valid, JSON, path=f"/predict?token={TOKEN}", auth=True)
    post("100 KB Authorization header", valid, {**JSON, "Authorization": "Bearer " + "a" * 100_000}, auth=True)
    cases.append(
        {
            "name": "model info without token",
            "method": "GET",
            "path": f"/v1/models/{MODEL}",
            "headers": {},
            "auth": True,
        }
    )
    # not JSON, bad encodings
    for name, body in [
        ("not json", b"not json"),
        ("empty body", b""),
        ("truncated json", b'{"instances": [{"text": "x"'),
        ("trailing garbage", valid + b"garbage"),
        ("binary", bytes(range(256))),
        ("invalid UTF-8 in a string", b'{"instances": [{"text": "\xff\xfe bad"}]}'),
        ("invalid UTF-8 outside strings", b"\xff" + valid),
        ("UTF-8 BOM + garbage", b"\xef\xbb\xbf{]"),
        ("gzip bytes", b"\x1f\x8b\x08\x00\x00\x00\x00\x00"),
        ("single quotes", b"{'instances': [{'text': 'x'}]}"),
        ("NaN text", b'{"instances": [{"text": NaN}]}'),
        ("Infinity text", b'{"instances": [{"text": Infinity}]}'),
        ("5000-digit integer", b'{"instances": [{"text": ' + b"9" * 5000 + b"}]}"),
        ("lone surrogate escape", b'{"instances": [{"text": "\\ud800 x"}]}'),
        ("lone low surrogate escape", b'{"instances": [{"text": "a \\udfff b"}]}'),
        ("duplicate keys, last one bad", b'{"instances": [{"text": "x"}], "instances": 3}'),
    ]:
        post(name, body)
    # wrong shapes and types
    doc: Any
    for name, doc in [
        ("null", None),
        ("number", 1),
        ("string", "x"),
        ("list", [1, 2]),
        ("true", True),
        ("empty object", {}),
        ("instances null", {"instances": None}),
        ("instances number", {"instances": 7}),
        ("instances string", {"instances": "text"}),
        ("instances object", {"instances": {"text": "x"}}),
        ("instances empty", {"instances": []}),
        ("instance null", {"instances": [None]}),
        ("instance number", {"instances": [1]}),
        ("instance string", {"instances": ["text"]}),
        ("instance list", {"instances": [["text", "x"]]}),
        ("instance empty", {"instances": [{}]}),
        ("text null", {"instances": [{"text": None}]}),
        ("text number", {"instances": [{"text": 3}]}),
        ("text bool", {"instances": [{"text": True}]}),
        ("text list", {"instances": [{"text": ["a"]}]}),
        ("text object", {"instances": [{"text": {"a": 1}}]}),
        ("text empty", {"instances": [{"text": ""}]}),
        ("text blank", {"instances": [{"text": " \t\n "}]}),
        ("extra field", {"instances": [{"text": "x", "y": 1}]}),
        ("wrong field", {"instances": [{"txt": "x"}]}),
        ("extra top-level key", {"instances": [{"text": "x"}], "k": 1}),
        ("key case", {"Instances": [{"text": "x"}]}),
        ("second instance bad", {"instances": [{"text": "x"}, {"text": 1}]}),
        ("last of 200 bad", {"instances": [{"text": "x"}] * 199 + [{"text": None}]}),
        ("text over 100k chars", {"instances": [{"text": "x" * 100_001}]}),
        ("257 instances", {"instances": [{"text": "x"}] * 257}),
        ("100k instances", {"instances": [{"text": "a"}] * 100_000}),
        ("text number string key", {"instances": [{"1": "x"}]}),
    ]:
        post(f"shape: {name}", json.dumps(doc).encode())
    # size
    post("10 MB body", b'{"instances": [{"text": "' + b"a" * (10 << 20) + b'"}]}')
    post("10 MB of spaces", b" " * (10 << 20))
    post("1 MB + 1 byte", b" " * ((1 << 20) + 1))
    chunked = b"".join(b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20)) for _ in range(11)) + b"0\r\n\r\n"
    post("11 MB chunked", chunked, {**H, "Transfer-Encoding": "chunked"})
    # nesting
    for depth in (1_000, 10_000, 100_000):
        post(f"nested lists {depth}", b"[" * depth + b"]" * depth)
        post(f"nested objects {depth}", b'{"a":' * depth + b"1" + b"}" * depth)
        post(f"nested instances {depth}", b'{"instances": [' + b"[" * depth + b"]" * depth + b"]}")
    post("nested text 10000", b'{"instances": [{"text": ' + b"[" * 10_000 + b"]" * 10_000 + b"}]}")
    # paths
    for path in [
        "/v1/models/..%2F..%2Fetc",
        "/v1/models/..%2F..%2Fetc%2Fpasswd",
        "/v1/models/../../etc/passwd",
        "/v1/models/%2e%2e",
        "/v1/models/..",
        "/v1/models/.",
        "/v1/models/hostile%00",
        "/v1/models/hostile/../../x",
        "/v1/models/" + "a" * 5000,
        "/v1/models/%ff%fe",
        "/v1/models/other",
        "/v1/models/",
        "/v1/models",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/../../etc/passwd",
        "/predict/../../etc/passwd",
        "/static/../../etc/passwd",
        "/admin",
        "/predict2",
        "/v2/predict",
        "/predict%00",
        "/PREDICT",
        "/.env",
        "/.git/config",
        "/" + "x" * 8000,
        "/v1/models/hostile;rm%20-rf",
        "/v1/models/hostile%0d%0aX-Injected:%201",
    ]:
        cases.append({"name": f"GET {path[:60]}", "method": "GET", "path": path, "headers": AUTH})
    # methods
    for method, path in [
        ("GET", "/predict"),
        ("PUT", "/predict"),
        ("DELETE", "/predict"),
        ("PATCH", "/predict"),
        ("OPTIONS", "/predict"),
        ("HEAD", "/predict"),
        ("POST", "/healthz"),
        ("DELETE", f"/v1/models/{MODEL}"),
        ("PUT", f"/v1/models/{MODEL}"),
        ("TRACE", "/predict"),
        ("FOO", "/predict"),
        ("POST", "/docs"),
    ]:
        cases.append(
            {
                "name": f"{method} {path}",
                "method": method,
                "path": path,
                "headers": H,
                "body": valid if method in ("PUT", "PATCH", "POST") else None,
            }
        )
    # malformed HTTP, some with what the server may answer instead of refusing it
    malformed: list[tuple[str, bytes] | tuple[str, bytes, str]] = [
        ("garbage request line", b"HELLO\r\n\r\n"),
        ("no HTTP version", b"POST /predict\r\n\r\n"),
        ("HTTP/9.9", b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", ACCEPTED_HTTP_VERSION),
        ("header without colon", b"GET /healthz HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n"),
        ("negative Content-Length", b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"),
        ("non-numeric Content-Length", b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"),
        (
            "conflicting Content-Lengths",
            b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        ),
        (
            "bad chunk size",
            b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        ),
        (
            "CL and TE both (smuggling)",
            b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            b"GET /admin HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
        ("1 MB header line", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n"),
        (
            "10,000 headers",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(10_000)) + b"\r\n",
        ),
        ("NUL in the path", b"GET /heal\x00thz HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("space in the path", b"GET /v1/models/a b HTTP/1.1\r\nHost: x\r\n\r\n"),
    ]
    for name, raw, *accepted in malformed:
        cases.append({"name": f"raw: {name}", "raw": raw, "accepted": accepted[0] if accepted else None})
    return cases

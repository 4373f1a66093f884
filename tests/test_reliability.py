"""The fast rows of the fault-injection suite (`make reliability` runs them all): real processes
SIGKILLed mid-download, a fault-injecting proxy in front of the embedded S3 endpoint, the endpoint
killed, a real `workflows preprocess` run scanned for credentials. Each row must lose nothing and
fail no more than it allows.

A failure the suite found in the platform and that is not fixed yet is listed in KNOWN_ISSUES:
the row then xfails, naming it, as long as every failure of the row is a known one; any other
failure, and any lost data, fails the test.
"""

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reliability import ROWS, passed, row_function
from reliability.fault_proxy import FaultProxy
from reliability.report import render, write_results

FAST = [r.name for r in ROWS if r.fast]

# row -> prefixes of its `failures` entries that are known platform bugs (see docs/RELIABILITY.md)
KNOWN_ISSUES: dict[str, tuple[str, ...]] = {}


@pytest.mark.parametrize("name", FAST)
@pytest.mark.integration
def test_fast_row(name, tmp_path):
    row = row_function(name)(tmp_path, seed=0)
    assert set(row) >= {"name", "injected", "survived", "failed", "allowed_failures", "lost", "detail"}
    assert row["lost"] == 0, row["detail"]
    _sanity(row)
    if not passed(row):
        failures = row.get("failures") or []
        unknown = [f for f in failures if not f.startswith(KNOWN_ISSUES.get(name, ()))]
        assert failures and not unknown, f"{row['detail']}\nunexplained failures: {unknown or '(none listed)'}"
        pytest.xfail(f"{name}: {len(failures)} known platform issue(s): {failures[:3]}")


def _sanity(row: dict) -> None:
    """The faults really landed where they were meant to (else a pass proves nothing)."""
    name = row["name"]
    if name == "cache_download_kill":
        assert row["injected"] >= 20
        assert row["stats"]["mid_download"] >= 5, row["detail"]
        assert row["stats"]["waiters"] >= 1
    elif name == "object_store_faults":
        assert row["injected"] >= 20
        for kind in ("slowdown", "slow", "reset_before", "reset_mid"):
            assert row["proxy"].get(kind, 0) >= 1, (kind, row["proxy"])
    elif name == "object_store_outage":
        assert all(op["outcome"] != "hang" for op in row["ops"]), row["detail"]
        assert max(op["seconds"] for op in row["ops"]) < 60
        warm = next(op for op in row["ops"] if op["op"] == "ShardCache.fetch (warm, version known)")
        assert warm["outcome"] == "ok"  # a cached shard whose version is known needs no store
    elif name == "store_hostile_objects":  # every object and variant of the fast subset was tried
        assert row["injected"] >= 100 and row["lost"] == 0, row["detail"]
        assert len(row["objects"]) >= 6 and set(row["variants"]) >= {
            "escaping path", "foreign URI (s3)", "foreign URI (http)", "absolute path", "huge value", "wrong type"}
    elif name == "secrets_hygiene":
        assert not any(f.startswith("stage:") for f in row["failures"]), row["detail"]
        assert "requests signed with the fake key id" in row["detail"]


# -- the suite's own parts --------------------------------------------------------------------
class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = b"x" * 100_000
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except Exception as e:  # noqa: BLE001 - resets and truncations, by design
        return type(e).__name__, b""


def test_fault_proxy_answers_as_configured(upstream):
    with FaultProxy(upstream, slowdown=1.0) as p:
        status, body = _get(p.url + "/bkt/key")
        assert status == 503 and b"<Code>SlowDown</Code>" in body
    with FaultProxy(upstream, reset_mid=1.0) as p:
        status, body = _get(p.url + "/bkt/key")
        assert status != 200 and p.counts["reset_mid"] == 1  # truncated under its Content-Length
    with FaultProxy(upstream, reset_before=1.0) as p:
        assert _get(p.url + "/bkt/key")[0] != 200
    with FaultProxy(upstream) as p:
        assert _get(p.url + "/bkt/key") == (200, b"x" * 100_000)
        p.outage()
        assert _get(p.url + "/bkt/key")[0] != 200  # nothing listens any more
    assert p.counts["requests"] == 1


def test_results_merge_and_document(tmp_path):
    results, doc = tmp_path / "reliability.json", tmp_path / "RELIABILITY.md"
    row = {
        "name": "cache_download_kill",
        "injected": 20,
        "survived": 20,
        "failed": 0,
        "allowed_failures": 0,
        "lost": 0,
        "detail": "d1",
        "measured_at": "2030-01-01T00:00:00Z",
        "command": "python -m reliability --fast",
    }
    write_results([row], "python -m reliability --fast", results, doc)
    write_results(
        [{**row, "name": "secrets_hygiene", "detail": "d2"}],
        "python -m reliability --only secrets_hygiene",
        results,
        doc,
    )
    rows = {r["name"]: r for r in json.loads(results.read_text())["rows"]}
    assert set(rows) == {r.name for r in ROWS}
    assert rows["cache_download_kill"]["detail"] == "d1"  # kept from the earlier run
    assert rows["secrets_hygiene"]["detail"] == "d2"
    assert rows["serve_load"]["lost"] is None and "not measured" in rows["serve_load"]["detail"]
    text = doc.read_text()
    assert "--only secrets_hygiene" in text and "do not edit" in text
    assert "| `cache_download_kill` | yes | 20 | 20 | 0 | 0 | 0 | pass |" in text
    # --render: the same document again from the file alone
    doc.unlink()
    assert render(results, doc) == doc and doc.read_text() == text


# -- serve_openapi_fuzz's parts: what it accepts, and the hooks that give valid image cases real images --
def _interaction(request_body: bytes, status: int, error: str) -> dict:
    import base64

    answer = json.dumps({"error": error}).encode()
    return {"request": {"body": {"$base64": base64.b64encode(request_body).decode()}},
            "response": {"status_code": status, "content": {"$base64": base64.b64encode(answer).decode()}}}


def test_fuzz_row_accepts_only_the_decided_answers():
    from reliability.serve_openapi import _accepted

    big, small = b"x" * 2049, b"x" * 10
    not_image = "instances[0]: not an image (cannot identify image file)"
    assert _accepted("positive_data_acceptance", 413, _interaction(big, 413, "too big"), 2048, False)
    assert _accepted("positive_data_acceptance", 413, _interaction(small, 413, "too big"), 2048, False) is None
    assert _accepted("positive_data_acceptance", 422, _interaction(small, 422, not_image), 2048, True)
    assert _accepted("positive_data_acceptance", 422, _interaction(small, 422, not_image), 2048, False) is None
    assert _accepted("positive_data_acceptance", 422, _interaction(small, 422, "instances[0]: truncated image"),
                     2048, True) is None
    assert _accepted("negative_data_rejection", 413, _interaction(big, 413, "too big"), 2048, False) is None


def test_fuzz_hooks_make_valid_image_json_cases_decodable(request):
    """The fuzzer's positive JSON cases for an image model, with the row's hooks applied, are accepted
    by the server's parser and decoder (without the hooks their base64 is random bytes: a 422)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, assume, given, settings

    from reliability.schemathesis_images import map_case
    from tests.test_image_requests import openapi_document
    from workflows.preprocess.images import decode_image
    from workflows.tasks.image.contract import parse_image_request

    operation = schemathesis.openapi.from_dict(openapi_document())["/predict"]["POST"]
    seen = []
    request.addfinalizer(lambda: schemathesis.hooks.unregister(map_case))  # imported: registered globally

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE))
    def check(case):
        assume(case.media_type == "application/json")  # the other bodies are sent as generated
        case = map_case(None, case)  # (importing the module registered it for schemathesis too)
        images = parse_image_request("application/json", json.dumps(case.body).encode(), 1000, 1 << 24)
        assert isinstance(images, list), images
        for image in images:
            assert decode_image(image, 8, 10_000_000).shape == (8, 8, 3)
        seen.append(len(images))

    check()
    assert len(seen) >= 5

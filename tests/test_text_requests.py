"""workflows.tasks.text.contract: a text model's /predict body is validated by the request model that the
OpenAPI document declares, so the schema and the server agree on every body (the two mismatches
schemathesis once found included), with one-line messages. Pure: no Ray, no HTTP."""

import json
from types import SimpleNamespace

import jsonschema
import pytest

from workflows.tasks.contract import with_request_body
from workflows.tasks.text.contract import text_contract

MAX_INSTANCES = 4
CARD = SimpleNamespace(name="tickets", labels=["a", "b"], text_columns=["title", "description"])
CONTRACT = text_contract(CARD, MAX_INSTANCES)


def schema() -> dict:
    doc = with_request_body({"paths": {"/predict": {"post": {}}}}, "/predict", CONTRACT.request_model)
    return {"$ref": "#/components/schemas/PredictRequest", "components": doc["components"]}


def one(title="Invoice", description="charged twice") -> dict:
    return {"title": title, "description": description}


CASES = [
    ({"instances": [one()]}, None),
    ({"instances": [one()] * MAX_INSTANCES}, None),
    ({"instances": [one("", "x")]}, None),
    ({"instances": [one("", "")]}, "instances[0]: all text fields are empty (title, description)"),
    ({"instances": [one(" \t", "\n\u00a0")]}, "instances[0]: all text fields are empty (title, description)"),
    ({"instances": [one()] * 5}, f"5 instances; at most {MAX_INSTANCES} per request"),
    ({"instances": [{"junk": 1}] * 9}, f"9 instances; at most {MAX_INSTANCES} per request"),
    ({"instances": []}, '"instances" must be a non-empty list'),
    ({"instances": one()}, '"instances" must be a non-empty list'),
    ({}, 'body.instances: Field required (the body is {"instances": [...]})'),
    ({"inputs": [one()]}, 'body.inputs: Extra inputs are not permitted (the body is {"instances": [...]})'),
    ([one()], 'body must be an object {"instances": [...]}, not an array'),
    ({"instances": [one(), {**one(), "id": 1}]}, "instances[1].id: Extra inputs are not permitted"),
    ({"instances": [{"title": "x"}]}, "instances[0].description: Field required"),
    ({"instances": [one(3)]}, "instances[0].title: Input should be a valid string"),
    ({"instances": ["x"]}, "instances[0]: must be an object, not a string"),
    ({"instances": [one("x" * 100_001)]}, "instances[0].title: String should have at most 100000 characters"),
]


@pytest.mark.parametrize("payload, message", CASES, ids=range(len(CASES)))
def test_the_schema_and_the_server_agree(payload, message):
    """Accepted by the server exactly when the published schema accepts it; a rejection is one 422
    line naming the path (more instances than maxItems too, no longer a 413)."""
    result = CONTRACT.parse("application/json", json.dumps(payload).encode())
    errors = list(jsonschema.Draft202012Validator(schema()).iter_errors(payload))
    if message is None:
        assert result == [{k: str(v) for k, v in inst.items()} for inst in payload["instances"]]
        assert not errors, errors
    else:
        assert result == (422, message)
        assert errors, "the schema accepts a body the server rejects"


def test_bad_json_and_a_huge_body():
    status, message = CONTRACT.parse("application/json", b'{"instances": [')
    assert status == 400 and message.startswith("body is not valid JSON: ") and "\n" not in message
    assert CONTRACT.parse("application/json", b"[" * 100_000)[0] == 400  # nesting: no RecursionError
    big = b" " * ((1 << 20) + 1)
    assert CONTRACT.parse("application/json", big) == (413, f"request body is {len(big)} bytes; the limit is {1 << 20}")


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_a_schema_driven_fuzzer_generates_the_request(mode):
    """schemathesis (hypothesis) generates /predict bodies from the published schema, valid ones and
    ones that break it, without giving up (an anyOf of `\\S` patterns over 100,000-character strings
    made it fail: "min_size is larger than Hypothesis supports"), and the server agrees with each:
    a valid one is accepted, a violating one rejected with a 4xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    doc = with_request_body({"openapi": "3.1.0", "info": {"title": "t", "version": "1"},
                             "paths": {"/predict": {"post": {"responses": {"200": {"description": "ok"}}}}}},
                            "/predict", CONTRACT.request_model)
    operation = schemathesis.openapi.from_dict(doc)["/predict"]["POST"]
    seen = []

    # too_slow only: a loaded machine's timing, not the schema's; every other health check applies
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    def check(case):
        body = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
        result = CONTRACT.parse("application/json", body)
        if mode == "positive":
            assert isinstance(result, list), (result, case.body)
        else:
            assert isinstance(result, tuple) and 400 <= result[0] < 500, case.body
        seen.append(case)

    check()
    assert len(seen) >= 20


def test_blank_means_the_same_to_the_server_and_to_a_schema_validator():
    """Characters whose whitespace-ness differs between regex engines (Python's \\s counts U+001C-U+001F
    and U+0085, ECMA's does not): the server and schemathesis' validator (jsonschema-rs) agree on each."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = CONTRACT.request_model.model_json_schema()
    validator = jsonschema_rs.validator_for(schema)
    columns = list(schema["$defs"]["Instance"]["properties"]) if "$defs" in schema else None
    assert columns, schema
    for ch in ["\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\xa0", "\u2028", "\ufeff", "\t", " ", "\n", "x"]:
        body = {"instances": [{c: ch * 2 for c in columns}]}
        accepted = isinstance(CONTRACT.parse("application/json", json.dumps(body).encode()), list)
        assert accepted == validator.is_valid(body), (repr(ch), accepted)

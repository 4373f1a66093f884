"""workflows.tasks.image.contract: the bodies an image model's /predict accepts (JSON with base64, one raw
image, multipart files), the 4xx answer to each hostile one, and its OpenAPI declaration. Pure: no Ray."""

import base64
import json
import time
from types import SimpleNamespace

import pytest

from workflows.tasks.contract import ERRORS, error_responses
from workflows.tasks.image.contract import (
    ACCEPTED_TYPES,
    EXAMPLE_REQUEST,
    IMAGE_TYPES,
    RequestError,
    image_error_descriptions,
    image_predict_models,
    parse_image_request,
    with_image_request_body,
)

MAX_INSTANCES = 4
MAX_BODY = 64 * 1024
JSON = "application/json"
BOUNDARY = "----formboundary7MA4YWxkTrZu0gW"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"

# Not real images: this module hands the files' bytes on undecoded (decode_image answers for them later).
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) + b"IEND"
JPEG = b"\xff\xd8\xff\xe0" + b"\r\n--" + BOUNDARY.encode() + b"x" + bytes(range(255, -1, -1)) + b"\xff\xd9"
WEBP = b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 32


def parse(content_type, body, max_instances=MAX_INSTANCES, max_body_bytes=MAX_BODY):
    return parse_image_request(content_type, body, max_instances, max_body_bytes)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def json_body(*b64s: str, **extra) -> bytes:
    return json.dumps({"instances": [{"image": {"b64": s}} for s in b64s], **extra}).encode()


def multipart(*parts, boundary: str = BOUNDARY, close: bool = True) -> bytes:
    """parts: (field name, filename or None for a plain field, content) or raw bytes for a whole part."""
    out = []
    for part in parts:
        out.append(b"--" + boundary.encode() + b"\r\n")
        if isinstance(part, bytes):
            out.append(part + b"\r\n")
            continue
        name, filename, content = part
        out.append(f'Content-Disposition: form-data; name="{name}"'.encode())
        if filename is not None:
            out.append(f'; filename="{filename}"\r\nContent-Type: application/octet-stream'.encode())
        out.append(b"\r\n\r\n" + content + b"\r\n")
    if close:
        out.append(b"--" + boundary.encode() + b"--\r\n")
    return b"".join(out)


def rejected(result, status: int) -> str:
    """The message of a RequestError with this status; every message is one short line."""
    assert isinstance(result, RequestError), result
    assert result.status == status, result
    assert len(result.message.splitlines()) == 1 and len(result.message) < 500, result.message
    return result.message


# --- accepted shapes -------------------------------------------------------------------------------------

def test_json_instances_decode_to_their_bytes_in_order():
    assert parse(JSON, json_body(b64(PNG), b64(JPEG), b64(WEBP))) == [PNG, JPEG, WEBP]
    assert parse("Application/JSON; charset=utf-8", json_body(b64(PNG))) == [PNG]


def test_json_base64_alphabets_and_padding():
    """Standard or URL-safe alphabet (not mixed); the padding may be left out."""
    data = bytes(range(256)) * 3  # encodes to every character of both alphabets
    standard, url_safe = b64(data), base64.urlsafe_b64encode(data).decode()
    assert "+" in standard and "/" in standard and "-" in url_safe and "_" in url_safe
    assert parse(JSON, json_body(standard, url_safe)) == [data, data]
    for n in (1, 2):  # 1 or 2 '=' of padding, left out
        padded = b64(data[:-n])
        assert padded[-3:].count("=") == n, padded[-3:]
        assert parse(JSON, json_body(padded.rstrip("="))) == [data[:-n]]


@pytest.mark.parametrize("content_type", [*IMAGE_TYPES, "IMAGE/PNG", "image/jpeg; name=cat.jpg"])
def test_one_raw_image(content_type):
    assert parse(content_type, JPEG) == [JPEG]


def test_multipart_files_in_order_with_their_exact_bytes():
    """Any field name; content with CRLFs and text like the boundary comes back byte for byte."""
    body = multipart(("images", "a.png", PNG), ("images", "b.jpg", JPEG), ("file", "c.webp", WEBP))
    assert parse(MULTIPART, body) == [PNG, JPEG, WEBP]
    assert parse(f'multipart/form-data; boundary="{BOUNDARY}"', body) == [PNG, JPEG, WEBP]


# --- hostile bodies ------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [b"{", b"", b"\xff\xfe\x00", b'{"instances": [}', b"[" * 100_000 + b"]" * 100_000])
def test_not_json_is_400(body):
    assert rejected(parse(JSON, body, max_body_bytes=1 << 20), 400).startswith("body is not valid JSON: ")


@pytest.mark.parametrize("b64_text, reason", [
    ("not base64!", "character ' ' at offset 3"),
    ("QUJD\nREVG", "character '\\n' at offset 4; no spaces or line breaks"),
    ("data:image/png;base64," + b64(PNG), "a data: URL; send only the base64 after its comma"),
    ("ab+/cd-_", "mixes the standard (+/) and URL-safe (-_) alphabets"),
    ("QUJDR", "number of data characters (5) cannot be 1 more than a multiple of 4"),
    ("QQ=", "Incorrect padding"),
    ("QQ==QQ==", "Excess data after padding"),
    ("QUJD\u2028", "character '\\u2028' at offset 4"),
])
def test_invalid_base64_is_422_with_its_reason(b64_text, reason):
    message = rejected(parse(JSON, json_body(b64(PNG), b64_text)), 422)
    assert message.startswith("instances[1].image.b64: invalid base64 ("), message
    assert reason in message


@pytest.mark.parametrize("payload, message", [
    ({"instances": [{"image": {"b64": b64(PNG)}}], "parameters": {}},
     'body.parameters: Extra inputs are not permitted (the body is {"instances": [...]})'),
    ({"inputs": []}, 'body.inputs: Extra inputs are not permitted (the body is {"instances": [...]})'),
    ({}, 'body.instances: Field required (the body is {"instances": [...]})'),
    ([{"image": {"b64": b64(PNG)}}], 'body must be an object {"instances": [...]}, not an array'),
    ({"instances": [{"image": {"b64": b64(PNG)}}] * 2 + [{"image": {"b64": b64(PNG), "url": "http://x"}}]},
     "instances[2].image.url: Extra inputs are not permitted"),
    ({"instances": [{"image": {"b64": b64(PNG)}, "key": "a"}]}, "instances[0].key: Extra inputs are not permitted"),
    ({"instances": [{"image": {"b64": b64(PNG)}, "a\nb": 1}]}, 'instances[0]["a\\nb"]: Extra inputs are not permitted'),
    ({"instances": [{"b64": b64(PNG)}]}, "instances[0].image: Field required"),
    ({"instances": [{"image": b64(PNG)}]}, "instances[0].image: must be an object, not a string"),
    ({"instances": [b64(PNG)]}, "instances[0]: must be an object, not a string"),
    ({"instances": [{"image": {"b64": 1}}]}, "instances[0].image.b64: must be a base64 string, not a number"),
    ({"instances": [{"image": {"b64": None}}]}, "instances[0].image.b64: must be a base64 string, not null"),
    ({"instances": []}, '"instances" must be a non-empty list'),
    ({"instances": {"image": {"b64": b64(PNG)}}}, '"instances" must be a non-empty list'),
    ({"instances": [{"image": {"b64": ""}}]}, "instances[0]: empty image (0 bytes)"),
])
def test_wrong_json_structure_is_422_naming_the_path(payload, message):
    assert rejected(parse(JSON, json.dumps(payload).encode()), 422) == message


def test_a_huge_key_is_not_echoed():
    payload = {"instances": [{"image": {"b64": b64(PNG), "x" * 100_000: 1}}]}
    message = rejected(parse(JSON, json.dumps(payload).encode(), max_body_bytes=1 << 20), 422)
    assert message.startswith('instances[0].image["xxxx') and len(message) < 200


def test_too_many_json_instances_is_422_before_any_is_validated():
    # the schema's maxItems: 422 as any other violation of it (schemathesis expects no 413 for one)
    assert rejected(parse(JSON, json_body(*[b64(PNG)] * 5)), 422) == "5 instances; at most 4 per request"
    # counted before validating: invalid instances over the limit still get the count's message
    body = json.dumps({"instances": [{"junk": i} for i in range(5)]}).encode()
    assert rejected(parse(JSON, body), 422) == "5 instances; at most 4 per request"
    assert parse(JSON, json_body(*[b64(PNG)] * 4)) == [PNG] * 4


@pytest.mark.parametrize("content_type", IMAGE_TYPES)
def test_zero_byte_raw_image_is_422(content_type):
    assert rejected(parse(content_type, b""), 422) == "instances[0]: empty image (0 bytes)"


@pytest.mark.parametrize("content_type", [None, "", "text/plain", "application/octet-stream",
                                          "application/x-www-form-urlencoded", "image/gif", "multipart/mixed",
                                          "application/jsonx", "image/png\u20ac; q=1", "x" * 10_000])
def test_wrong_or_missing_content_type_is_415_listing_the_accepted_ones(content_type):
    message = rejected(parse(content_type, PNG), 415)
    assert all(t in message for t in ACCEPTED_TYPES), message
    assert message.startswith("no Content-Type;" if not content_type else "Content-Type ")


@pytest.mark.parametrize("content_type", [JSON, "image/png", MULTIPART, "text/plain", None])
def test_body_over_the_limit_is_413_before_any_parsing(content_type):
    body = b"{" * (MAX_BODY + 1)  # not valid in any shape: the size is all that is looked at
    assert rejected(parse(content_type, body), 413) == f"request body is {MAX_BODY + 1} bytes; the limit is {MAX_BODY}"
    assert parse("image/png", b"x" * MAX_BODY) == [b"x" * MAX_BODY]  # the limit itself is allowed


def test_multipart_with_5000_parts_is_422_quickly_without_parsing_the_rest():
    body = multipart(*[("images", f"{i}.png", PNG) for i in range(5000)])
    assert len(body) < 2 << 20
    t0 = time.perf_counter()
    message = rejected(parse(MULTIPART, body, max_body_bytes=2 << 20), 422)
    assert time.perf_counter() - t0 < 0.25
    assert message == "more than 4 parts; at most 4 images per request"
    # parsing stops at the first part over the limit: what follows it is never looked at
    first5 = multipart(*[("images", f"{i}.png", PNG) for i in range(5)], close=False)
    assert rejected(parse(MULTIPART, first5 + b"\x00 not multipart at all"), 422) == message
    assert parse(MULTIPART, multipart(*[("images", f"{i}.png", PNG) for i in range(4)])) == [PNG] * 4


@pytest.mark.parametrize("parts, message", [
    ([("images", "a.png", PNG), ("caption", None, b"a cat")],
     'parts[1] (name "caption"): not a file (no filename in its Content-Disposition); send each image as a file part'),
    ([b"Content-Type: image/png\r\n\r\n" + PNG],
     'parts[0] (name ""): not a file (no filename in its Content-Disposition); send each image as a file part'),
    ([("images", "a.png", PNG), ("images", "empty.png", b"")], 'parts[1] (name "images", filename "empty.png"): '
                                                              "empty image (0 bytes)"),
    ([("images", "", b"")], 'parts[0] (name "images", filename ""): empty image (0 bytes)'),  # no file chosen
    ([], "multipart body has no parts; send one file part per image"),
])
def test_multipart_part_that_is_not_an_image_file_is_422_naming_it(parts, message):
    assert rejected(parse(MULTIPART, multipart(*parts)), 422) == message


def test_a_bad_part_is_answered_before_the_part_count():
    parts = [("caption", None, b"x")] + [("images", f"{i}.png", PNG) for i in range(10)]
    assert rejected(parse(MULTIPART, multipart(*parts)), 422).startswith('parts[0] (name "caption"): not a file')


def test_long_part_names_are_not_echoed():
    message = rejected(parse(MULTIPART, multipart(("n" * 3000, None, b"x"))), 422)
    assert message.startswith('parts[0] (name "nnnn') and len(message) < 200


@pytest.mark.parametrize("content_type, body, reason", [
    ("multipart/form-data", multipart(("images", "a.png", PNG)), "its Content-Type has no boundary"),
    (MULTIPART, multipart(("images", "a.png", PNG), close=False), "it ends before its closing boundary"),
    (MULTIPART, multipart(("images", "a.png", PNG))[:-40], "it ends before its closing boundary"),
    (MULTIPART, b"", "it ends before its closing boundary"),
    (MULTIPART, b"plain text, no boundary", "Expected boundary character"),
    (MULTIPART, multipart(b"X-Header: " + b"h" * 10_000 + b"\r\n\r\n" + PNG), "Maximum header size exceeded"),
    ("multipart/form-data; boundary=" + "b" * 300, b"--" + b"b" * 300, "Boundary length 300 exceeds"),
])
def test_malformed_multipart_is_400(content_type, body, reason):
    message = rejected(parse(content_type, body), 400)
    assert message.startswith("body is not valid multipart/form-data: ") and reason in message, message


# --- the OpenAPI contract, and the request model agreeing with the parser ------------------------------

CARD = SimpleNamespace(name="pets", version=3, labels=["cat", "dog"])


def openapi_document() -> dict:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    request_model, response_model = image_predict_models(CARD, MAX_INSTANCES)
    api = FastAPI(title="image model")

    @api.post("/predict", response_class=JSONResponse,
              responses={200: {"model": response_model, "description": "one prediction per instance"},
                         **error_responses(400, 401, 413, 415, 422, 431, 503)})
    async def predict():  # the app reads the body itself
        return {}

    return with_image_request_body(api.openapi(), "/predict", request_model, max_body_bytes=MAX_BODY)


def test_openapi_declares_the_three_body_shapes_and_every_error():
    spec = openapi_document()
    pytest.importorskip("openapi_spec_validator").validate(spec)
    op = spec["paths"]["/predict"]["post"]
    content = op["requestBody"]["content"]
    assert op["requestBody"]["required"] is True
    assert set(content) == set(ACCEPTED_TYPES)
    assert content[JSON]["schema"] == {"$ref": "#/components/schemas/PredictRequest"}
    assert content[JSON]["example"] == EXAMPLE_REQUEST
    for t in IMAGE_TYPES:
        assert content[t]["schema"] == {"type": "string", "format": "binary", "minLength": 1}  # 0 bytes: a 422
    multipart = content["multipart/form-data"]
    files = multipart["schema"]["properties"]["images"]
    assert files["type"] == "array" and files["items"]["format"] == "binary" and files["items"]["minLength"] == 1
    # the part rules a schema-driven client follows: files (a filename) under `images`, no plain fields
    assert multipart["schema"]["additionalProperties"] is False
    disposition = multipart["encoding"]["images"]["headers"]["Content-Disposition"]
    assert disposition["required"] is True and "filename=" in disposition["schema"]["example"]
    assert (files["minItems"], files["maxItems"]) == (1, MAX_INSTANCES)  # the parser's limits
    schemas = spec["components"]["schemas"]
    assert schemas["PredictRequest"]["properties"]["instances"]["maxItems"] == MAX_INSTANCES
    assert schemas["ImageInstance"]["additionalProperties"] is False
    assert schemas["ImageB64"]["additionalProperties"] is False
    assert set(schemas["Prediction"]["properties"]["label"]["enum"]) == {"cat", "dog"}
    assert set(schemas["PredictResponse"]["required"]) == {"predictions", "model", "version"}
    for code in ("400", "401", "413", "415", "422", "431", "503"):
        answer = op["responses"][code]
        assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    described = image_error_descriptions(MAX_INSTANCES, MAX_BODY)  # the image route's rules, not the text's
    for code in (400, 413, 415, 422):
        assert op["responses"][str(code)]["description"] == described[code] != ERRORS[code]
    assert str(MAX_BODY) in described[413] and str(MAX_INSTANCES) in described[422]
    assert all(t in described[415] for t in ACCEPTED_TYPES)
    assert op["responses"]["401"]["description"] == ERRORS[401]


def test_the_documented_example_is_accepted():
    import jsonschema

    spec = openapi_document()
    example = spec["paths"]["/predict"]["post"]["requestBody"]["content"][JSON]["example"]
    jsonschema.validate(example, {"$ref": "#/components/schemas/PredictRequest", "components": spec["components"]})
    images = parse(JSON, json.dumps(example).encode())
    assert isinstance(images, list) and images[0].startswith(b"\x89PNG\r\n\x1a\n")


def test_the_response_model_is_the_text_models():
    from workflows.tasks.text.contract import predict_models

    text_card = SimpleNamespace(**vars(CARD), text_columns=["text"])
    _, text_response = predict_models(text_card, MAX_INSTANCES)
    _, image_response = image_predict_models(CARD, MAX_INSTANCES)
    assert image_response.model_json_schema() == text_response.model_json_schema()
    answer = {"predictions": [{"label": "dog", "score": 0.9, "probabilities": {"cat": 0.1, "dog": 0.9}}],
              "model": "pets", "version": 3}
    image_response.model_validate(answer)


AGREEMENT_CASES = [
    {"instances": [{"image": {"b64": b64(PNG)}}]},
    {"instances": [{"image": {"b64": b64(d)}} for d in (PNG, JPEG, WEBP, PNG)]},  # max_instances exactly
    {"instances": [{"image": {"b64": base64.urlsafe_b64encode(JPEG).decode().rstrip("=")}}]},
    {"instances": [{"image": {"b64": b64(PNG)}}] * (MAX_INSTANCES + 1)},
    {"instances": []},
    {"instances": [{"image": {"b64": ""}}]},
    {"instances": [{"image": {"b64": "QQ"}}]},
    {"instances": [{"image": {"b64": "Q"}}]},
    {"instances": [{"image": {"b64": "QQ=="}}, {"image": {"b64": "ab+/cd-_"}}]},
    {"instances": [{"image": {"b64": "QU JD"}}]},
    {"instances": [{"image": {"b64": "data:image/png;base64,QQ=="}}]},
    {"instances": [{"image": {"b64": b64(PNG), "mime": "image/png"}}]},
    {"instances": [{"image": {"b64": b64(PNG)}, "id": 1}]},
    {"instances": [{"image": {"b64": 5}}]},
    {"instances": [{"image": None}]},
    {"instances": [[]]},
    {"instances": "all"},
    {"instances": [{"image": {"b64": b64(PNG)}}], "parameters": {}},
    {},
    [],
    "instances",
]


@pytest.mark.parametrize("payload", AGREEMENT_CASES, ids=range(len(AGREEMENT_CASES)))
def test_the_request_model_and_the_parser_agree(payload):
    """A JSON body the request model accepts is parsed to the same images; one it rejects is rejected
    (422, more than max_instances included); and the published JSON schema accepts every body
    the parser does (it checks the structure and the limits; base64 beyond its alphabet only the parser)."""
    import jsonschema
    from pydantic import ValidationError

    request_model, _ = image_predict_models(CARD, MAX_INSTANCES)
    result = parse(JSON, json.dumps(payload).encode())
    try:
        model = request_model.model_validate(payload)
    except ValidationError as e:
        assert isinstance(result, RequestError) and result.status == 422, (result, e)
    else:
        assert result == [inst.image.b64 for inst in model.instances]
    spec = openapi_document()
    schema = {"$ref": "#/components/schemas/PredictRequest", "components": spec["components"]}
    if isinstance(result, list):
        jsonschema.validate(payload, schema)


def test_bodies_as_an_http_client_encodes_them():
    """The bodies `requests` builds (its own multipart boundary and headers) parse to the files sent."""
    import requests

    def prepared(**kwargs):
        req = requests.Request("POST", "http://model/predict", **kwargs).prepare()
        return req.headers.get("Content-Type"), req.body

    files = [("images", ("a.png", PNG, "image/png")), ("images", ("b.jpg", JPEG, "image/jpeg")),
             ("images", ("c.webp", WEBP))]
    assert parse(*prepared(files=files)) == [PNG, JPEG, WEBP]
    assert parse(*prepared(json={"instances": [{"image": {"b64": b64(JPEG)}}]})) == [JPEG]
    assert parse(*prepared(data=PNG, headers={"Content-Type": "image/png"})) == [PNG]
    # a form field beside the files (requests puts the data fields first)
    message = rejected(parse(*prepared(files=files, data={"threshold": "0.5"})), 422)
    assert message.startswith('parts[0] (name "threshold"): not a file')
    assert rejected(parse(*prepared(data={"image": b64(PNG)})), 415)  # a form post (curl -d)


def _solid_png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height), 7).save(buf, format="PNG")
    return buf.getvalue()


def test_the_pixel_budget_counts_what_the_headers_declare():
    from workflows.tasks.image.contract import declared_pixels, over_pixel_budget

    small, big = _solid_png(30, 20), _solid_png(2000, 1000)
    assert declared_pixels(small) == 600 and declared_pixels(big) == 2_000_000
    assert declared_pixels(PNG) == 0  # no header Pillow reads: decode_image answers for it
    assert over_pixel_budget([big, small, big], 4_000_600) is None  # the budget itself is allowed
    over = over_pixel_budget([big, small, big, PNG], 4_000_599)
    assert over.status == 422 and "\n" not in over.message
    assert over.message.startswith("instances[0] to instances[2] declare 4000600 pixels in all, over the 4000599 ")
    assert "serve.max_request_pixels" in over.message


def test_an_image_request_over_the_pixel_budget_is_refused_before_any_decode():
    """127 solid 6300x6300 PNGs (6.6 MB; about 40 s of decoding): refused from their headers at once;
    the same images within the budget are decoded."""
    from workflows.tasks.image import ImageContract

    card = SimpleNamespace(**vars(CARD), image_size=8)
    contract = ImageContract(card, 256, 40_000_000, max_request_pixels=100_000_000)
    assert contract.off_loop and contract.max_body_bytes == 16 << 20  # the replica's decode threads; its 413
    big = _solid_png(6300, 6300)
    body = b"".join(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="images"; filename="{i}.png"\r\n'
                    "Content-Type: image/png\r\n\r\n".encode() + big + b"\r\n" for i in range(127))
    body += f"--{BOUNDARY}--\r\n".encode()
    t0 = time.perf_counter()
    status, message = contract.parse(MULTIPART, body)
    assert time.perf_counter() - t0 < 1.0
    assert status == 422 and message.startswith("instances[0] to instances[2] declare 119070000 pixels"), message
    small = _solid_png(300, 200)
    rows = contract.parse("image/png", small)
    assert len(rows) == 1 and rows[0]["pixels"].shape == (8, 8, 3)
    assert ImageContract(card, 256, 40_000_000, max_request_pixels=59_999).parse("image/png", small)[0] == 422

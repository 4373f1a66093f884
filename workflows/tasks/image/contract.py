"""The HTTP request side of a served image model: a /predict body's images as bytes, or the 4xx answer.

Three shapes of body, told apart by their Content-Type (any parameters, e.g. a charset, are ignored):

  application/json     {"instances": [{"image": {"b64": "<base64>"}}, ...]}  (KServe v1's shape), exactly
                       that: any other key is a 422 naming its path
  image/jpeg, image/png, image/webp
                       the body is one image file
  multipart/form-data  one file part per image, in order (any field name, e.g. `curl -F images=@a.jpg`);
                       a part without a filename (a plain form field) is a 422

Anything else, or no Content-Type, is a 415 whose message lists these. The images are returned as the
bytes of their files, in order; they are not decoded here (workflows.preprocess.images.decode_image does
that, and answers for what is not an image).

Base64: the standard (RFC 4648 section 4, `+/`) or the URL-safe (section 5, `-_`) alphabet, not both in one
string; the `=` padding may be left out (as base64url usually is). No whitespace or line breaks (`base64`
wraps its output at 76 columns unless run with -w0) and no `data:` URL prefix: both answer 422 saying so.

Limits, checked in this order and cheaply: a body over max_body_bytes is a 413 before anything is parsed
(the replica checks Content-Length before it reads the body at all: workflows.serve.guards.read_body);
more than max_instances images is a 422, as any other violation of the schema's maxItems (a JSON body is
validated by the request model the document declares, which counts the list before validating any
instance; a multipart body is parsed part by part and parsing stops at the first part over the limit, so
a body of thousands of tiny parts costs no more than max_instances + 1 of them). Then ImageContract
(workflows.tasks.image) checks the pixels the images declare in all against serve.max_request_pixels
(over_pixel_budget, from their headers) before it decodes any, off the replica's event loop.

Statuses (every message one line, naming the instance or part and never echoing more than a short
excerpt of the input):
  400  the body is not valid JSON, or not valid multipart/form-data
  413  the body is over max_body_bytes
  415  missing or unsupported Content-Type
  422  well-formed, but not a valid request: the wrong JSON structure (the message names the path, e.g.
       `instances[2].image.url: Extra inputs are not permitted`), invalid base64, an empty image
       (`instances[0]: empty image (0 bytes)`), no instances or more than max_instances, a multipart part
       that is not a file, images declaring more pixels in all than serve.max_request_pixels

Wiring, in workflows.serve.api (or a task's HTTP contract) for an image model:
    request_model, response_model = image_predict_models(card, max_instances)
    route responses: {200: ..., **error_responses(400, 401, 413, 415, 422, 431, 503)}
    openapi: with_image_request_body(generated(), "/predict", request_model, max_body_bytes=max_body_bytes)
    images = parse_image_request(request.headers.get("content-type"), await request.body(),
                                 max_instances, max_body_bytes)
    if isinstance(images, RequestError): return error_response(images.status, images.message)
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from workflows.tasks.contract import (
    classification_prediction,
    json_kind,
    quote,
    register_schema,
    rejection,
    request_model,
    response_model,
)

IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp")
JSON_TYPE = "application/json"
MULTIPART_TYPE = "multipart/form-data"
ACCEPTED_TYPES = (JSON_TYPE, *IMAGE_TYPES, MULTIPART_TYPE)

# A 1x1 PNG: what /docs pre-fills, and a body that decodes.
EXAMPLE_PNG_B64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR42mP438AAAAQBAYD718vxAAAAAElFTkSuQmCC"
EXAMPLE_INSTANCE: dict[str, Any] = {"image": {"b64": EXAMPLE_PNG_B64}}
EXAMPLE_REQUEST: dict[str, Any] = {"instances": [EXAMPLE_INSTANCE]}


@dataclass(frozen=True)
class RequestError:
    """A 4xx answer: the app sends {"error": message} with this status."""

    status: int
    message: str


# --- base64 -------------------------------------------------------------------------------------------

_NOT_B64 = re.compile(r"[^A-Za-z0-9+/\-_=]")
_URL_SAFE_TO_STANDARD = str.maketrans("-_", "+/")


def decode_b64(text: str) -> bytes:
    """The bytes `text` encodes (standard or URL-safe alphabet, padding optional); ValueError with a short
    reason otherwise."""
    if text[:5].lower() == "data:":
        raise ValueError("a data: URL; send only the base64 after its comma")
    if bad := _NOT_B64.search(text):
        c = bad.group()
        hint = "; no spaces or line breaks (base64 -w0)" if c.isspace() else ""
        raise ValueError(f"character {c!r} at offset {bad.start()}{hint}")
    url_safe = "-" in text or "_" in text
    if url_safe and ("+" in text or "/" in text):
        raise ValueError("mixes the standard (+/) and URL-safe (-_) alphabets")
    if url_safe:
        text = text.translate(_URL_SAFE_TO_STANDARD)
    if len(text) % 4 and "=" not in text:
        text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise ValueError(str(e).splitlines()[0] if str(e) else "malformed") from None


def _b64_image(value: object) -> bytes:
    if not isinstance(value, str):
        raise PydanticCustomError("b64_type", "must be a base64 string, not {kind}", {"kind": json_kind(value)})
    try:
        return decode_b64(value)
    except ValueError as e:
        raise PydanticCustomError("b64", "invalid base64 ({reason})", {"reason": str(e)}) from None


# What decode_b64 takes: one alphabet, whole 4-character groups, then 2 or 3 characters, their padding
# optional (a lone character, or "AB=", cannot be base64: a schema-driven fuzzer sent them as valid).
_B64 = "(?:{c}{{4}})*(?:{c}{{2}}(?:==)?|{c}{{3}}=?)?"
B64_PATTERN = f"^(?:{_B64.format(c='[A-Za-z0-9+/]')}|{_B64.format(c='[A-Za-z0-9_-]')})$"

B64Image = Annotated[bytes, BeforeValidator(_b64_image), WithJsonSchema({
    "type": "string", "contentEncoding": "base64", "minLength": 1, "pattern": B64_PATTERN,
    "description": "the image file (JPEG, PNG or WebP), base64: the standard or the URL-safe alphabet, "
                   "padding optional, no whitespace, no data: prefix",
})]


# --- the request models (one instance; the whole request in image_predict_models) ----------------------

class ImageB64(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    b64: B64Image


class ImageInstance(BaseModel):
    """One instance: {"image": {"b64": ...}}, nothing else; the image not empty."""

    model_config = ConfigDict(extra="forbid", strict=True)

    image: ImageB64

    @model_validator(mode="after")
    def _not_empty(self):
        if not self.image.b64:
            raise PydanticCustomError("empty_image", "empty image (0 bytes)")
        return self


def image_predict_models(card, max_instances: int) -> tuple[type[BaseModel], type[BaseModel]]:
    """(PredictRequest, PredictResponse) for the image classifier `card` describes. The request model
    holds the rules parse_image_request applies to a JSON body; the response is the text classifiers'."""
    return (_json_request_model(max_instances),
            response_model(card, classification_prediction(card.labels)))


# --- parsing --------------------------------------------------------------------------------------------

def _unsupported(content_type: str | None) -> RequestError:
    accepted = (f"{JSON_TYPE} ({json.dumps({'instances': [{'image': {'b64': '...'}}]})}), "
                f"{', '.join(IMAGE_TYPES)} (the body is one image) or {MULTIPART_TYPE} (one file part per image)")
    given = f"Content-Type {quote(content_type)} is not supported" if content_type else "no Content-Type"
    return RequestError(415, f"{given}; send {accepted}")


def parse_image_request(content_type: str | None, body: bytes, max_instances: int,
                        max_body_bytes: int) -> list[bytes] | RequestError:
    """The images of a /predict body, as the bytes of their files in order, or the 4xx answer."""
    if len(body) > max_body_bytes:
        return RequestError(413, f"request body is {len(body)} bytes; the limit is {max_body_bytes}")
    try:
        media, params = parse_options_header(content_type) if content_type else (b"", {})
    except UnicodeError:  # a header is latin-1 (as Starlette reads it): this str is not one
        return _unsupported(content_type)
    media_type = media.decode("latin-1").strip().lower()  # older python-multipart kept the case with parameters
    if media_type == JSON_TYPE:
        return _parse_json(body, max_instances)
    if media_type in IMAGE_TYPES:
        return [body] if body else RequestError(422, "instances[0]: empty image (0 bytes)")
    if media_type == MULTIPART_TYPE:
        return _parse_multipart(params.get(b"boundary"), body, max_instances)
    return _unsupported(content_type)


@lru_cache(maxsize=8)
def _json_request_model(max_instances: int) -> type[BaseModel]:
    return request_model(ImageInstance, max_instances, EXAMPLE_INSTANCE)


def _parse_json(body: bytes, max_instances: int) -> list[bytes] | RequestError:
    """Validated by the request model the document declares (workflows.tasks.contract.rejection)."""
    try:
        request: Any = _json_request_model(max_instances).model_validate_json(body)
    except ValidationError as e:
        return RequestError(*rejection(e))
    return [inst.image.b64 for inst in request.instances]


class _Reject(Exception):
    def __init__(self, error: RequestError):
        self.error = error


# python-multipart logs a warning for every malformed body; the 400 answer already says what was wrong.
_multipart_log = logging.getLogger(__name__ + ".multipart")
_multipart_log.setLevel(logging.ERROR)


def _parse_multipart(boundary: bytes | None, body: bytes, max_instances: int) -> list[bytes] | RequestError:
    if not boundary:
        return RequestError(400, "body is not valid multipart/form-data: its Content-Type has no boundary")
    images: list[bytes] = []
    headers: list[tuple[bytearray, bytearray]] = []
    chunks: list[bytes] = []
    label = ""
    ended = False

    def on_part_begin():
        if len(images) >= max_instances:  # stop here: the parts after this one are never parsed
            # 422 as the JSON body's instances over maxItems (the files' maxItems in the document)
            raise _Reject(RequestError(422, f"more than {max_instances} parts; "
                                            f"at most {max_instances} images per request"))
        headers.clear()
        chunks.clear()

    def on_header_begin():
        headers.append((bytearray(), bytearray()))

    def on_header_field(data, start, end):
        headers[-1][0].extend(data[start:end])

    def on_header_value(data, start, end):
        headers[-1][1].extend(data[start:end])

    def on_headers_finished():
        nonlocal label
        disposition = next((bytes(v) for k, v in headers if k.strip().lower() == b"content-disposition"), b"")
        kind, params = parse_options_header(disposition.decode("latin-1"))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        label = f"parts[{len(images)}] (name {quote(name)}"
        if b"filename" in params:
            label += f", filename {quote(params[b'filename'].decode('utf-8', 'replace'))})"
        else:
            label += ")"
        if kind != b"form-data" or b"filename" not in params:
            raise _Reject(RequestError(422, f"{label}: not a file (no filename in its Content-Disposition); "
                                            "send each image as a file part"))

    def on_part_data(data, start, end):
        chunks.append(data[start:end])

    def on_part_end():
        image = b"".join(chunks)
        if not image:
            raise _Reject(RequestError(422, f"{label}: empty image (0 bytes)"))
        images.append(image)

    def on_end():
        nonlocal ended
        ended = True

    callbacks = {"on_part_begin": on_part_begin, "on_header_begin": on_header_begin,
                 "on_header_field": on_header_field, "on_header_value": on_header_value,
                 "on_headers_finished": on_headers_finished, "on_part_data": on_part_data,
                 "on_part_end": on_part_end, "on_end": on_end}
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]  # a MultipartCallbacks
        parser.logger = _multipart_log
        parser.write(body)
        parser.finalize()
    except _Reject as r:
        return r.error
    except FormParserError as e:  # MultipartParseError included
        return RequestError(400, f"body is not valid multipart/form-data: {str(e).splitlines()[0]}")
    if not ended:
        return RequestError(400, "body is not valid multipart/form-data: it ends before its closing boundary")
    if not images:
        return RequestError(422, "multipart body has no parts; send one file part per image")
    return images


# --- the pixel budget -----------------------------------------------------------------------------------

def declared_pixels(data: bytes) -> int:
    """Width x height as the image's header declares them (Pillow's Image.open reads no pixel data);
    0 where Pillow finds no header: decode_image then answers for those bytes."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's bomb warning: decode_image makes it an error
            with Image.open(io.BytesIO(data)) as img:
                w, h = img.size
    except Exception:  # hostile bytes raise all sorts (and Pillow's bomb error): decode_image names them
        return 0
    return w * h


def over_pixel_budget(images: list[bytes], budget: int) -> RequestError | None:
    """A 422 when the images declare more than `budget` pixels in all, before any is decoded: what one
    request may cost the replica in decoding (a 131 KB solid PNG declares 40 Mpx, 0.3 s to decode)."""
    total = 0
    for i, data in enumerate(images):
        total += declared_pixels(data)
        if total > budget:
            return RequestError(422, f"instances[0] to instances[{i}] declare {total} pixels in all, over the "
                                     f"{budget} one request may carry (serve.max_request_pixels); send fewer or "
                                     "smaller images per request")
    return None


# --- OpenAPI --------------------------------------------------------------------------------------------

def image_error_descriptions(max_instances: int, max_body_bytes: int,
                             max_request_pixels: int | None = None) -> dict[int, str]:
    """What the image route's 400, 413, 415 and 422 answers mean (contract.ERRORS says it for text)."""
    budget = (f", images declaring more than {max_request_pixels} pixels in all (serve.max_request_pixels)"
              if max_request_pixels else "")
    return {
        400: "the body is not valid JSON (application/json) or not valid multipart/form-data",
        413: f"the body is over {max_body_bytes} bytes",
        415: f"the Content-Type is none of {', '.join(ACCEPTED_TYPES)}",
        422: "the body is well-formed but not a valid request, the message names the instance, path or part: "
             'not {"instances": [{"image": {"b64": ...}}]} exactly, invalid base64, no instances or more than '
             f"{max_instances} (serve.max_instances, the request's maxItems), an empty image, a multipart part "
             f"that is not a file{budget}; or an image that does not decode",
    }



def with_image_request_body(openapi: dict, path: str, request_model: type[BaseModel], *,
                            max_body_bytes: int | None = None, max_request_pixels: int | None = None) -> dict:
    """Declare the three body shapes of POST `path` in a FastAPI-generated OpenAPI document: JSON per
    `request_model` (with its example), one raw image, multipart files (at most the model's maxItems).
    With `max_body_bytes`, the route's declared 400/413/415/422 answers are described by
    image_error_descriptions (FastAPI wrote contract.ERRORS' text-route descriptions)."""
    ref, schema = register_schema(openapi, request_model)
    max_items = schema["properties"]["instances"].get("maxItems")
    op = openapi["paths"][path]["post"]
    if max_body_bytes is not None:
        for code, text in image_error_descriptions(max_items, max_body_bytes, max_request_pixels).items():
            if str(code) in op.get("responses", {}):
                op["responses"][str(code)]["description"] = text
    binary: dict[str, Any] = {"type": "string", "format": "binary", "minLength": 1}  # 0 bytes: a 422
    files = {"type": "array", "minItems": 1, **({"maxItems": max_items} if max_items else {}),
             "items": {**binary, "contentMediaType": "application/octet-stream"},
             "description": "one file part per image, in order (any field name; each part needs a filename)"}
    op["requestBody"] = {
        "required": True,
        "description": "the images: JSON with base64 (KServe v1), one raw image file, or multipart files",
        "content": {
            JSON_TYPE: {"schema": {"$ref": ref}, "example": schema["examples"][0]},
            **{t: {"schema": dict(binary)} for t in IMAGE_TYPES},
            MULTIPART_TYPE: {
                # `images` only: the parser takes file parts under any name, but a plain form field is a
                # 422, and a schema left open would declare such fields valid (the fuzzer sends them)
                "schema": {"type": "object", "properties": {"images": files}, "required": ["images"],
                           "additionalProperties": False},
                "encoding": {"images": {"contentType": ", ".join(IMAGE_TYPES), "headers": {
                    # the rule no part schema states: a part without a filename is a form field, a 422
                    # (a client that follows the document, schemathesis included, names its files)
                    "Content-Disposition": {
                        "description": "each part is a file: form-data with a filename",
                        "required": True,
                        "schema": {"type": "string", "pattern": "filename=",
                                   "example": 'form-data; name="images"; filename="image.png"'},
                    }}}},
            },
        },
    }
    return openapi

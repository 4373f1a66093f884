"""schemathesis hooks for fuzzing an image model's POST /predict (loaded with SCHEMATHESIS_HOOKS by
reliability.serve_openapi): the images of a schema-valid JSON request are real images.

The document states what a JSON schema can: base64 strings of the right alphabet, binary bodies,
file parts, how many. It cannot state "the bytes decode as an image", so a generated valid request
holds random bytes, which the server rightly answers 422 "not an image". Here each b64 of a positive
JSON case is replaced by a small image (PNG, JPEG or WebP) whose size and colours derive from the
string it replaces: the structure stays the fuzzer's (how many instances), the images vary, and every
such request must be answered 200. Raw and multipart bodies are sent as generated: schemathesis
re-checks an edited body against the schema and counts any binary one as schema-violating (the case
would turn negative), so their 422 "not an image" answers are told apart in the row instead
(reliability.serve_openapi.NOT_AN_IMAGE); its coverage phase sends real sample files for them too.
Negative cases are sent as generated.
"""

from __future__ import annotations

import base64
import hashlib
import io

import schemathesis
from schemathesis import GenerationMode

FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}


def image_from(seed: bytes | str, media_type: str | None = None) -> bytes:
    """A small image (1 to 48 px a side, two colours) encoded as `media_type`, all of it derived from `seed`."""
    from PIL import Image, ImageDraw

    raw = seed.encode() if isinstance(seed, str) else bytes(seed)
    h = hashlib.sha256(raw).digest()
    fmt = FORMATS.get(media_type or "") or list(FORMATS.values())[h[0] % 3]
    width, height = 1 + h[1] % 48, 1 + h[2] % 48
    img = Image.new("RGB", (width, height), tuple(h[3:6]))
    ImageDraw.Draw(img).rectangle((0, 0, width // 2, height // 2), fill=tuple(h[6:9]))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@schemathesis.hook
def map_case(context, case):
    """A positive JSON case of POST /predict: each image replaced by a real one, the instances kept."""
    if case.operation.path != "/predict" or not _positive(case.meta):
        return case
    media = (case.media_type or "").split(";")[0].strip().lower()
    if media == "application/json" and isinstance(case.body, dict):
        for inst in case.body.get("instances") or []:
            image = inst.get("image") if isinstance(inst, dict) else None  # another model's instance: as it is
            if isinstance(image, dict) and isinstance(image.get("b64"), str):
                image["b64"] = base64.b64encode(image_from(image["b64"])).decode()
    return case


def _positive(meta) -> bool:
    """Valid in every part (the coverage phase may mark one part of a case negative, not the case)."""
    return (meta is not None and meta.generation.mode is GenerationMode.POSITIVE
            and not any(c.mode.is_negative for c in meta.components.values()))


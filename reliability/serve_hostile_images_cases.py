"""The requests of serve_hostile_images (reliability.serve_hostile_images sends them): valid digits as
JSON base64, raw PNG and multipart, and the hostile images and bodies that must each be answered 4xx
with a one-line message."""

from __future__ import annotations

import base64
import json
import struct
import zlib

LABELS = ["0", "1", "2"]  # of load_digits().images[0:3]
BOUNDARY = "r3liability-b0undary"


def digit_png(i: int) -> bytes:
    """load_digits().images[i] as an 8x8 grayscale PNG, as tests/test_images_e2e.py sends it."""
    import io

    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    img = (load_digits().images[i] * 255 / 16).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_declaring(width: int, height: int) -> bytes:
    """As tests/test_images.py: a valid-looking PNG whose header declares width x height grayscale
    pixels, with two rows of data: a few hundred bytes that would ask for width*height if decoded."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * (width + 1) * 2, 9)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def _b64_json(*images: bytes | str) -> bytes:
    return json.dumps({"instances": [
        {"image": {"b64": im if isinstance(im, str) else base64.b64encode(im).decode()}} for im in images
    ]}).encode()


def _multipart(files: list[bytes], *, close: bool = True, filename: bool = True) -> bytes:
    parts = b""
    for i, data in enumerate(files):
        disposition = f'form-data; name="images"; filename="{i}.png"' if filename else 'form-data; name="images"'
        parts += (f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\nContent-Type: image/png\r\n\r\n".encode()
                  + data + b"\r\n")
    return parts + (f"--{BOUNDARY}--\r\n".encode() if close else b"")


MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


def valid_requests() -> list[dict]:
    digits = [digit_png(i) for i in range(3)]
    return [
        {"name": "JSON base64 (3 images)", "body": _b64_json(*digits), "content_type": "application/json",
         "labels": LABELS},
        {"name": "raw image/png (digit 1)", "body": digits[1], "content_type": "image/png", "labels": ["1"]},
        {"name": "multipart (3 files)", "body": _multipart(digits), "content_type": MULTIPART, "labels": LABELS},
    ]


def hostile_cases() -> list[dict]:
    """Each must be answered `status` with a one-line {"error": message} containing `says`."""
    digit = digit_png(0)
    truncated = digit[: len(digit) // 2]
    bomb = png_declaring(50_000, 50_000)  # 2.5 Gpx: over twice Pillow's limit, refused in Image.open
    cases: list[tuple[str, bytes, str | None, int, str]] = [
        # tests/test_images_e2e.py's cases
        ("not an image", b"this is text, not pixels", "image/png", 422, "instances[0]"),
        ("truncated PNG", truncated, "image/png", 422, "instances[0]"),
        ("zero bytes", b"", "image/png", 422, "empty"),
        ("decompression bomb 50,000x50,000 PNG", bomb, "image/png", 422, "pixels"),
        ("wrong content type", b"x", "text/plain", 415, "content"),
        ("missing content type", b"x", None, 415, "content"),
        ("invalid base64", _b64_json("!!!not base64!!!"), "application/json", 422, "base64"),
        ("3,000 multipart parts", _multipart([b"x"] * 3000), MULTIPART, 422, "parts"),
        ("over the 16 MiB body limit", b"\x89PNG" + b"\0" * (17 << 20), "image/png", 413, "limit"),
        # the same faults in the other body shapes, and more of them
        ("bomb as JSON base64", _b64_json(digit, bomb), "application/json", 422, "instances[1]"),
        ("bomb as a multipart part", _multipart([digit, bomb]), MULTIPART, 422, "pixels"),
        ("bomb in Pillow's warning zone 10,000x10,000", png_declaring(10_000, 10_000), "image/png", 422, "bomb"),
        ("truncated PNG as JSON base64", _b64_json(truncated), "application/json", 422, "instances[0]"),
        ("truncated PNG as a multipart part", _multipart([digit, truncated]), MULTIPART, 422, "instances[1]"),
        ("text as JSON base64", _b64_json(b"not an image at all"), "application/json", 422, "instances[0]"),
        ("PNG signature only", digit[:8], "image/png", 422, "instances[0]"),
        ("JPEG start marker only", b"\xff\xd8\xff\xe0", "image/jpeg", 422, "instances[0]"),
        ("data: URL in base64", _b64_json("data:image/png;base64," + base64.b64encode(digit).decode()),
         "application/json", 422, "data:"),
        ("empty base64", _b64_json(""), "application/json", 422, "empty"),
        ("257 instances", _b64_json(*[digit] * 257), "application/json", 422, "257"),
        ("not JSON", b"{not json", "application/json", 400, "JSON"),
        ("multipart without a boundary", _multipart([digit]), "multipart/form-data", 400, "boundary"),
        ("multipart cut before its closing boundary", _multipart([digit], close=False), MULTIPART, 400, "ends"),
        ("multipart part without a filename", _multipart([digit], filename=False), MULTIPART, 422, "not a file"),
        ("multipart part of zero bytes", _multipart([digit, b""]), MULTIPART, 422, "empty"),
    ]
    return [{"name": n, "body": b, "content_type": t, "status": s, "says": w} for n, b, t, s, w in cases]

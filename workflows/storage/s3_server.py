"""The embedded endpoint's process: moto's S3 server, with its traffic counted at the endpoint.

`python -m workflows.storage.s3_server -H 127.0.0.1 -p PORT` serves moto's WSGI app as
`python -m moto.server` does, wrapped in a small WSGI middleware that counts requests and bytes
per method, with ranged GETs reading only their bytes (serve_ranges_from_the_object_file), and
with conditional PUTs atomic (conditional_puts_are_atomic).
Benchmarks and tests read the counts at `GET /_workflows/traffic` (and zero them with
`POST /_workflows/traffic/reset`), so "0 bytes fetched from the object store" is measured where
the bytes leave the store, not by the cache that claims to have saved them.

# why by hand: moto has no request accounting, and a counting proxy in front of it would add a
# second HTTP hop to every benchmark measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import threading
from collections import defaultdict

TRAFFIC_PATH = "/_workflows/traffic"


class TrafficCounter:
    """WSGI middleware: requests, body bytes in and out, per HTTP method (bucket GETs as LIST)."""

    def __init__(self, app):
        self.app = app
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.requests: dict[str, int] = defaultdict(int)
        self.bytes_out: dict[str, int] = defaultdict(int)
        self.bytes_in: dict[str, int] = defaultdict(int)

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "bytes_out": dict(self.bytes_out), "bytes_in": dict(self.bytes_in)}

    def _add(self, table: dict, method: str, n: int) -> None:
        with self._lock:
            table[method] += n

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path.startswith(TRAFFIC_PATH):
            if environ["REQUEST_METHOD"] == "POST" and path.endswith("/reset"):
                with self._lock:
                    self._reset()
            body = json.dumps(self.snapshot()).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        method = environ.get("REQUEST_METHOD", "GET")
        if method == "GET" and "/" not in path.strip("/"):  # path-style /bucket: a listing, not an object
            method = "LIST"
        self._add(self.requests, method, 1)
        self._add(self.bytes_in, method, int(environ.get("CONTENT_LENGTH") or 0))
        return self._count_out(self.app(environ, start_response), method)

    def _count_out(self, chunks, method: str):
        try:
            for chunk in chunks:
                self._add(self.bytes_out, method, len(chunk))
                yield chunk
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()


_RANGE = threading.local()  # .start: where the ranged GET served on this thread starts
_SIMPLE_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class _ObjectSlices:
    """What a ranged GET's key.value becomes: its length, and reads of only the slice asked for."""

    def __init__(self, key):
        self.key = key

    def __len__(self) -> int:
        return self.key.size

    def __getitem__(self, part: slice) -> bytes:
        with self.key.lock:
            self.key._value_buffer.seek(part.start)
            return self.key._value_buffer.read(part.stop - part.start)


def serve_ranges_from_the_object_file() -> None:
    """Make moto read only the bytes a ranged GET asks for, as S3 does.

    # why by hand: moto 5.2 answers a ranged GET by reading the WHOLE object from its spooled file
    # (FakeKey.value) and slicing it, so a download in 8 MB ranges (s3transfer's, ours and
    # MosaicML Streaming's) of a 125 MB object reads 16 x 125 MB, mostly system CPU taken from
    # the decode processes on a small machine (`python -m benchmarks.images --tag cold`: the index build
    # read 1 GB in 7.9 s before this, 4.8 s after; #37). That is an emulator cost S3 does not
    # have, and it fell on every benchmark row that downloads by ranges. Only a range
    # moto will slice is served this way: `bytes=a-b` or `bytes=a-` starting inside the object;
    # its preconditions (If-Match) and headers are moto's own."""
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    if getattr(S3Response.key_response, "_slices", False):
        return
    whole: property = FakeKey.__dict__["value"]

    def value(key):
        start = getattr(_RANGE, "start", None)
        if start is not None and start < key.size:  # else moto answers 416, or the whole object
            return _ObjectSlices(key)
        return whole.fget(key)

    def key_response(self, request, full_url, headers):
        m = _SIMPLE_RANGE.fullmatch(request.headers.get("range", "")) if request.method == "GET" else None
        if m and (not m.group(2) or int(m.group(2)) >= int(m.group(1))) and "partNumber=" not in full_url:
            _RANGE.start = int(m.group(1))
        try:
            return plain(self, request, full_url, headers)
        finally:
            _RANGE.start = None

    plain = S3Response.key_response
    key_response._slices = True  # type: ignore[attr-defined]
    FakeKey.value = property(value, whole.fset)  # type: ignore[assignment]
    S3Response.key_response = key_response  # type: ignore[method-assign]


_CONDITIONAL_PUT = threading.Lock()


def conditional_puts_are_atomic() -> None:
    """Make a conditional PUT (If-None-Match, If-Match) check and write in one step, as S3 does.

    # why by hand: moto 5.2 looks the key up, then stores the object, with nothing between them, and
    # the server answers requests on threads: two PUTs with If-None-Match: * racing for one key
    # could both find it absent and both succeed, where S3 answers the second 412. The registry
    # claims a version that way (workflows.registry.register)."""
    from moto.s3.responses import S3Response

    if getattr(S3Response.put_object, "_atomic", False):
        return
    plain = S3Response.put_object

    def put_object(self):
        if "If-None-Match" in self.headers or "If-Match" in self.headers:
            with _CONDITIONAL_PUT:
                return plain(self)
        return plain(self)

    put_object._atomic = True  # type: ignore[attr-defined]
    S3Response.put_object = put_object  # type: ignore[method-assign]


def die_with_parent(parent: int) -> None:
    """Get SIGKILL when the thread that started this process ends (PR_SET_PDEATHSIG), or exit now if
    `parent` is gone already. Armed here, not in a preexec_fn: Popen with one forks the whole parent,
    running every at-fork handler in it: in a Ray driver, gRPC's are the suspects of GCS requests lost for ever."""
    import ctypes
    import sys

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass
    if os.getppid() != parent:  # it died before the signal was armed
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    parser.add_argument("--parent", type=int, help="the process whose death ends this server (Linux)")
    args = parser.parse_args(argv)
    if args.parent:
        die_with_parent(args.parent)
    os.environ.setdefault("MOTO_PORT", str(args.port))  # moto builds some URLs from it
    # Its parent persists the objects, then kills it (and PR_SET_PDEATHSIG kills it with the parent):
    # a Ctrl-C or SIGTERM to the whole process group or cgroup must not end it before that.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve_ranges_from_the_object_file()
    conditional_puts_are_atomic()
    app = TrafficCounter(DomainDispatcherApplication(create_backend_app))
    run_simple(args.host, args.port, app, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()

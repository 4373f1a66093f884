"""The embedded endpoint's process: moto's S3 server, with its traffic counted at the endpoint.

`python -m workflows.storage.s3_server -H 127.0.0.1 -p PORT` serves moto's WSGI app exactly as
`python -m moto.server` does, wrapped in a small WSGI middleware that counts requests and bytes
per method. Benchmarks and tests read the counts at `GET /_workflows/traffic` (and zero them with
`POST /_workflows/traffic/reset`), so "0 bytes fetched from the object store" is measured where
the bytes leave the store, not by the cache that claims to have saved them.

# why by hand: moto has no request accounting, and a counting proxy in front of it would add a
# second HTTP hop to every benchmark measurement.
"""

from __future__ import annotations

import argparse
import json
import os
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


def main(argv: list[str] | None = None) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))  # moto builds some URLs from it
    # Its parent persists the objects, then kills it (and PR_SET_PDEATHSIG kills it with the parent):
    # a Ctrl-C or SIGTERM to the whole process group or cgroup must not end it before that.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    app = TrafficCounter(DomainDispatcherApplication(create_backend_app))
    run_simple(args.host, args.port, app, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()

"""A second S3 endpoint whose behaviour a test sets: moto's server on 127.0.0.1 behind a small WSGI
middleware that answers conditional PUTs (If-None-Match) as the test asks. Real HTTP, with boto3 and
s3fs on the client side, as against AWS or MinIO.

- `conflicts = N`: the next N conditional PUTs get 409 ConditionalRequestConflict (AWS's answer to
  conditional writes racing for one key), with S3's XML error body;
- `ignore_if_none_match = True`: the header is dropped before moto sees the request, as by a store
  that does not implement it (older MinIO, some S3-compatible stores): every PUT overwrites.

moto's state is per process, shared with any other moto server of the process: tests give their
buckets unique names.
"""

from __future__ import annotations

import threading
from collections import Counter

_CONFLICT = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ConditionalRequestConflict</Code>'
             b"<Message>A conditional request to this object is in progress; retry the request</Message>"
             b"<RequestId>0</RequestId></Error>")


class S3Behaviour:
    """WSGI middleware in front of moto's app; its attributes are the behaviour, set at any time."""

    def __init__(self, app):
        self.app = app
        self.conflicts = 0
        self.ignore_if_none_match = False
        self.seen: Counter[str] = Counter()  # "conditional PUT", "409", "PUT", ...
        self._lock = threading.Lock()

    def __call__(self, environ, start_response):
        method = environ.get("REQUEST_METHOD", "GET")
        self.seen[method] += 1
        if method == "PUT" and "HTTP_IF_NONE_MATCH" in environ:
            self.seen["conditional PUT"] += 1
            with self._lock:
                conflict = self.conflicts > 0
                self.conflicts -= conflict
            if conflict:
                self.seen["409"] += 1
                environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
                start_response("409 Conflict", [("Content-Type", "application/xml"),
                                                ("Content-Length", str(len(_CONFLICT)))])
                return [_CONFLICT]
            if self.ignore_if_none_match:
                del environ["HTTP_IF_NONE_MATCH"]
        return self.app(environ, start_response)


class BehaviourStore:
    """`with BehaviourStore() as store:` moto's server on a free port of 127.0.0.1, `store.behaviour`
    in front of it; `store.url` its endpoint."""

    def __init__(self):
        self.behaviour: S3Behaviour | None = None
        self._server = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BehaviourStore:
        import logging

        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
        self.behaviour = S3Behaviour(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, self.behaviour, threaded=True, request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def context(self):
        """The StorageContext of this endpoint (moto takes any key)."""
        from workflows.storage.uri import StorageContext

        return StorageContext(endpoint_url=self.url, region="us-east-1", embedded=True)

    def __exit__(self, *exc) -> None:
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._thread.join(30)

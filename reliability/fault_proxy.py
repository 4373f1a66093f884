"""A fault-injecting HTTP/1.1 forwarding proxy for an S3-compatible endpoint, on 127.0.0.1.

Clients (boto3, s3transfer, s3fs/aiobotocore) are pointed at the proxy as their `endpoint_url`;
it forwards each request to the real endpoint and, for a seeded random share of them, answers
the way an object store under stress does instead:

- ``slowdown``: ``503 SlowDown`` with S3's XML error body (the request never reaches the store);
- ``slow``: the real response, after a delay;
- ``reset_before``: the connection is reset (RST) before any response byte;
- ``reset_mid``: the status line, headers and part of the body are sent, then the connection is
  reset: a truncated response under a Content-Length that promised more;
- ``outage()``: the listening socket closes and every open connection is reset, as when the
  endpoint process or the network path to it dies; later connections are refused.

An optional bandwidth cap (``throttle_bytes_per_s``, per response) makes downloads slow enough
for a test to kill a process in the middle of one.

# why by hand: no library offers S3-aware fault injection. Generic TCP fault proxies (toxiproxy)
# are separate binaries that cannot be installed here, know nothing of S3 error bodies, and
# mitmproxy-style tools are heavy and not in the pinned environment; this is ~200 lines of
# stdlib (http.server + http.client) and needs nothing else.
"""

from __future__ import annotations

import http.client
import random
import socket
import socketserver
import struct
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
              "te", "trailer", "trailers", "transfer-encoding", "upgrade", "expect"}
FAULTS = ("slowdown", "slow", "reset_before", "reset_mid")


def slowdown_body(path: str) -> bytes:
    rid = uuid.uuid4().hex[:16].upper()
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            f"<Message>Please reduce your request rate.</Message><Resource>{_xml(path)}</Resource>"
            f"<RequestId>{rid}</RequestId><HostId>fault-proxy</HostId></Error>").encode()


def _xml(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class _Reset(Exception):
    """The handler reset its client connection on purpose: stop handling it."""


class FaultProxy:
    def __init__(self, upstream: str, *, seed: int = 0, slowdown: float = 0.0, slow: float = 0.0,
                 reset_before: float = 0.0, reset_mid: float = 0.0, slow_s: tuple[float, float] = (0.2, 1.0),
                 throttle_bytes_per_s: float | None = None, chunk: int = 16 * 1024):
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.rates = {"slowdown": slowdown, "slow": slow, "reset_before": reset_before, "reset_mid": reset_mid}
        if sum(self.rates.values()) > 1:
            raise ValueError(f"fault rates add up to more than 1: {self.rates}")
        self.slow_s = slow_s
        self.throttle = throttle_bytes_per_s
        self.chunk = chunk
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: Counter = Counter()  # requests, forwarded, each fault kind, upstream_error
        self.methods: Counter = Counter()
        self.access_keys: Counter = Counter()  # the access key ids requests were signed with (SigV4 Credential=)
        self.enabled = True  # False: forward everything untouched (set-up traffic)
        self.down = False
        self._conns: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> str:
        self._server = _Server(("127.0.0.1", 0), _Handler, self)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fault-proxy", daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._reset_all()

    def outage(self) -> None:
        """The endpoint goes away: no new connections, and every open one is reset (responses
        being streamed stop where they are)."""
        self.down = True
        self.stop()

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def injected(self) -> int:
        return sum(self.counts[f] for f in FAULTS)

    # -- internals -------------------------------------------------------------------------
    def _decide(self, method: str) -> str | None:
        with self._lock:
            self.counts["requests"] += 1
            self.methods[method] += 1
            if not self.enabled:
                return None
            x, acc = self._rng.random(), 0.0
            for kind in FAULTS:
                acc += self.rates[kind]
                if x < acc:
                    self.counts[kind] += 1
                    return kind
            return None

    def _delay(self) -> float:
        with self._lock:
            return self._rng.uniform(*self.slow_s)

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _count_key(self, key_id: str) -> None:
        with self._lock:
            self.access_keys[key_id] += 1

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def _reset_all(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _rst(c)


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, addr, handler, proxy: FaultProxy):
        self.proxy = proxy
        super().__init__(addr, handler)

    def handle_error(self, request, client_address) -> None:  # resets are the point; stay quiet
        pass


def _rst(conn: socket.socket) -> None:
    """Reset a connection: SO_LINGER 0, so that its close sends a TCP RST rather than a FIN.

    The handler's rfile/wfile keep the descriptor open after conn.close(), so shutdown() first:
    it takes effect at once, and the handler's next read or write fails; its finish() then
    closes the descriptor for good.
    """
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        conn.close()
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.proxy = self.server.proxy
        self.proxy._track(self.connection, True)
        self._upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        finally:
            self.proxy._track(self.connection, False)
            if self._upstream is not None:
                self._upstream.close()

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (_Reset, OSError):
            self.close_connection = True

    def log_message(self, format, *args) -> None:
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        _rst(self.connection)
        raise _Reset

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        for attempt in range(2):  # a kept-alive upstream connection may have been closed meanwhile
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.proxy.upstream, timeout=120)
            try:
                self._upstream.request(self.command, self.path, body=body or None, headers=headers)
                resp = self._upstream.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            except (OSError, http.client.HTTPException):
                self._upstream.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _proxy(self) -> None:
        body = self._read_body()
        auth = self.headers.get("Authorization", "")
        if "Credential=" in auth:
            self.proxy._count_key(auth.split("Credential=", 1)[1].split("/", 1)[0])
        fault = self.proxy._decide(self.command)
        if fault == "slowdown":
            err = slowdown_body(self.path.split("?", 1)[0])
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(err)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(err)
            return
        if fault == "reset_before":
            self._reset()
        try:
            status, reason, headers, data = self._forward(body)
        except (OSError, http.client.HTTPException):
            self.proxy._count("upstream_error")  # the endpoint is gone: so is this connection
            self._reset()
        self.proxy._count("forwarded")
        if fault == "slow":
            time.sleep(self.proxy._delay())
        head = [f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")]
        for k, v in headers:
            if k.lower() in HOP_BY_HOP or (k.lower() == "content-length" and self.command != "HEAD"):
                continue
            head.append(f"{k}: {v}\r\n".encode("latin-1"))
        if self.command != "HEAD":
            head.append(f"Content-Length: {len(data)}\r\n".encode())
        head.append(b"\r\n")
        head_bytes = b"".join(head)
        if fault == "reset_mid":
            if data and self.command != "HEAD":
                self.wfile.write(head_bytes + data[: len(data) // 2])
            else:
                self.wfile.write(head_bytes[: len(head_bytes) // 2])
            self.wfile.flush()
            self._reset()
        self.wfile.write(head_bytes)
        if self.command == "HEAD" or not data:
            return
        if self.proxy.throttle:
            step = self.proxy.chunk
            for i in range(0, len(data), step):
                if self.proxy.down:
                    self._reset()
                self.wfile.write(data[i:i + step])
                self.wfile.flush()
                time.sleep(len(data[i:i + step]) / self.proxy.throttle)
        else:
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _proxy


__all__ = ["FaultProxy", "FAULTS", "slowdown_body"]

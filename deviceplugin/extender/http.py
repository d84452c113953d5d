"""The extender's HTTP(S) server: POST /filter and /prioritize, GET /metrics, /healthz and /readyz.

Bounded against any client in the cluster: a fixed pool of worker threads with a short queue (503 when full); with
TLS (`tls`, tls.py), the handshake must be done within `read_timeout` in all, in a worker, never in the accepting
thread; a request head must arrive whole within `read_timeout` (the wait for the next request on a kept-alive
connection included) and its body within `read_timeout` more, however slowly it drips; while connections wait for a
worker, a worker still waiting for a handshake or a request head gives its connection up after `EVICT_AFTER` seconds;
with a client CA, a POST without a verified client certificate is answered 401 (403 for a name not allowed) before
its body is read, so it reserves nothing; a body must declare its Content-Length (411 otherwise, chunked included)
and is refused unread over `max_body` (413); the bodies being read and answered at once hold at most `max_in_flight`
bytes (503 when a body cannot get its share within `read_timeout`), so parsed JSON cannot exhaust memory; a response
must be taken within `write_timeout`.
"""

from __future__ import annotations

import io
import json
import logging
import math
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .inputs import InputError
from .metrics import ExtenderMetrics
from .tls import ServerTLS
from .verbs import Extender

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024  # a Pod (etcd keeps at most 1.5 MiB) plus 50,000 node names of 50 characters
MAX_IN_FLIGHT_BYTES = MAX_BODY_BYTES  # JSON parsed from a body can take ~20x its size: bounded by this, not by clients
READ_TIMEOUT = 5.0  # kube-scheduler's httpTimeout: an answer later than that is of no use to it
WRITE_TIMEOUT = 10.0
EVICT_AFTER = 0.2  # seconds a worker waits for a request head while other connections wait for a worker
_POLL = 0.05  # how often a worker waiting for a request head looks at the queue


class _Deadline(io.RawIOBase):
    """A connection's reads, each phase (a request head, a body) bounded in all, not per read: a byte every few
    seconds does not keep a worker. Waiting for a head, it gives the connection up when others wait for a worker."""

    def __init__(self, sock: socket.socket, crowded: Callable[[], bool]) -> None:
        self.sock = sock
        self.crowded = crowded
        self.deadline = math.inf
        self.head = False
        self.since = 0.0

    def phase(self, head: bool, seconds: float) -> None:
        self.head, self.since = head, time.monotonic()
        self.deadline = self.since + seconds

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        while True:
            now = time.monotonic()
            if now >= self.deadline:
                raise TimeoutError("the client was too slow")
            self.sock.settimeout(min(self.deadline - now, _POLL) if self.head else self.deadline - now)
            try:
                return self.sock.recv_into(buffer)
            except TimeoutError:
                if self.head and now - self.since >= EVICT_AFTER and self.crowded():
                    raise TimeoutError("other connections wait for a worker") from None


class _Budget:
    """Bytes of request bodies being read and answered at once; `take` waits for its share up to a timeout."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._changed = threading.Condition()

    def take(self, size: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.used + size <= self.limit, timeout) and self._add(size)

    def _add(self, size: int) -> bool:
        self.used += size
        return True

    def give(self, size: int) -> None:
        with self._changed:
            self.used -= size
            self._changed.notify_all()


class ExtenderHTTPServer:
    def __init__(
        self,
        extender: Extender,
        metrics: ExtenderMetrics,
        ready: Callable[[], tuple[bool, str]],
        port: int,
        host: str = "0.0.0.0",
        workers: int = 8,
        backlog: int = 64,
        read_timeout: float = READ_TIMEOUT,
        max_body: int = MAX_BODY_BYTES,
        max_in_flight: int = MAX_IN_FLIGHT_BYTES,
        write_timeout: float = WRITE_TIMEOUT,
        tls: ServerTLS | None = None,
    ) -> None:
        budget = _Budget(max(max_in_flight, max_body))
        crowded = lambda: self.httpd.crowded()  # noqa: E731
        verbs: dict[str, tuple[str, Callable[[dict], object]]] = {
            "/filter": ("filter", extender.filter),
            "/prioritize": ("prioritize", extender.prioritize),
            "/all/filter": ("all-filter", lambda args: extender.filter(args, every_pod=True)),
            "/all/prioritize": ("all-prioritize", lambda args: extender.prioritize(args, every_pod=True)),
        }

        class Handler(BaseHTTPRequestHandler):
            timeout = read_timeout
            protocol_version = "HTTP/1.1"  # keep-alive: kube-scheduler reuses its connection
            disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall between them

            def log_message(self, *args) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                self.rfile.close()  # the socket stays open: reads go through the deadline instead
                self.reader = _Deadline(self.connection, crowded)
                self.rfile = io.BufferedReader(self.reader)

            def handle_one_request(self) -> None:
                self.reader.phase(head=True, seconds=read_timeout)  # the wait for a request and its head
                super().handle_one_request()

            def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.connection.settimeout(write_timeout)
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _text(self, status: int, text: str) -> None:
                self._send(status, (text + "\n").encode(), "text/plain; charset=utf-8")

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/metrics":
                    return self._send(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
                if path == "/healthz":
                    return self._text(200, "ok")
                if path == "/readyz":
                    ok, why = ready()
                    return self._text(200 if ok else 503, why)
                self._text(404, "not found: POST /filter or /prioritize; GET /metrics, /healthz or /readyz")

            def do_POST(self) -> None:
                refused = tls.refusal(self.connection) if tls is not None else None
                if refused is not None:
                    self.close_connection = True  # the body is never read
                    metrics.unauthenticated.labels("no-certificate" if refused[0] == 401 else "name").inc()
                    return self._text(*refused)
                path = self.path.split("?")[0]
                if path not in verbs:
                    return self._text(404, "not found: POST /filter, /prioritize, /all/filter or /all/prioritize")
                verb, handle = verbs[path]
                started = time.perf_counter()
                try:
                    if "Transfer-Encoding" in self.headers:
                        raise ValueError
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self.close_connection = True
                    metrics.requests.labels(verb, "error").inc()
                    return self._text(411, "Content-Length is required (no Transfer-Encoding)")
                if length < 0 or length > max_body:
                    self.close_connection = True  # the body is never read
                    metrics.requests.labels(verb, "error").inc()
                    return self._text(413, f"request body of {length} bytes is over the {max_body} byte limit")
                self.reader.phase(head=False, seconds=read_timeout)
                if not budget.take(length, read_timeout):
                    self.close_connection = True
                    metrics.requests.labels(verb, "error").inc()
                    return self._text(
                        503, f"busy: other request bodies hold the {budget.limit} bytes served at once; retry"
                    )
                try:
                    answer = handle(json.loads(self.rfile.read(length)))
                except (ValueError, InputError) as err:  # JSON errors are ValueErrors too
                    metrics.requests.labels(verb, "error").inc()
                    return self._text(400, f"bad {verb} request: {err}")
                finally:
                    budget.give(length)
                body = json.dumps(answer, separators=(",", ":")).encode()
                metrics.requests.labels(verb, "ok").inc()
                metrics.latency.labels(verb).observe(time.perf_counter() - started)
                self._send(200, body)

        handshake = None
        if tls is not None:

            def handshake(sock: socket.socket) -> socket.socket:
                try:
                    return tls.handshake(
                        sock, read_timeout, lambda waited: waited >= EVICT_AFTER and self.httpd.crowded()
                    )
                except ssl.SSLError:
                    metrics.unauthenticated.labels(
                        "handshake"
                    ).inc()  # not TLS, or a certificate the client CA did not sign
                    raise

        self.tls = tls
        self.httpd: _PooledHTTPServer = _PooledHTTPServer((host, port), Handler, workers, backlog, handshake)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="extender-http", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> None:
        self.httpd.start_workers()
        self._thread.start()
        how = (
            "HTTP"
            if self.tls is None
            else "HTTPS, " + ("client certificates" if self.tls.settings.authenticates else "no client authentication")
        )
        log.info(
            "extender on %s:%d, %s (POST /filter, /prioritize; GET /metrics, /healthz, /readyz)",
            self.httpd.server_address[0],
            self.port,
            how,
        )

    def stop(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.stop_workers()
        self.httpd.server_close()


class _PooledHTTPServer(HTTPServer):
    """An HTTPServer whose connections are served by a fixed pool of threads; a full queue refuses with 503.
    `handshake`: what a worker does first with each connection (TLS), in place of the plain socket."""

    def __init__(
        self,
        address,
        handler,
        workers: int,
        backlog: int,
        handshake: Callable[[socket.socket], socket.socket] | None = None,
    ) -> None:
        super().__init__(address, handler)
        self.handshake = handshake
        self.workers = workers
        self._queue: queue.Queue = queue.Queue(maxsize=backlog)
        self._threads: list[threading.Thread] = []

    def start_workers(self) -> None:
        for i in range(self.workers):
            thread = threading.Thread(target=self._work, name=f"extender-worker-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def crowded(self) -> bool:
        """Connections wait for a worker."""
        return not self._queue.empty()

    def stop_workers(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=5)

    def process_request(self, request, client_address) -> None:
        try:
            self._queue.put_nowait((request, client_address))
        except queue.Full:
            if self.handshake is None:  # with TLS, plain text would be garbage to the client: the close says it all
                try:
                    request.sendall(
                        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                except OSError:
                    pass
            self.shutdown_request(request)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            request, address = item
            try:
                if self.handshake is not None:
                    request = self.handshake(request)  # the plain socket is detached from then on
                self.finish_request(request, address)
            except (TimeoutError, OSError):
                pass  # the client went away, was too slow, or failed the TLS handshake (ssl.SSLError)
            except Exception:
                log.exception("extender request from %s failed", address)
            finally:
                self.shutdown_request(request)

"""The extender's HTTP server: POST /filter and /prioritize, GET /metrics, /healthz and /readyz.

Bounded: a fixed pool of worker threads with a short queue (503 when full), a request body limit (413),
and a socket timeout so a slow or stuck client cannot hold a worker.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .inputs import InputError
from .metrics import ExtenderMetrics
from .verbs import Extender

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024  # a Pod plus 50,000 node names fits easily


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
        read_timeout: float = 10.0,
        max_body: int = MAX_BODY_BYTES,
    ) -> None:
        verbs: dict[str, tuple[str, Callable[[dict], object]]] = {
            "/filter": ("filter", extender.filter), "/prioritize": ("prioritize", extender.prioritize),
            "/all/filter": ("all-filter", lambda args: extender.filter(args, every_pod=True)),
            "/all/prioritize": ("all-prioritize", lambda args: extender.prioritize(args, every_pod=True)),
        }

        class Handler(BaseHTTPRequestHandler):
            timeout = read_timeout  # socket timeout for every read and write
            protocol_version = "HTTP/1.1"  # keep-alive: kube-scheduler reuses its connection
            disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall between them

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
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
                path = self.path.split("?")[0]
                if path not in verbs:
                    return self._text(404, "not found: POST /filter, /prioritize, /all/filter or /all/prioritize")
                verb, handle = verbs[path]
                started = time.perf_counter()
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self.close_connection = True
                    return self._text(411, "Content-Length is required")
                if length < 0 or length > max_body:
                    self.close_connection = True
                    metrics.requests.labels(verb, "error").inc()
                    return self._text(413, f"request body of {length} bytes is over the {max_body} byte limit")
                try:
                    answer = handle(json.loads(self.rfile.read(length)))
                except (ValueError, InputError) as err:  # JSON errors are ValueErrors too
                    metrics.requests.labels(verb, "error").inc()
                    return self._text(400, f"bad {verb} request: {err}")
                body = json.dumps(answer, separators=(",", ":")).encode()
                metrics.requests.labels(verb, "ok").inc()
                metrics.latency.labels(verb).observe(time.perf_counter() - started)
                self._send(200, body)

        self.httpd = _PooledHTTPServer((host, port), Handler, workers, backlog)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="extender-http", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> None:
        self.httpd.start_workers()
        self._thread.start()
        log.info("extender on :%d (POST /filter, /prioritize; GET /metrics, /healthz, /readyz)", self.port)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.stop_workers()
        self.httpd.server_close()


class _PooledHTTPServer(HTTPServer):
    """An HTTPServer whose connections are served by a fixed pool of threads; a full queue refuses with 503."""

    def __init__(self, address, handler, workers: int, backlog: int) -> None:
        super().__init__(address, handler)
        self.workers = workers
        self._queue: queue.Queue = queue.Queue(maxsize=backlog)
        self._threads: list[threading.Thread] = []

    def start_workers(self) -> None:
        for i in range(self.workers):
            thread = threading.Thread(target=self._work, name=f"extender-worker-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop_workers(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=5)

    def process_request(self, request, client_address) -> None:
        try:
            self._queue.put_nowait((request, client_address))
        except queue.Full:
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
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
                self.finish_request(request, address)
            except (TimeoutError, OSError):
                pass  # the client went away or was too slow
            except Exception:
                log.exception("extender request from %s failed", address)
            finally:
                self.shutdown_request(request)

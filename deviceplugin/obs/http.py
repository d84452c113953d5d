"""The metrics endpoint: /metrics, /healthz and /readyz over HTTP/1.1, bounded against whatever the network sends.

The port is reachable from the whole cluster, so no client may cost the node more than a fixed amount. One thread
serves every connection (asyncio): an idle connection costs a socket and a few KiB, not a thread. At most
`max_connections` are open; a newcomer beyond that closes, of the client address holding the most connections,
the one that has waited longest without sending a complete request (so slowloris connections crowd out each
other, not the scraper), or gets 503 when every connection is busy being answered. A request head must arrive within
`read_timeout` seconds in all and fit `max_head_bytes`; bodies are refused; a response must be taken within
`write_timeout`. What was dropped is counted in `gpushare_metrics_connections_dropped_total{reason}`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .. import defaults
from ..errors import StartupError
from .metrics import exposed_registry

log = logging.getLogger(__name__)

TEXT = "text/plain; charset=utf-8"
DROP_REASONS = ("busy", "evicted", "timeout", "too_large", "bad_request")
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class MetricsError(StartupError):
    """The endpoint cannot listen (port taken, no permission, no such address)."""


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 64
    read_timeout: float = 5.0  # for a whole request head, and the longest wait for the next request on a connection
    write_timeout: float = 10.0  # for a client to take a response
    max_head_bytes: int = 8192  # request line and headers


@dataclass
class _Connection:
    peer: str  # the client's address
    idle: bool = True  # waiting for a request


@dataclass(frozen=True)
class _Answer:
    status: int
    body: bytes
    content_type: str = TEXT
    keep_alive: bool = False
    head_only: bool = False
    allow: str | None = None


class MetricsServer:
    """Serves `registry` at /metrics (every series labelled `node` when one is given), and `healthz()` / `readyz()`
    (ok, text) at /healthz and /readyz. The server's own counters are registered in `registry` too."""

    def __init__(
        self,
        registry: CollectorRegistry,
        healthz: Callable[[], tuple[bool, str]],
        readyz: Callable[[], tuple[bool, str]],
        port: int = defaults.METRICS_PORT,
        host: str = "0.0.0.0",
        limits: HttpLimits = HttpLimits(),
        node: str | None = None,
    ) -> None:
        self.registry = registry
        self.healthz = healthz
        self.readyz = readyz
        self.host = host
        self.limits = limits
        self.last_scrape_seconds = 0.0
        self.dropped = Counter(
            "gpushare_metrics_connections_dropped",
            "Metrics connections closed by the server: busy (503), evicted (idle while full), timeout, "
            "too_large, bad_request.",
            ["reason"],
            registry=registry,
        )
        for reason in DROP_REASONS:
            self.dropped.labels(reason)  # every series exists from the first scrape
        self._exposed = exposed_registry(registry, node or None)
        self._sock = _listen(host, port)
        self._connections: dict[asyncio.StreamWriter, _Connection] = {}  # oldest first
        self._refusing = 0  # connections answered 503, waiting for the client to close
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="metrics", daemon=True)

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        log.info("metrics on %s:%d (/metrics, /healthz, /readyz)", self.host, self.port)

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join()
            self._loop = None
        self._sock.close()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._connection, sock=self._sock, limit=self.limits.max_head_bytes)
        self._ready.set()
        await self._stopping.wait()
        server.close()
        for writer in list(self._connections):
            writer.transport.abort()
        await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.limits.max_connections and not self._evict_idle():
            self.dropped.labels("busy").inc()
            await self._refuse_busy(reader, writer)
            return
        self._connections[writer] = _Connection(_peer(writer))
        try:
            await self._requests(reader, writer)
            await self._linger(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away, or was evicted
        except TimeoutError:
            self.dropped.labels("timeout").inc()  # a client that does not take its answer
        finally:
            del self._connections[writer]
            writer.transport.abort()

    async def _refuse_busy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """503 and close; at most max_connections refused connections linger at once, others are just closed."""
        if self._refusing >= self.limits.max_connections:
            writer.transport.abort()
            return
        self._refusing += 1
        try:
            writer.write(_encode(_Answer(503, b"too many connections\n")))
            await self._linger(reader, writer)
        except ConnectionError:
            pass
        finally:
            self._refusing -= 1
            writer.transport.abort()

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """End the answer (FIN), then drop what the client still sends until it closes, a second at most: closing a
        socket with unread input resets the connection, and the client would lose the answer."""
        writer.write_eof()
        deadline = time.monotonic() + min(1.0, self.limits.read_timeout)
        try:
            while await asyncio.wait_for(
                reader.read(self.limits.max_head_bytes), max(0.0, deadline - time.monotonic())
            ):
                pass
        except TimeoutError:
            pass

    def _evict_idle(self) -> bool:
        """Close the longest-waiting idle connection of the address with the most; False when none is idle."""
        idle = [(w, c.peer) for w, c in self._connections.items() if c.idle]
        if not idle:
            return False
        per_peer = Tally(peer for _, peer in idle)
        heaviest = max(per_peer, key=per_peer.__getitem__)
        oldest = next(w for w, peer in idle if peer == heaviest)
        self._connections[oldest].idle = False  # aborted below; not chosen again
        oldest.transport.abort()
        self.dropped.labels("evicted").inc()
        return True

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer requests on one connection until it closes, goes quiet or sends something unacceptable."""
        served = 0
        while True:
            self._connections[writer].idle = True
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.limits.read_timeout)
            except TimeoutError:
                if not served:  # a keep-alive connection going quiet between scrapes is normal
                    self.dropped.labels("timeout").inc()
                return
            except asyncio.LimitOverrunError:
                self.dropped.labels("too_large").inc()
                answer = _Answer(431, f"request head over {self.limits.max_head_bytes} bytes\n".encode())
            else:
                answer = self._answer(head)
            self._connections[writer].idle = False
            writer.write(_encode(answer))
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout)
            served += 1
            if not answer.keep_alive:
                return

    def _answer(self, head: bytes) -> _Answer:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self.dropped.labels("bad_request").inc()
            return _Answer(400, b"not an HTTP/1.x request line\n")
        method, target, version = parts
        headers = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if line and not colon:
                self.dropped.labels("bad_request").inc()
                return _Answer(400, b"malformed header line\n")
            headers[name.strip().lower()] = value.strip()
        if "transfer-encoding" in headers or headers.get("content-length", "0") != "0":
            self.dropped.labels("too_large").inc()
            return _Answer(413, b"request bodies are not accepted\n")
        if method not in ("GET", "HEAD"):
            return _Answer(405, b"only GET and HEAD\n", allow="GET, HEAD")
        keep_alive = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        path = target.split("?", 1)[0]
        if path == "/metrics":
            started = time.perf_counter()
            body = generate_latest(self._exposed)
            self.last_scrape_seconds = time.perf_counter() - started
            return _Answer(200, body, CONTENT_TYPE_LATEST, keep_alive, method == "HEAD")
        if path in ("/healthz", "/readyz"):
            ok, text = (self.healthz if path == "/healthz" else self.readyz)()
            return _Answer(200 if ok else 503, (text + "\n").encode(), TEXT, keep_alive, method == "HEAD")
        return _Answer(404, b"not found: try /metrics, /healthz or /readyz\n", TEXT, keep_alive, method == "HEAD")


def _peer(writer: asyncio.StreamWriter) -> str:
    address = writer.get_extra_info("peername")
    return str(address[0]) if address else "?"


def _encode(answer: _Answer) -> bytes:
    lines = [
        f"HTTP/1.1 {answer.status} {_REASONS[answer.status]}",
        f"Content-Type: {answer.content_type}",
        f"Content-Length: {len(answer.body)}",
    ]
    if answer.allow:
        lines.append(f"Allow: {answer.allow}")
    if not answer.keep_alive:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    return head if answer.head_only else head + answer.body


def _listen(host: str, port: int) -> socket.socket:
    """A listening, non-blocking socket on host:port; MetricsError with the reason when it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise MetricsError(
            f"cannot serve metrics on {host}:{port}: {err.strerror or err} (check --metrics-bind-address)"
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)  # pending connections cost the kernel, not this process; accepted in batches of 100
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        raise MetricsError(
            f"cannot serve metrics on {host}:{port}: {err.strerror} (choose another --metrics-port or "
            "--metrics-bind-address)"
        ) from None
    return sock

"""The metrics endpoint under abuse: idle and slow connections, oversized and odd requests, clients that never read.
Real sockets and real HTTP against the real server."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from deviceplugin.obs.http import HttpLimits, MetricsError, MetricsServer

from .conftest import GPU_CLI, wait_until

FAST = HttpLimits(max_connections=64, read_timeout=0.5, write_timeout=0.5)


@pytest.fixture
def serve():
    servers: list[MetricsServer] = []

    def start(limits: HttpLimits = FAST, registry: CollectorRegistry | None = None) -> MetricsServer:
        registry = registry or CollectorRegistry()
        Counter("gpushare_test_events", "A known sample.", registry=registry).inc(7)
        server = MetricsServer(
            registry,
            lambda: (True, "ok"),
            lambda: (False, "not ready: testing"),
            port=0,
            host="127.0.0.1",
            limits=limits,
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def scrape(server: MetricsServer, path: str = "/metrics") -> tuple[int, str, float]:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as response:
            return response.status, response.read().decode(), time.perf_counter() - started
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), time.perf_counter() - started


def raw(server: MetricsServer, data: bytes, timeout: float = 5.0) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as conn:
        conn.sendall(data)
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def idle_connections(server: MetricsServer, n: int, partial: bytes = b"") -> list[socket.socket]:
    conns = []
    for _ in range(n):
        conn = socket.create_connection(("127.0.0.1", server.port))
        if partial:
            conn.sendall(partial)
        conns.append(conn)
    return conns


def dropped(server: MetricsServer, reason: str) -> float:
    return server.registry.get_sample_value("gpushare_metrics_connections_dropped_total", {"reason": reason}) or 0


@pytest.mark.parametrize(
    "limits",
    [HttpLimits(max_connections=64, read_timeout=30), HttpLimits(max_connections=300, read_timeout=30)],
    ids=["evicting", "under-cap"],
)
def test_a_scrape_answers_under_200_idle_connections_with_bounded_threads(serve, limits):
    server = serve(limits)
    threads = threading.active_count()
    conns = idle_connections(server, 100) + idle_connections(
        server, 100, partial=b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
    )
    try:
        assert wait_until(
            lambda: server.open_connections == min(200, limits.max_connections) or dropped(server, "evicted") > 0
        )
        for _ in range(5):
            status, body, seconds = scrape(server)
            assert status == 200 and "gpushare_test_events_total 7.0" in body
            assert 'gpushare_metrics_connections_dropped_total{reason="busy"} 0.0' in body
            assert seconds < 1.0
        assert threading.active_count() <= threads  # one server thread, whatever the connections
        assert server.open_connections <= limits.max_connections
    finally:
        for conn in conns:
            conn.close()


def test_a_scrape_answers_while_another_client_keeps_opening_connections(serve):
    """Eviction takes from the address holding the most connections: a flood from 127.0.0.2 never evicts the scraper."""
    server = serve(HttpLimits(max_connections=16, read_timeout=30))
    stop = threading.Event()
    opened = []

    def flood() -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            conn = socket.create_connection(("127.0.0.1", server.port), source_address=("127.0.0.2", 0))
            conn.sendall(b"GET /metrics HTTP/1.1\r\n")
            held.append(conn)
            opened.append(1)
        for conn in held:
            conn.close()

    attacker = threading.Thread(target=flood)
    attacker.start()
    try:
        assert wait_until(lambda: len(opened) > 100)
        for _ in range(20):
            assert scrape(server)[0] == 200
        assert wait_until(
            lambda: server.open_connections <= 16 + 1
        )  # a batch of accepts may overshoot until the evicted close
    finally:
        stop.set()
        attacker.join()
    assert dropped(server, "evicted") > 50 and dropped(server, "busy") == 0


def test_slowloris_is_cut_at_the_read_timeout(serve):
    server = serve()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
        started = time.monotonic()
        closed = None
        for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 100:
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                closed = time.monotonic() - started
                break
            conn.settimeout(0.05)
            try:
                if conn.recv(1) == b"":
                    closed = time.monotonic() - started
                    break
            except TimeoutError:
                pass
        assert closed is not None and closed < FAST.read_timeout + 0.5
    assert wait_until(lambda: server.open_connections == 0)


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n", b"431"),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", b"413"),
        (b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"413"),
        (b"DELETE /metrics HTTP/1.1\r\nConnection: close\r\n\r\n", b"405"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
        (b"GET /nothing HTTP/1.1\r\nConnection: close\r\n\r\n", b"404"),
    ],
    ids=["head-too-large", "body", "chunked", "method", "tls-hello", "bad-header", "not-found"],
)
def test_odd_requests_get_a_status_and_a_close(serve, request_bytes, status):
    server = serve()
    answer = raw(server, request_bytes)
    assert answer.startswith(b"HTTP/1.1 " + status)
    assert scrape(server)[0] == 200


def test_keep_alive_head_and_health_endpoints(serve):
    server = serve()
    answer = raw(
        server,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nHEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /readyz HTTP/1.1\r\nConnection: close\r\n\r\n",
    )
    parts = answer.split(b"HTTP/1.1 ")[1:]
    assert [p[:3] for p in parts] == [b"200", b"200", b"503"]
    assert b"gpushare_test_events_total 7.0" in parts[0]
    assert parts[1].endswith(b"\r\n\r\n")  # HEAD: headers only
    assert parts[2].endswith(b"not ready: testing\n") and b"Connection: close" in parts[2]


def test_a_client_that_never_reads_is_dropped_and_a_full_server_answers_503(serve):
    """With one connection allowed, a scrape stuck on a client that does not read holds it; the next gets 503 until the
    write timeout frees it."""
    registry = CollectorRegistry()

    class Big:
        def collect(self):
            family = GaugeMetricFamily("gpushare_test_big", "Several MB of samples.", labels=["label"])
            for i in range(60_000):
                family.add_metric([f"{i:0100d}"], i)
            yield family

    registry.register(Big())
    server = serve(HttpLimits(max_connections=1, read_timeout=0.5, write_timeout=0.5), registry)
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(("127.0.0.1", server.port))
    stuck.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        assert wait_until(lambda: server.last_scrape_seconds > 0)
        assert raw(server, b"GET /healthz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 503")
        assert wait_until(lambda: dropped(server, "timeout") == 1)
        assert raw(server, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 200")
        assert dropped(server, "busy") == 1
    finally:
        stuck.close()


def test_bind_address():
    server = MetricsServer(CollectorRegistry(), lambda: (True, "ok"), lambda: (True, "ok"), port=0, host="127.0.0.1")
    server.start()
    try:
        assert server.port and scrape(server, "/healthz")[0] == 200
    finally:
        server.stop()
    with pytest.raises(
        MetricsError,
        match=r"cannot serve metrics on 192.0.2.1:0: Cannot assign requested address "
        r"\(choose another --metrics-port or --metrics-bind-address\)",
    ):
        MetricsServer(CollectorRegistry(), lambda: (True, "ok"), lambda: (True, "ok"), port=0, host="192.0.2.1")
    proc = subprocess.run(
        [*GPU_CLI, "run", "--metrics-bind-address", "localhost"], capture_output=True, text=True, timeout=15
    )
    assert (
        proc.returncode == 2
        and "argument --metrics-bind-address: must be an IP address such as 0.0.0.0, :: or 10.1.2.3, got 'localhost'"
        in proc.stderr
    )

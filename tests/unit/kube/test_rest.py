"""`kube.rest` against local sockets and kubeconfig files: a call's timeout is its total time however slowly a server
trickles (the headers, a chunk-size line, the body, a TLS handshake, a kept-alive connection), while a watch's stream
waits its silence; one deadline thread for all calls; tokens, kubeconfig fields and `-data` contents checked (and
the client key never left on disk); pages() bounded. Against the real API server: `tests/e2e/test_rest.py`."""

from __future__ import annotations

import base64
import socket
import ssl
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.kube import rest
from deviceplugin.kube.rest import ApiAccessError, ApiError, ApiTimeout, Connection, RestClient, load_kubeconfig
from deviceplugin.kube.watch import ResponseTooLarge, watch_events
from tests.support.pki import SERVER_NAME, Pki, make_pki

SLACK = 0.5  # seconds past a call's timeout that a loaded test machine may take to end it


class _Server:
    """A local TCP server (TLS with `context`): each connection is given to `handle` on a thread of its own."""

    def __init__(self, handle: Callable[[socket.socket], None], context: ssl.SSLContext | None = None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.handle, self.context = handle, context
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"{'https' if self.context else 'http'}://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            if self.context is not None:
                conn = self.context.wrap_socket(conn, server_side=True)
            self.handle(conn)
        except OSError:
            pass
        finally:
            conn.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., _Server]]:
    servers: list[_Server] = []

    def start(handle: Callable[[socket.socket], None], context: ssl.SSLContext | None = None) -> _Server:
        servers.append(_Server(handle, context))
        return servers[-1]

    yield start
    for server in servers:
        server.sock.close()


def _request(conn: socket.socket) -> bytes:
    """One request's head (the client's GETs carry no body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data


def _drip(conn: socket.socket, data: bytes, every: float = 0.1) -> None:
    for byte in data:
        conn.sendall(bytes([byte]))
        time.sleep(every)


def _answer(body: bytes = b"{}", close: bool = False) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + ("Connection: close\r\n" if close else "") + "\r\n").encode() + body


def _trickle_headers(conn: socket.socket) -> None:
    _request(conn)
    _drip(conn, b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 60)


def _trickle_chunk_size(conn: socket.socket) -> None:
    _request(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    _drip(conn, b"0" * 60)


def _trickle_body(conn: socket.socket) -> None:
    _request(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{")
    _drip(conn, b" " * 60)


def _timed(call: Callable[[], Any], timeout: float) -> float:
    started = time.monotonic()
    with pytest.raises(ApiTimeout, match=f"no answer within {timeout:g}s"):
        call()
    return time.monotonic() - started


@pytest.mark.parametrize("handle", [_trickle_headers, _trickle_chunk_size, _trickle_body])
def test_a_trickling_server_costs_the_timeout_in_all(serve: Any, handle: Any) -> None:
    """A byte every 0.1 s for 6 s: each read gets one, so only a deadline for the whole call ends it."""
    server = serve(handle)
    elapsed = _timed(lambda: RestClient(Connection(server.url)).get("/x", timeout=0.5), 0.5)
    assert elapsed < 0.5 + SLACK and server.accepted == 1


def test_a_server_that_never_answers_costs_one_timeout_and_no_retry(serve: Any) -> None:
    release = threading.Event()
    server = serve(lambda conn: (_request(conn), release.wait(5)))
    try:
        elapsed = _timed(lambda: RestClient(Connection(server.url)).get("/api/v1/nodes/n", timeout=0.5), 0.5)
        assert elapsed < 0.5 + SLACK
        time.sleep(0.2)  # a retry would have connected again by now
        assert server.accepted == 1
    finally:
        release.set()


def test_a_body_over_the_bound_and_a_non_status_error(serve: Any) -> None:
    big = serve(lambda conn: (_request(conn), conn.sendall(_answer(b" " * 5000))))
    with pytest.raises(ResponseTooLarge, match="over 1000 bytes"):
        RestClient(Connection(big.url), max_bytes=1000).get("/x")
    busy = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy"
    teapot = serve(lambda conn: (_request(conn), conn.sendall(busy)))
    with pytest.raises(ApiError) as err:
        RestClient(Connection(teapot.url)).get("/x")
    assert (err.value.status, err.value.message) == (503, "busy") and teapot.accepted == 1


def test_a_kept_alive_connection_is_bounded_too(serve: Any) -> None:
    def handle(conn: socket.socket) -> None:
        _request(conn)
        conn.sendall(_answer(b'{"first": true}'))
        _trickle_headers(conn)

    server = serve(handle)
    api = RestClient(Connection(server.url))
    assert api.get("/x", timeout=0.5) == {"first": True}
    assert _timed(lambda: api.get("/x", timeout=0.5), 0.5) < 0.5 + SLACK
    assert server.accepted == 1  # the second call was on the first call's connection


def test_a_deadline_never_shuts_a_connection_the_next_call_took(serve: Any, monkeypatch: Any) -> None:
    """urllib3 puts a connection back in the pool once its body is read, before the call ends: when the call's
    deadline passes in between (widened here: a sleep after the put, on thread A), the next call to take that
    connection (B) is not the one whose socket is shut."""

    def handle(conn: socket.socket) -> None:
        while True:
            head = _request(conn)
            if head.startswith(b"GET /slow"):
                time.sleep(1.0)
            conn.sendall(_answer())

    put = rest._DeadlinePool._put_conn

    def late_put(pool: Any, conn: Any) -> None:
        put(pool, conn)
        if threading.current_thread().name == "A":
            time.sleep(0.6)  # A's deadline passes while B uses the connection

    server = serve(handle)
    api = RestClient(Connection(server.url))
    assert api.get("/warm") == {}
    monkeypatch.setattr(rest._DeadlinePool, "_put_conn", late_put)
    found: dict[str, Any] = {}

    def call(name: str, path: str, timeout: float) -> None:
        try:
            found[name] = api.get(path, timeout=timeout)
        except ApiError as err:
            found[name] = err

    a = threading.Thread(target=call, args=("A", "/fast", 0.3), name="A")
    a.start()
    time.sleep(0.1)  # A has put the connection back
    call("B", "/slow", 5.0)
    a.join()
    assert isinstance(found["A"], ApiTimeout) and found["B"] == {}
    assert server.accepted == 1  # B was on A's connection


def test_a_server_name_of_many_silent_addresses_costs_the_timeout_in_all(monkeypatch: Any) -> None:
    """Each address is tried with what is left of the call's time (urllib3 gives each the whole timeout): here a name
    with 3 addresses, each a listener whose accept queue is full (its SYNs dropped: a connect that is not answered)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    queued = []
    for _ in range(4):  # fill the accept queue; never accepted
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        queued.append(sock)
    time.sleep(0.1)
    resolve = socket.getaddrinfo

    def three(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "apiserver.example":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))] * 3
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", three)
    api = RestClient(Connection(f"http://apiserver.example:{port}"))
    try:
        assert _timed(lambda: api.get("/x", timeout=0.5), 0.5) < 0.5 + SLACK
    finally:
        for sock in [*queued, listener]:
            sock.close()


def test_a_refused_connection_is_a_connection_error_not_a_timeout() -> None:
    unused = socket.create_server(("127.0.0.1", 0))
    port = unused.getsockname()[1]
    unused.close()
    with pytest.raises(ApiError, match="ConnectionError") as raised:
        RestClient(Connection(f"http://127.0.0.1:{port}")).get("/x")
    assert not isinstance(raised.value, ApiTimeout)


def test_a_trickled_tls_handshake_is_bounded(serve: Any) -> None:
    """The server's half of the handshake, a TLS record header announcing 4 KiB, then a byte every 0.1 s."""

    def handle(conn: socket.socket) -> None:
        conn.recv(65536)  # the ClientHello
        _drip(conn, b"\x16\x03\x03\x10\x00" + b"\x00" * 60)

    server = serve(handle)
    api = RestClient(Connection(server.url.replace("http:", "https:"), verify=False))
    assert _timed(lambda: api.get("/x", timeout=0.5), 0.5) < 0.5 + SLACK


def test_a_watch_opens_within_the_timeout_and_then_waits_its_silence(serve: Any) -> None:
    def handle(conn: socket.socket) -> None:
        _request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        time.sleep(1.0)  # past the client's timeout, within the silence
        line = b'{"type": "ADDED", "object": {"metadata": {"name": "n"}}}\n'
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(line), line))

    api = RestClient(Connection(serve(handle).url), timeout=0.3)
    response = api.watch("/api/v1/nodes", "1", seconds=5, silence=3.0)
    try:
        events = list(watch_events(response, 1 << 20))
    finally:
        response.release_conn()
    assert [e["object"]["metadata"]["name"] for e in events] == ["n"]
    trickled = serve(_trickle_headers)
    slow = RestClient(Connection(trickled.url), timeout=0.3)
    assert _timed(lambda: slow.watch("/api/v1/nodes", "1", seconds=5, silence=3.0), 0.3) < 0.3 + SLACK


def test_one_thread_keeps_every_deadline(serve: Any) -> None:
    def handle(conn: socket.socket) -> None:
        while True:
            _request(conn)
            conn.sendall(_answer())

    api = RestClient(Connection(serve(handle).url))
    threads = [threading.Thread(target=lambda: [api.get("/x", timeout=2) for _ in range(20)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [t.name for t in threading.enumerate()].count("kube-rest-deadlines") == 1


def _kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any] | None = None) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "current-context": "c",
                "clusters": [{"name": "k", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
            }
        )
    )
    return path


HTTPS = "https://10.0.0.1:6443"


@pytest.mark.parametrize(
    "cluster, user, refused",
    [
        (
            {"server": HTTPS, "insecure-skip-tls-verify": "false"},
            {},
            "cluster.insecure-skip-tls-verify must be true or",
        ),
        ({"server": HTTPS, "insecure-skip-tls-verify": 1}, {}, "cluster.insecure-skip-tls-verify must be true or"),
        (
            {"server": HTTPS, "insecure-skip-tls-verify": True, "certificate-authority": "ca.crt"},
            {},
            "insecure-skip-tls-verify is true beside a certificate-authority",
        ),
        (
            {"server": HTTPS, "certificate-authority-data": "not*base64!"},
            {},
            "certificate-authority-data is not base64",
        ),
        ({"server": HTTPS, "tls-server-name": 5}, {}, r"clusters\[\].cluster.tls-server-name must be a string"),
        ({"server": HTTPS}, {"token": [1, 2]}, r"users\[\].user.token must be a string"),
        ({"server": HTTPS}, {"client-key-data": "eA=="}, "client-certificate and client-key"),
        (
            {"server": HTTPS},
            {"client-certificate-data": "eA==", "client-key-data": "%"},
            "client-key-data is not base64",
        ),
        ({"server": "http://10.0.0.1:8080"}, {"token": "abc"}, "plain http:// to 10.0.0.1: the user's credentials"),
        ({"server": "http://api.example:80"}, {"tokenFile": "t"}, "plain http:// to api.example"),
        ({"server": "ftp://10.0.0.1"}, {}, "cluster.server must be an https:// URL"),
        ({"server": "https://10.0.0.1:port"}, {}, "cluster.server must be an https:// URL"),
        ({"server": 6443}, {}, "cluster.server must be a string"),
    ],
)
def test_kubeconfig_fields_that_cannot_be_used_are_refused_by_name(
    tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any], refused: str
) -> None:
    with pytest.raises(ApiAccessError, match=refused):
        load_kubeconfig(_kubeconfig(tmp_path / "k", cluster, user))


def test_plain_http_takes_credentials_only_to_a_loopback_address(tmp_path: Path) -> None:
    for host in ("127.0.0.1", "localhost", "[::1]"):
        connection = load_kubeconfig(_kubeconfig(tmp_path / "k", {"server": f"http://{host}:8080"}, {"token": "t"}))
        assert connection.token == "t"
    assert load_kubeconfig(_kubeconfig(tmp_path / "k", {"server": "http://10.0.0.1:8080"})).token is None
    insecure = load_kubeconfig(_kubeconfig(tmp_path / "k", {"server": HTTPS, "insecure-skip-tls-verify": True}))
    assert not insecure.verify


@pytest.mark.parametrize("token", ["s3cr3t\nx", "s3cr3t x", "s3cr3t\x00", "s3cr3tö", "s3cr3t" + "a" * rest.MAX_TOKEN])
def test_a_token_that_is_not_one_printable_word_is_refused_without_showing_it(
    tmp_path: Path, serve: Any, token: str
) -> None:
    with pytest.raises(ApiAccessError, match=r"users\[\].user.token is not a usable bearer token") as refused:
        load_kubeconfig(_kubeconfig(tmp_path / "k", {"server": HTTPS}, {"token": token}))
    assert "s3cr3t" not in str(refused.value)
    seen: list[bytes] = []

    def handle(conn: socket.socket) -> None:
        while True:
            seen.append(_request(conn))
            conn.sendall(_answer())

    server = serve(handle)
    file = tmp_path / "token"
    file.write_text(token + "\n")
    api = RestClient(Connection(server.url, token_file=str(file)))
    with pytest.raises(ApiError) as bad:
        api.get("/x")
    assert bad.value.reason == "BadToken" and "not a usable bearer token" in bad.value.message
    assert "s3cr3t" not in str(bad.value) and not seen  # nothing was sent
    file.write_text("good-token\n")  # fixed (rotated): the next call reads and sends it
    assert api.get("/x") == {} and b"Authorization: Bearer good-token\r\n" in seen[0]


def _tls_server(serve: Any, pki: Pki) -> _Server:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=pki.path("ca.crt"))
    context.load_cert_chain(pki.path("extender.crt"), pki.path("extender.key"))
    context.verify_mode = ssl.CERT_REQUIRED  # the client certificate, signed by the CA

    def handle(conn: socket.socket) -> None:
        _request(conn)
        conn.sendall(_answer(b'{"ok": true}', close=True))  # each call on a new connection

    return serve(handle, context)  # type: ignore[no-any-return]


def test_data_fields_are_used_from_memory_and_no_file_is_left(
    tmp_path: Path, serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = make_pki(tmp_path / "pki")
    server = _tls_server(serve, pki)

    def data(name: str) -> str:  # wrapped at 64 columns, as kubectl accepts
        return "\n".join(textwrap.wrap(base64.b64encode(Path(pki.path(name)).read_bytes()).decode(), 64))

    path = _kubeconfig(
        tmp_path / "k",
        {"server": server.url, "certificate-authority-data": data("ca.crt"), "tls-server-name": SERVER_NAME},
        {"client-certificate-data": data("scheduler.crt"), "client-key-data": data("scheduler.key")},
    )
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    connection = load_kubeconfig(path)
    assert connection.ca_data and connection.key_data and not (connection.ca_file or connection.key_file)
    assert "BEGIN" not in repr(connection)  # the key is not in a log line either
    api = RestClient(connection)
    assert list(private.iterdir()) == []  # the key's file went once it was loaded
    assert api.get("/x") == {"ok": True} and api.get("/x") == {"ok": True}
    assert server.accepted == 2  # the second call connected again, from the context, with no file


def test_pages_stop_at_max_pages(serve: Any) -> None:
    def handle(conn: socket.socket) -> None:
        while True:
            _request(conn)
            conn.sendall(_answer(b'{"metadata": {"continue": "more"}, "items": []}'))

    api = RestClient(Connection(serve(handle).url))
    pages = api.pages("/api/v1/pods", limit=1, max_pages=3)
    assert [next(pages) for _ in range(3)]
    with pytest.raises(ResponseTooLarge, match="list /api/v1/pods: more than max_pages=3 pages of 1"):
        next(pages)

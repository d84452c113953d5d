"""The extender's TLS and client authentication over real sockets, with certificates made by docs/security.md's
OpenSSL commands: each attack of issue 31 refused (no client certificate, another CA, another name, plain HTTP, a
handshake dripped byte by byte), nothing reserved for a refused call, certificates reloaded when their files change."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

from deviceplugin.extender.http import ExtenderHTTPServer
from deviceplugin.extender.tls import ServerTLS, TLSSettings
from deviceplugin.extender.verbs import Extender
from tests.support.extender import SHARE, annotation, args, extender, pod
from tests.support.pki import CLIENT_NAME, SERVER_NAME, Pki, call, client_context, make_pki

from .conftest import GPU_CLI, wait_until

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki") / "good")


@pytest.fixture(scope="module")
def rogue(tmp_path_factory) -> Pki:
    """The same commands again: another CA, whose scheduler certificate the extender must not accept."""
    return make_pki(tmp_path_factory.mktemp("pki") / "rogue")


def settings(pki: Pki, names: frozenset[str] = frozenset({CLIENT_NAME})) -> TLSSettings:
    return TLSSettings(pki.path("extender.crt"), pki.path("extender.key"), pki.path("ca.crt"), names)


@pytest.fixture
def serve():
    servers = []

    def start(ext: Extender, tls: TLSSettings, **kw) -> int:
        server = ExtenderHTTPServer(
            ext, ext.metrics, lambda: (True, "ready"), port=0, host="127.0.0.1", tls=ServerTLS(tls), **kw
        )
        server.start()
        servers.append(server)
        return server.port

    yield start
    for server in servers:
        server.stop()


def refused(port: int, context: ssl.SSLContext | None) -> bool:
    """The connection ends without an HTTP answer: the handshake (or, TLS 1.3, the first read after it) fails."""
    try:
        if context is None:  # plain HTTP to the TLS port
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
                return not sock.recv(65536).startswith(b"HTTP/")
        call(port, context, "POST", "/filter", {})
    except (ssl.SSLError, ConnectionError, http.client.RemoteDisconnected):
        return True
    return False


def counter(ext: Extender, reason: str) -> float:
    return ext.metrics.unauthenticated.labels(reason)._value.get()


def test_the_scheduler_certificate_calls_the_verbs_and_none_gets_401_without_reserving(serve, pki):
    ext = extender({"n": annotation((4, 0))})
    port = serve(ext, settings(pki))
    status, text = call(port, client_context(pki, pki), "POST", "/filter", args(pod("mine", {SHARE: 2}), "n"))
    assert status == 200 and json.loads(text)["NodeNames"] == ["n"]
    assert ext.cache.counts()["reservations"] == 1
    anonymous = client_context(pki, None)
    status, text = call(port, anonymous, "POST", "/filter", args(pod("attack", {SHARE: 4}, uid="uid-attack"), "n"))
    assert (status, text) == (401, "a client certificate signed by the extender's --client-ca-file is required\n")
    assert call(port, anonymous, "POST", "/prioritize", args(pod("attack", {SHARE: 4}), "n"))[0] == 401
    assert ext.cache.counts()["reservations"] == 1 and counter(ext, "no-certificate") == 2
    # Probes and the scraper need no certificate; they only read.
    assert call(port, anonymous, "GET", "/healthz") == (200, "ok\n")
    status, text = call(port, anonymous, "GET", "/metrics")
    assert status == 200 and 'gpushare_extender_unauthenticated_total{reason="no-certificate"} 2.0' in text


def test_another_ca_plain_http_and_another_name_are_refused_and_reserve_nothing(serve, pki, rogue):
    ext = extender({"n": annotation((4, 0))})
    port = serve(ext, settings(pki))
    assert refused(port, client_context(pki, rogue))  # a scheduler certificate of another CA
    assert refused(port, None)
    assert wait_until(lambda: counter(ext, "handshake") == 2)
    intruder = pki.client("intruder")  # signed by the right CA, not the scheduler's name
    status, text = call(port, client_context(pki, intruder), "POST", "/filter", args(pod("attack", {SHARE: 4}), "n"))
    assert (status, text) == (403, "client certificate intruder is not one of --client-names\n")
    assert ext.cache.counts()["reservations"] == 0 and counter(ext, "name") == 1
    assert not refused(port, client_context(pki, pki))  # and the scheduler still gets through


class Dripper:
    """Sends `data` one byte every 20 ms on `sock` (never the last byte), until the extender closes the connection."""

    def __init__(self, sock: socket.socket, data: bytes) -> None:
        self.sock = sock
        self.data = data
        self.sent = 0
        self.cut = threading.Event()
        self.thread = threading.Thread(target=self._drip, daemon=True)
        self.thread.start()

    def _drip(self) -> None:
        self.sock.settimeout(0.02)
        try:
            for byte in self.data[:-1]:
                self.sock.sendall(bytes([byte]))
                self.sent += 1
                try:
                    if self.sock.recv(4096) == b"":
                        break
                except TimeoutError:
                    continue
        except OSError:  # reset, or (TLS) the close seen as an error
            pass
        self.cut.set()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=10)


def client_hello(context: ssl.SSLContext) -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=SERVER_NAME)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@pytest.mark.parametrize("phase", ["handshake", "head"])
def test_clients_dripping_into_every_worker_are_cut_off_and_the_scheduler_is_answered(serve, pki, phase):
    """A byte every 20 ms of a ClientHello, or (with the scheduler's own certificate) of a request head after the
    handshake: each phase has a deadline in all, and gives way to connections waiting for a worker."""
    ext = extender({"n": annotation((4, 0))})
    port = serve(ext, settings(pki), workers=2, read_timeout=0.5)
    context = client_context(pki, pki)

    def dripper() -> Dripper:
        sock = socket.create_connection(("127.0.0.1", port))
        if phase == "handshake":
            return Dripper(sock, client_hello(context))
        return Dripper(
            context.wrap_socket(sock, server_hostname=SERVER_NAME),
            b"POST /filter HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 2000,
        )

    drippers = [dripper() for _ in range(2)]
    try:
        assert wait_until(lambda: all(d.sent for d in drippers))  # both workers hold a dripping connection
        status, text = call(port, context, "POST", "/filter", args(pod("p", {SHARE: 1}), "n"))
        assert status == 200 and json.loads(text)["NodeNames"] == ["n"]
        assert wait_until(lambda: all(d.cut.is_set() for d in drippers), timeout=10)
        assert all(d.sent < len(d.data) - 1 for d in drippers)
    finally:
        for d in drippers:
            d.close()


def secret_volume(directory: Path, source: Pki, generation: str) -> None:
    """Write `source`'s extender files as a Secret volume does: a new timestamped folder, then ..data swapped to it."""
    folder = directory / generation
    folder.mkdir()
    for name, file in (("tls.crt", "extender.crt"), ("tls.key", "extender.key"), ("ca.crt", "ca.crt")):
        shutil.copy(source.dir / file, folder / name)
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(Path("..data") / name)
    (directory / "..data_tmp").symlink_to(generation)
    os.replace(directory / "..data_tmp", directory / "..data")


def test_a_rotated_secret_is_served_to_new_connections_and_a_broken_one_keeps_the_last(serve, pki, rogue, tmp_path):
    volume = tmp_path / "volume"
    volume.mkdir()
    secret_volume(volume, pki, "..2026_01")
    ext = extender({"n": annotation((4, 0))})
    port = serve(
        ext,
        TLSSettings(str(volume / "tls.crt"), str(volume / "tls.key"), str(volume / "ca.crt"), frozenset({CLIENT_NAME})),
    )
    assert call(port, client_context(pki, pki), "GET", "/healthz")[0] == 200
    assert refused(port, client_context(rogue, rogue))
    secret_volume(
        volume, rogue, "..2026_02"
    )  # the Secret now holds the other PKI: new server certificate, new client CA
    assert call(port, client_context(rogue, rogue), "POST", "/filter", args(pod("p", {SHARE: 1}), "n"))[0] == 200
    assert refused(port, client_context(rogue, pki)) and refused(port, client_context(pki, pki))
    broken = tmp_path / "broken"
    shutil.copytree(rogue.dir, broken)
    shutil.copy(pki.dir / "extender.key", broken / "extender.key")  # a key that is not the certificate's
    secret_volume(volume, Pki(broken), "..2026_03")
    assert call(port, client_context(rogue, rogue), "POST", "/filter", args(pod("p", {SHARE: 1}), "n"))[0] == 200


def test_bad_tls_files_are_refused_at_start_naming_the_flag(pki, tmp_path):
    with pytest.raises(ValueError, match=r"^--tls-cert-file /nope/tls.crt: No such file or directory$"):
        ServerTLS(TLSSettings("/nope/tls.crt", pki.path("extender.key")))
    with pytest.raises(
        ValueError,
        match=r"^--tls-cert-file .*extender.crt: not a PEM certificate whose key is --tls-private-key-file "
        r".*scheduler.key",
    ):
        ServerTLS(TLSSettings(pki.path("extender.crt"), pki.path("scheduler.key")))
    (tmp_path / "ca.crt").write_text("not a certificate\n")
    with pytest.raises(ValueError, match=r"^--client-ca-file .*ca.crt: not PEM CA certificates"):
        ServerTLS(TLSSettings(pki.path("extender.crt"), pki.path("extender.key"), str(tmp_path / "ca.crt")))


def kubeconfig(tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "x", "cluster": {"server": "http://127.0.0.1:1"}}],
                "users": [{"name": "x", "user": {}}],
                "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}],
                "current-context": "x",
            }
        )
    )
    return path


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--address", "0.0.0.0"],
            "gpu-share: error: --address 0.0.0.0: serves /filter to the network without client authentication: any pod "
            "could reserve every GPU (give --tls-cert-file, --tls-private-key-file and --client-ca-file "
            "(docs/security.md), or --allow-unauthenticated where a NetworkPolicy alone admits the scheduler)",
        ),
        (
            ["--client-ca-file", "ca.crt"],
            "gpu-share: error: --client-ca-file needs --tls-cert-file and --tls-private-key-file",
        ),
        (
            ["--tls-cert-file", "extender.crt"],
            "gpu-share: error: --tls-cert-file and --tls-private-key-file go together",
        ),
        (
            ["--tls-cert-file", "extender.crt", "--tls-private-key-file", "extender.key", "--client-names", "x"],
            "gpu-share: error: --client-names needs --client-ca-file",
        ),
    ],
    ids=["unauthenticated-address", "ca-without-tls", "cert-without-key", "names-without-ca"],
)
def test_the_command_refuses_an_unauthenticated_exposure_and_half_set_tls_flags(tmp_path, flags, message):
    result = subprocess.run(
        [*GPU_CLI, "extender", "--kubeconfig", str(kubeconfig(tmp_path)), "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and result.stderr.startswith(message), result.stderr


def test_the_tls_benchmark_scheduler_is_answered_under_each_attack_and_nothing_is_reserved_for_them():
    """benchmarks/extender_tls.py, smoke size: every scheduler call answered under each flood, the attackers' calls
    made, and the extender holding only the scheduler pod's reservation after each."""
    from benchmarks.extender_tls import run

    result = run(smoke=True)
    rows = {r["attack"]: r for r in result["scenarios"]}
    assert set(rows) == {"none", "no-certificate flood", "other-CA flood", "dripped handshakes"}
    assert all(r["failed"] == 0 and r["reservations_after"] == 1 for r in rows.values()), rows
    assert all(r["attempts"] > 0 for name, r in rows.items() if name != "none"), rows

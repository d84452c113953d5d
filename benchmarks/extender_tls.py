"""The extender over mutual TLS, with and without attackers: the scheduler's filter + prioritize latency.

    python -m benchmarks.extender_tls [--smoke]

The extender (1,000 nodes as in benchmarks/extender.py; the shipped 8 workers, 5 s deadlines) in its own process,
serving the certificates docs/security.md's commands make, the verbs for `gpu-share-scheduler` only. The scheduler
calls filter + prioritize for one 2-share pod on one kept-alive connection, as kube-scheduler does, while attackers
run, each scenario on its own: none; 8 threads that each open connection after connection without a client
certificate and POST a 10-share pod's filter (401); 8 that offer another CA's certificate (handshake refused); 8
connections that drip a real ClientHello a byte every 50 ms, reopened when cut (the attackers in a process of their
own). Reported: the scheduler's latency
(p50, p99, max), its failed calls, the attackers' attempts, and the reservations the extender holds at the end (1:
the scheduler's pod; an attacker's filter reserves nothing). Also the cost of a new connection (handshake + one
filter) against a kept-alive one.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.support.pki import CLIENT_NAME, SERVER_NAME, Pki, client_context, make_pki

from .extender import POD, SHARE, _extender

NODES = 1000
ATTACKERS = 8


def _serve(pki_dir: str, nodes: int, pipe) -> None:
    from deviceplugin.extender.http import ExtenderHTTPServer
    from deviceplugin.extender.tls import ServerTLS, TLSSettings

    pki = Pki(Path(pki_dir))
    extender = _extender(nodes)
    tls = ServerTLS(
        TLSSettings(pki.path("extender.crt"), pki.path("extender.key"), pki.path("ca.crt"), frozenset({CLIENT_NAME}))
    )
    server = ExtenderHTTPServer(extender, extender.metrics, lambda: (True, "ready"), port=0, host="127.0.0.1", tls=tls)
    server.start()
    pipe.send(server.port)
    pipe.recv()
    server.stop()


def _connect(port: int, context: ssl.SSLContext) -> http.client.HTTPConnection:
    """A kept-alive HTTPS connection checking the extender's certificate for SERVER_NAME; TCP_NODELAY as Go's client
    sets it (and http.client's own connect), or each call waits out a delayed ACK."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    connection.sock = context.wrap_socket(sock, server_hostname=SERVER_NAME)
    return connection


def _post(connection: http.client.HTTPConnection, path: str, body: dict) -> tuple[int, bytes]:
    connection.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()


def _hello(context: ssl.SSLContext) -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    try:
        context.wrap_bio(incoming, outgoing, server_hostname=SERVER_NAME).do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def _attack(name: str, port: int, pki_dir: str, rogue_dir: str, pipe) -> None:
    """In a process of its own (not the scheduler's GIL): ATTACKERS threads repeating attack `name` until a message
    comes; then the attempts go back."""
    once = _scenarios(Pki(Path(pki_dir)), Pki(Path(rogue_dir)))[name]
    attempts = [0] * ATTACKERS
    stop = threading.Event()

    def loop(i: int) -> None:
        while not stop.is_set():
            try:
                once(port, stop)
            except (OSError, http.client.HTTPException):
                pass
            attempts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(ATTACKERS)]
    for thread in threads:
        thread.start()
    pipe.send("started")
    pipe.recv()
    stop.set()
    for thread in threads:
        thread.join(timeout=15)
    pipe.send(sum(attempts))


def _scenarios(pki: Pki, rogue: Pki) -> dict:
    anonymous, foreign = client_context(pki, None), client_context(pki, rogue)
    attacker = {
        "metadata": {"name": "attack", "namespace": "bench", "uid": "attacker"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {SHARE: "10"}}}]},
    }
    big = {"Pod": attacker, "Nodes": None, "NodeNames": [f"node-{i:05d}" for i in range(NODES)]}
    hello = _hello(client_context(pki, pki))

    def no_certificate(port: int, stop: threading.Event) -> None:
        connection = _connect(port, anonymous)
        _post(connection, "/filter", big)
        connection.close()

    def other_ca(port: int, stop: threading.Event) -> None:
        _connect(port, foreign).sock.recv(1)  # TLS 1.3: the refusal arrives with the first read

    def drip_handshake(port: int, stop: threading.Event) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.settimeout(0.05)
            for byte in hello[:-1]:
                if stop.is_set():
                    return
                sock.sendall(bytes([byte]))
                try:
                    if sock.recv(1) == b"":
                        return
                except TimeoutError:
                    continue

    return {"no-certificate flood": no_certificate, "other-CA flood": other_ca, "dripped handshakes": drip_handshake}


def _reservations(port: int, context: ssl.SSLContext) -> int:
    connection = _connect(port, context)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    return int(
        float(
            next(
                line.split()[-1]
                for line in text.splitlines()
                if line.startswith('gpushare_extender_cache{kind="reservations"}')
            )
        )
    )


def run(smoke: bool = False) -> dict:
    rounds = 20 if smoke else 300
    with tempfile.TemporaryDirectory(prefix="gs-tls-") as tmp:
        pki, rogue = make_pki(Path(tmp) / "pki"), make_pki(Path(tmp) / "rogue")
        scheduler = client_context(pki, pki)
        names = [f"node-{i:05d}" for i in range(NODES)]
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        server = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(str(pki.dir), NODES, theirs), daemon=True
        )
        server.start()
        try:
            port = ours.recv()
            rows = []
            for name in ("none", *_scenarios(pki, rogue)):
                latencies, failed = [], 0
                attacker = None
                if name != "none":
                    control, theirs = multiprocessing.get_context("spawn").Pipe()
                    attacker = multiprocessing.get_context("spawn").Process(
                        target=_attack, args=(name, port, str(pki.dir), str(rogue.dir), theirs), daemon=True
                    )
                    attacker.start()
                    control.recv()
                    time.sleep(0.5)  # under way before the scheduler's first call
                try:
                    connection = _connect(port, scheduler)
                    for _ in range(rounds):
                        started = time.perf_counter()
                        try:
                            status, body = _post(connection, "/filter", {"Pod": POD, "Nodes": None, "NodeNames": names})
                            passed = json.loads(body)["NodeNames"]
                            status, _ = _post(
                                connection, "/prioritize", {"Pod": POD, "Nodes": None, "NodeNames": passed}
                            )
                            failed += status != 200
                        except (OSError, http.client.HTTPException):
                            failed += 1
                            connection = _connect(port, scheduler)
                        latencies.append(time.perf_counter() - started)
                    connection.close()
                finally:
                    attempts = 0
                    if attacker is not None:
                        control.send("stop")
                        attempts = control.recv()
                        attacker.join(timeout=20)
                ms = sorted(x * 1000 for x in latencies)
                rows.append(
                    {
                        "attack": name,
                        "calls": rounds,
                        "failed": failed,
                        "p50_ms": round(statistics.median(ms), 2),
                        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
                        "max_ms": round(ms[-1], 2),
                        "attempts": attempts,
                        "reservations_after": _reservations(port, scheduler),
                    }
                )
            fresh = []
            for _ in range(rounds // 2):
                started = time.perf_counter()
                connection = _connect(port, scheduler)
                _post(connection, "/filter", {"Pod": POD, "Nodes": None, "NodeNames": names})
                connection.close()
                fresh.append(time.perf_counter() - started)
        finally:
            ours.send("stop")
            server.join(timeout=10)
    return {
        "nodes": NODES,
        "attackers": ATTACKERS,
        "scenarios": rows,
        "new_connection_filter_p50_ms": round(statistics.median(fresh) * 1000, 2),
    }


if __name__ == "__main__":
    print(json.dumps(run(smoke="--smoke" in sys.argv), indent=2))

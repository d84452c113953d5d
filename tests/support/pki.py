"""Certificates for the extender's TLS tests, made by the OpenSSL commands docs/security.md gives operators."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER_NAME = "gpu-share-extender.gpu-share.svc"  # the name the documented certificate carries and tlsConfig checks
CLIENT_NAME = "gpu-share-scheduler"


def documented_commands() -> list[str]:
    """The shell commands of docs/security.md's extender section, in order."""
    text = (ROOT / "docs" / "security.md").read_text()
    section = text[text.index("\n## The scheduler extender\n") :]
    (block,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@dataclass(frozen=True)
class Pki:
    """One run of the documented commands: a CA, the extender's certificate and the scheduler's client certificate."""

    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def client(self, name: str) -> Pki:
        """A client certificate signed by this CA for another name (in a folder of its own, as scheduler.crt/.key)."""
        other = self.dir.parent / f"{self.dir.name}-{name}"
        other.mkdir()
        for file in ("ca.crt", "ca.key"):
            shutil.copy(self.dir / file, other / file)
        line = next(c for c in documented_commands() if c.startswith("openssl") and f"/CN={CLIENT_NAME}" in c)
        _run(line.replace(f"/CN={CLIENT_NAME}", f"/CN={name}"), other)
        return Pki(other)


def make_pki(directory: Path) -> Pki:
    """The documented OpenSSL commands run in `directory` (created)."""
    directory.mkdir(parents=True)
    for command in documented_commands():
        if command.startswith("openssl"):
            _run(command, directory)
    return Pki(directory)


def _run(command: str, cwd: Path) -> None:
    proc = subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (command, proc.stderr)


def client_context(trust: Pki, cert: Pki | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=trust.path("ca.crt"))
    if cert is not None:
        context.load_cert_chain(cert.path("scheduler.crt"), cert.path("scheduler.key"))
    return context


def call(port: int, context: ssl.SSLContext, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    """One request over a fresh TLS connection that checks the extender's certificate for SERVER_NAME."""
    sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname=SERVER_NAME)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.sock = sock
    try:
        data = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()

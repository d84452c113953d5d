"""Certificates for the extender's TLS tests, made by the OpenSSL commands docs/security.md gives operators."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER_NAME = "gpu-share-extender.gpu-share.svc"  # the name the documented certificate carries and tlsConfig checks
CLIENT_NAME = "gpu-share-scheduler"


def documented_commands() -> list[str]:
    """The shell commands of docs/security.md's extender section, in order."""
    text = (ROOT / "docs" / "security.md").read_text()
    section = text[text.index("\n## The scheduler extender\n"):]
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

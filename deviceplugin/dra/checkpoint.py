"""The driver's own record of prepared claims, by claim UID, in one JSON file.

NodeUnprepareResources names only a claim's UID, namespace and name, and the claim may be gone from the API, so
what prepare did (the devices and shares each claim holds, its CDI spec) is written here before prepare answers.
A restarted plugin, or another instance during a rolling update, reads it back: unprepare still removes the
right spec, a repeated prepare returns the same CDI IDs, and the per-device share ledger is rebuilt from it.

Writes are atomic (a temporary file in the same directory, fsync, rename, fsync of the directory), so a crash
leaves the old file or the new one, never a mix. The file carries a CRC32 of its data; a file that does not
parse or whose checksum is wrong is moved aside (`<name>.corrupt`) and logged, and the driver starts empty.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class PreparedDevice:
    """One allocation result prepared for a claim."""

    request: str  # the base request name (`<req>` of `<req>/<sub>`)
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None
    shares: int  # shares of the device it holds (1 for a whole device, 0 for admin access)
    memory_mib: int  # GPU memory those shares give

    def to_json(self) -> dict[str, Any]:
        return {
            "request": self.request, "pool": self.pool, "device": self.device, "cdiIDs": list(self.cdi_ids),
            "shareID": self.share_id, "shares": self.shares, "memoryMiB": self.memory_mib,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreparedDevice:
        return cls(
            request=str(data["request"]), pool=str(data["pool"]), device=str(data["device"]),
            cdi_ids=tuple(str(i) for i in data["cdiIDs"]), share_id=None if data.get("shareID") is None else str(data["shareID"]),
            shares=int(data["shares"]), memory_mib=int(data["memoryMiB"]),
        )


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    cdi_spec: str  # the spec file's path ("" when none was written)

    def to_json(self) -> dict[str, Any]:
        return {"uid": self.uid, "namespace": self.namespace, "name": self.name, "cdiSpec": self.cdi_spec, "devices": [d.to_json() for d in self.devices]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreparedClaim:
        return cls(
            uid=str(data["uid"]), namespace=str(data["namespace"]), name=str(data["name"]), cdi_spec=str(data["cdiSpec"]),
            devices=tuple(PreparedDevice.from_json(d) for d in data["devices"]),
        )


class Checkpoint:
    """The prepared claims, kept in memory and in `path`; not thread-safe (the driver serialises its callers).

    `refresh()` re-reads the file when another process (a rolling-update twin, under the same file lock) wrote it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._claims: dict[str, PreparedClaim] = {}
        self._stat: tuple[int, int, int] | None = None
        self.refresh()

    def __contains__(self, uid: str) -> bool:
        return uid in self._claims

    def __len__(self) -> int:
        return len(self._claims)

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def claims(self) -> Iterator[PreparedClaim]:
        return iter(list(self._claims.values()))

    def put(self, claim: PreparedClaim) -> None:
        claims = {**self._claims, claim.uid: claim}
        self._write(claims)
        self._claims = claims

    def remove(self, uid: str) -> None:
        if uid not in self._claims:
            return
        claims = {k: v for k, v in self._claims.items() if k != uid}
        self._write(claims)
        self._claims = claims

    def refresh(self) -> bool:
        """Load the file if it changed since it was last read or written here; True when it was loaded."""
        stat = self._file_stat()
        if stat == self._stat:
            return False
        self._claims = self._load() if stat is not None else {}
        self._stat = self._file_stat()
        return True

    def _file_stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            outer = json.loads(self.path.read_bytes())
            data = outer["data"]
            if zlib.crc32(data.encode()) != outer["checksum"]:
                raise ValueError("checksum mismatch")
            content = json.loads(data)
            if content.get("version") != FORMAT_VERSION:
                raise ValueError(f"unknown format version {content.get('version')!r}")
            return {c["uid"]: PreparedClaim.from_json(c) for c in content["claims"]}
        except (OSError, ValueError, KeyError, TypeError) as err:
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.error("DRA checkpoint %s cannot be read (%s); moved to %s, starting with no prepared claims", self.path, err, aside)
            try:
                os.replace(self.path, aside)
            except OSError:
                pass
            return {}

    def _write(self, claims: dict[str, PreparedClaim]) -> None:
        data = json.dumps({"version": FORMAT_VERSION, "claims": [c.to_json() for c in claims.values()]}, separators=(",", ":"))
        atomic_write(self.path, json.dumps({"data": data, "checksum": zlib.crc32(data.encode())}).encode())
        self._stat = self._file_stat()


def atomic_write(path: Path, content: bytes) -> None:
    """Write `content` to `path` so that a reader or a crash sees the old file or the new one, never a mix. The
    temporary file's name starts with a dot, which CDI runtimes and the kubelet's plugin watcher skip."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)

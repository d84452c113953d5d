"""The driver's own record of prepared claims, by claim UID: one small JSON file per claim.

NodeUnprepareResources names only a claim's UID, namespace and name, and the claim may be gone from the API, so
what prepare did (the devices and shares each claim holds, its CDI spec) is written here before prepare answers.
A restarted plugin, or another instance during a rolling update, reads it back: unprepare still removes the
right spec, a repeated prepare returns the same CDI IDs, and the per-device share ledger is rebuilt from it.

One file per claim (`<dir>/<claim UID>.json`) keeps a prepare's write small whatever the number of claims. A write
goes to a temporary file, is fsynced and renamed over the old one: a reader or a crashed process never sees half a
record. The directory itself is not fsynced: only a kernel crash or a power loss can lose a rename, and those also
end every container using the claim; the kubelet prepares each claim again before it starts them anew (and an
unprepare of a claim not on record succeeds), so nothing is handed out twice. Each file carries a CRC32 of its
record.

A record that does not parse or whose checksum is wrong fails closed: it is renamed `<uid>.json.corrupt`
(quarantined, kept for the operator), logged and counted, and the claim stays in `damaged` (the driver fences its
devices) until `release` (the kubelet unprepared it, or the API shows it gone), which renames the file
`<uid>.json.corrupt.released`.

Every writer bumps `.generation` (before its write, under the shared lock), and `refresh` reads that file on every
call: a twin's write is seen whatever the file system's timestamp resolution (the directory's (inode, mtime) is
still compared, for a twin that does not bump it).
"""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomicfile import TMP, atomic_write

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUFFIX = ".json"
QUARANTINED = ".corrupt"  # appended to a damaged record's name
RELEASED = ".released"  # appended to a quarantined record's name once its claim is unprepared or gone
GENERATION = ".generation"
MAX_RECORDS = 65_536  # files read at start-up; far more than a node can hold
MAX_RECORD_BYTES = 1024 * 1024
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def valid_uid(uid: str) -> bool:
    """A UID that can name a record file (Kubernetes UIDs are UUIDs)."""
    return _UID.fullmatch(uid) is not None


@dataclass(frozen=True)
class MigRecord:
    """A dynamic-MIG instance made for a claim: the placement asked for and, once made, what NVML made there."""

    gpu: str  # the parent GPU's UUID
    profile_id: int
    start: int
    gi_id: int | None = None  # None: the intent, written before the instance is made
    ci_id: int | None = None
    uuid: str = ""  # the MIG device's UUID

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "profileID": self.profile_id,
            "start": self.start,
            "giID": self.gi_id,
            "ciID": self.ci_id,
            "uuid": self.uuid,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MigRecord:
        def number(key: str) -> int | None:
            return None if data.get(key) is None else int(data[key])

        return cls(
            gpu=str(data["gpu"]),
            profile_id=int(data["profileID"]),
            start=int(data["start"]),
            gi_id=number("giID"),
            ci_id=number("ciID"),
            uuid=str(data.get("uuid") or ""),
        )


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
    mig: MigRecord | None = None  # a dynamic-MIG device: the instance made for it
    strategy: str = ""  # the strategy a SharingConfig chose when not the pool's mode (`timeSlicing` on an MPS pool)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request": self.request,
            "pool": self.pool,
            "device": self.device,
            "cdiIDs": list(self.cdi_ids),
            "shareID": self.share_id,
            "shares": self.shares,
            "memoryMiB": self.memory_mib,
        }
        if self.mig:
            out["mig"] = self.mig.to_json()
        if self.strategy:  # records without one read as before
            out["strategy"] = self.strategy
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreparedDevice:
        return cls(
            request=str(data["request"]),
            pool=str(data["pool"]),
            device=str(data["device"]),
            cdi_ids=tuple(str(i) for i in data["cdiIDs"]),
            share_id=None if data.get("shareID") is None else str(data["shareID"]),
            shares=int(data["shares"]),
            memory_mib=int(data["memoryMiB"]),
            mig=MigRecord.from_json(data["mig"]) if data.get("mig") else None,
            strategy=str(data.get("strategy") or "")[:16],
        )


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    cdi_spec: str  # the spec file's path ("" when none was written)
    allocation: str = ""  # digest of the allocation results it was prepared from ("" in records of older versions)
    pending: bool = False  # the intent written before making its MIG instances: not prepared yet (dra.migdynamic)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "cdiSpec": self.cdi_spec,
            "devices": [d.to_json() for d in self.devices],
        }
        if self.allocation:
            data["allocation"] = self.allocation
        return {**data, "pending": True} if self.pending else data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreparedClaim:
        return cls(
            uid=str(data["uid"]),
            namespace=str(data["namespace"]),
            name=str(data["name"]),
            cdi_spec=str(data["cdiSpec"]),
            devices=tuple(PreparedDevice.from_json(d) for d in data["devices"]),
            allocation=str(data.get("allocation") or ""),
            pending=bool(data.get("pending", False)),
        )

    @property
    def mig(self) -> list[MigRecord]:
        return [d.mig for d in self.devices if d.mig]


class Checkpoint:
    """The prepared claims, kept in memory and in `directory`; not thread-safe (the driver serialises its callers).

    `refresh()` reads the directory again when another process (a rolling-update twin, under the same file lock)
    changed it. `damaged`: claim UID -> its quarantined record, for claims whose record could not be read.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._claims: dict[str, PreparedClaim] = {}
        self.damaged: dict[str, Path] = {}
        self.quarantined = 0  # records quarantined by this process
        self._stat: tuple[int, int] | None = None
        self._generation = b""
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
        """Write (or atomically replace) the claim's record; a quarantined record of the same claim is released."""
        data = json.dumps(claim.to_json(), sort_keys=True, separators=(",", ":"))
        record = f'{{"version":{FORMAT_VERSION},"checksum":{zlib.crc32(data.encode())},"claim":{data}}}'
        self._bump()
        atomic_write(self._path(claim.uid), record.encode())
        self._claims = {**self._claims, claim.uid: claim}
        if claim.uid in self.damaged:
            self.release(claim.uid)
        self._stat = self._dir_stat()

    def remove(self, uid: str) -> None:
        if uid not in self._claims:
            return
        self._bump()
        try:
            os.unlink(self._path(uid))
        except FileNotFoundError:
            pass
        self._claims = {k: v for k, v in self._claims.items() if k != uid}
        self._stat = self._dir_stat()

    def release(self, uid: str) -> None:
        """A damaged claim is unprepared or gone: its devices are no longer fenced; the record stays for the
        operator."""
        path = self.damaged.pop(uid, None)
        if path is None:
            return
        self._bump()
        try:
            os.replace(path, path.with_name(path.name + RELEASED))
        except FileNotFoundError:
            pass
        self._stat = self._dir_stat()

    def refresh(self, uid: str | None = None) -> bool:
        """Read the records again if another writer bumped the generation, the directory changed since it was last
        read or written here, or `uid`'s record is on disk but not in memory (or the reverse). True if read again."""
        stat = self._dir_stat()
        generation = self._read_generation()
        if (
            generation == self._generation
            and stat == self._stat
            and (uid is None or (uid in self._claims) == self._path(uid).exists())
        ):
            return False
        self._claims, self.damaged = self._load()
        self._stat = self._dir_stat()
        self._generation = self._read_generation()
        return True

    def sweep(self) -> int:
        """Remove temporary files a crashed writer left (call under the shared lock); how many."""
        return sweep_tmp(self.directory, ".")

    def _read_generation(self) -> bytes:
        try:
            with open(self.directory / GENERATION, "rb") as f:
                return f.read(64)
        except FileNotFoundError:
            return b""

    def _bump(self) -> None:
        """Tell twins the records change (before the change: a crash after it costs a twin one needless read)."""
        current = self._read_generation()
        self._generation = str(int(current or b"0") + 1 if current.strip().isdigit() else 1).encode()
        atomic_write(self.directory / GENERATION, self._generation, durable=False)

    def _path(self, uid: str) -> Path:
        if not valid_uid(uid):  # prepare.check_ref refuses such claims first
            raise ValueError(f"claim UID {uid[:80]!r} is not a UID")
        return self.directory / f"{uid}{SUFFIX}"

    def _dir_stat(self) -> tuple[int, int]:
        st = os.stat(self.directory)
        return (st.st_ino, st.st_mtime_ns)

    def _load(self) -> tuple[dict[str, PreparedClaim], dict[str, Path]]:
        claims: dict[str, PreparedClaim] = {}
        damaged: dict[str, Path] = {}
        for entry in sorted(os.scandir(self.directory), key=lambda e: e.name)[:MAX_RECORDS]:
            if entry.name.endswith(SUFFIX + QUARANTINED) and valid_uid(entry.name[: -len(SUFFIX + QUARANTINED)]):
                damaged[entry.name[: -len(SUFFIX + QUARANTINED)]] = Path(entry.path)
                continue
            if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
                continue
            path = Path(entry.path)
            try:
                if entry.stat().st_size > MAX_RECORD_BYTES:
                    raise ValueError(f"over {MAX_RECORD_BYTES} bytes")
                outer = json.loads(path.read_bytes())
                if outer.get("version") != FORMAT_VERSION:
                    raise ValueError(f"unknown format version {outer.get('version')!r}")
                data = json.dumps(outer["claim"], sort_keys=True, separators=(",", ":"))
                if zlib.crc32(data.encode()) != outer["checksum"]:
                    raise ValueError("checksum mismatch")
                claim = PreparedClaim.from_json(outer["claim"])
                if f"{claim.uid}{SUFFIX}" != entry.name:
                    raise ValueError(f"holds claim {claim.uid}")
                claims[claim.uid] = claim
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                uid = entry.name[: -len(SUFFIX)]
                aside = path.with_name(path.name + QUARANTINED)
                self.quarantined += 1
                log.error(
                    "DRA checkpoint record %s cannot be read (%s); quarantined as %s: the devices of claim %s stay "
                    "fenced until the kubelet "
                    "unprepares it or the API shows it gone",
                    path,
                    err,
                    aside,
                    uid,
                )
                try:
                    os.replace(path, aside)
                except OSError:
                    pass
                if valid_uid(uid):
                    damaged[uid] = aside
        return claims, damaged


def sweep_tmp(directory: Path, prefix: str) -> int:
    """Remove `atomic_write`'s temporary files (`<prefix>*.tmp`) a crashed writer left in `directory`; how many."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for entry in entries[:MAX_RECORDS]:
        if entry.name.startswith(prefix) and entry.name.endswith(TMP):
            try:
                os.unlink(entry.path)
                removed += 1
            except OSError:
                pass
    if removed:
        log.info("removed %d temporary files a crashed writer left in %s", removed, directory)
    return removed

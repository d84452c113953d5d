"""Reset evidence that outlives the process: the reset-class faults the health monitor waits on, kept in a small
JSON file keyed by GPU or MIG UUID, so a plugin or DRA driver restart (a SIGKILL, an upgrade) never makes a GPU that
needs a reset schedulable again.

The file names the node's boot (`/proc/sys/kernel/random/boot_id`): a reboot resets every GPU, so evidence of an
earlier boot is dropped. It is replaced atomically (`atomicfile`) and bounded (`MAX_BYTES`, `MAX_ENTRIES`, reasons
cut to `MAX_REASON_CHARS`). A file that cannot be read, or does not parse as this format, fails closed: it is
renamed `<name>.corrupt` for the operator and `Loaded.problem` says why; the monitor then holds every GPU of the
node for a reset, as if the file had named them all (docs/operations.md#gpu-health).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomicfile import atomic_write

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILE_NAME = "reset-evidence.json"
# Under --plugin-dir: the kubelet's clean-up removes sockets (and, before 1.30, files), never directories.
DEVICE_PLUGIN_DIR = "gpu-share"
CORRUPT = ".corrupt"
MAX_BYTES = 1024 * 1024  # above the largest file `save` writes (MAX_ENTRIES of the longest fields, all escaped)
MAX_ENTRIES = 256
MAX_REASON_CHARS = 200
MAX_UUID_CHARS = 96
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Evidence:
    """One reset-class fault: on `uuid` (a GPU, or one MIG instance of `gpu_uuid`), why, and whether the driver's
    recovery action has asked for a reset since (the first half of the evidence that clears it)."""

    uuid: str
    gpu_uuid: str
    reason: str
    required_seen: bool = False


@dataclass(frozen=True)
class Loaded:
    entries: Mapping[str, Evidence] = field(default_factory=dict)  # uuid -> evidence
    problem: str | None = None  # the file exists but cannot be used: fail closed


def read_boot_id(path: Path = BOOT_ID) -> str | None:
    """The kernel's boot ID (the host's, also inside a container); None when it cannot be read."""
    try:
        return path.read_text(encoding="ascii").strip()[:64] or None
    except (OSError, UnicodeDecodeError):
        return None


class EvidenceFile:
    """The reset evidence at `path`; `boot_id` is called once per load and save."""

    def __init__(self, path: Path, boot_id: Callable[[], str | None] = read_boot_id) -> None:
        self.path = path
        self.boot_id = boot_id

    def load(self) -> Loaded:
        """What the file holds for this boot (a missing file: nothing; an earlier boot's: nothing, logged)."""
        try:
            with self.path.open("rb") as f:
                raw = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return Loaded()
        except OSError as err:
            return Loaded(problem=f"cannot read {self.path}: {err.strerror or err}")
        try:
            if len(raw) > MAX_BYTES:
                raise ValueError(f"over {MAX_BYTES} bytes")
            booted, entries = _parse(json.loads(raw.decode("utf-8")))
        except (ValueError, UnicodeDecodeError) as err:
            self._set_aside()
            return Loaded(problem=f"{self.path} is not valid reset evidence ({err}); kept as {self.path.name}{CORRUPT}")
        now = self.boot_id()
        if booted and now and booted != now:
            if entries:
                log.info(
                    "reset evidence of %d GPU(s) in %s is from an earlier boot: the reboot reset them, "
                    "so it is dropped",
                    len(entries),
                    self.path,
                )
            return Loaded()
        return Loaded(entries)

    def save(self, entries: Mapping[str, Evidence]) -> None:
        """Replace the file with `entries` (at most MAX_ENTRIES, the first kept; reasons cut to MAX_REASON_CHARS);
        OSError when it cannot be written. An entry whose UUIDs are over MAX_UUID_CHARS cannot come from NVML, and
        is left out rather than written into a file the next start would refuse."""
        kept = [e for e in entries.values() if max(len(e.uuid), len(e.gpu_uuid)) <= MAX_UUID_CHARS][:MAX_ENTRIES]
        body = {
            "version": FORMAT_VERSION,
            "bootId": self.boot_id(),
            "evidence": {
                e.uuid: {"gpu": e.gpu_uuid, "reason": e.reason[:MAX_REASON_CHARS], "resetRequiredSeen": e.required_seen}
                for e in kept
            },
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(body, indent=1).encode())

    def _set_aside(self) -> None:
        try:
            os.replace(self.path, self.path.with_name(self.path.name + CORRUPT))
        except OSError as err:
            log.error("cannot set aside the unreadable reset evidence %s: %s", self.path, err)


def _parse(data: Any) -> tuple[str | None, dict[str, Evidence]]:
    """(boot ID, entries) of the file's content; ValueError naming the field that is wrong."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"version: expected {FORMAT_VERSION}, got {str(data.get('version'))[:20]!r}")
    booted = data.get("bootId")
    if booted is not None and not isinstance(booted, str):
        raise ValueError("bootId: not a string")
    table = data.get("evidence")
    if not isinstance(table, dict):
        raise ValueError("evidence: not an object")
    if len(table) > MAX_ENTRIES:
        raise ValueError(f"evidence: {len(table)} entries, over {MAX_ENTRIES}")
    entries = {}
    for uuid, item in table.items():
        where = f"evidence[{uuid[:MAX_UUID_CHARS]!r}]"
        if not uuid or len(uuid) > MAX_UUID_CHARS or not isinstance(item, dict):
            raise ValueError(f"{where}: not a UUID with an object")
        gpu, reason, seen = item.get("gpu"), item.get("reason"), item.get("resetRequiredSeen")
        if not isinstance(gpu, str) or not gpu or len(gpu) > MAX_UUID_CHARS:
            raise ValueError(f"{where}.gpu: not a GPU UUID")
        if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
            raise ValueError(f"{where}.reason: not a string of at most {MAX_REASON_CHARS} characters")
        if not isinstance(seen, bool):
            raise ValueError(f"{where}.resetRequiredSeen: not true or false")
        entries[uuid] = Evidence(uuid, gpu, reason, seen)
    return booted, entries

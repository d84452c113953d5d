"""CDI specs the driver writes per prepared claim: what the container runtime injects for the claim's devices.

One spec file per claim (`<driver>_<claim UID>.json` under the CDI root), one CDI device per request of the
claim, named `<claim UID>-<request index>` and answered with the request's first result (unique per claim;
runtimes cache specs, so a name is never reused for other content). Its containerEdits carry the request's one
grant (`devices.request_grant`: all its GPUs in one environment, since a runtime keeps one value of each
variable): environment, mounts, device nodes. IDs are `<vendor>/<class>=<name>` with kind `k8s.<driver>/claim`.

Specs are replaced atomically (rename) but not fsynced: the CDI root is normally a tmpfs (`/var/run/cdi`), where
a reboot loses them anyway, and the checkpoint (which is fsynced) is the record. A prepare of a claim already
prepared writes its spec again when it is missing or does not parse (`CdiWriter.intact`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..alloc.allocator import ContainerGrant
from ..atomicfile import atomic_write
from .checkpoint import sweep_tmp

CDI_VERSION = "0.6.0"
CDI_CLASS = "claim"


def cdi_kind(driver: str) -> str:
    """The CDI kind of the driver's claim devices: `k8s.<driver>/claim`, e.g. `k8s.gpu-share.example.com/claim`."""
    return f"k8s.{driver}/{CDI_CLASS}"


def cdi_device_name(claim_uid: str, index: int) -> str:
    return f"{claim_uid}-{index}"


def cdi_id(kind: str, name: str) -> str:
    return f"{kind}={name}"


def container_edits(grant: ContainerGrant) -> dict[str, Any]:
    edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in sorted(grant.envs.items())]}
    if grant.mounts:
        edits["mounts"] = [
            {
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": ["rbind", "ro" if m.read_only else "rw"],
            }
            for m in grant.mounts
        ]
    if grant.device_specs:
        edits["deviceNodes"] = [
            {"path": d.container_path, "hostPath": d.host_path, "permissions": d.permissions}
            for d in grant.device_specs
        ]
    return edits


class CdiWriter:
    """Writes and removes the per-claim spec files under `root` (created when missing)."""

    def __init__(self, root: Path, driver: str) -> None:
        self.root = root
        self.driver = driver
        self.kind = cdi_kind(driver)

    def spec_path(self, claim_uid: str) -> Path:
        return self.root / f"{self.driver}_{claim_uid}.json"

    def spec(self, claim_uid: str, grants: Sequence[ContainerGrant]) -> dict[str, Any]:
        return {
            "cdiVersion": CDI_VERSION,
            "kind": self.kind,
            "devices": [
                {"name": cdi_device_name(claim_uid, i), "containerEdits": container_edits(g)}
                for i, g in enumerate(grants)
            ],
        }

    def write(self, claim_uid: str, grants: Sequence[ContainerGrant]) -> Path:
        """Write the claim's spec atomically; the path."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.spec_path(claim_uid)
        atomic_write(path, json.dumps(self.spec(claim_uid, grants), indent=1).encode(), durable=False)
        return path

    def intact(self, path: str) -> bool:
        """The spec file exists and is the JSON object this writer writes."""
        try:
            with open(path, "rb") as f:
                return isinstance(json.load(f), dict)
        except (OSError, ValueError):
            return False

    def sweep(self) -> int:
        """Remove temporary spec files a crashed writer of this driver left (under the shared lock); how many."""
        return sweep_tmp(self.root, f".{self.driver}_")

    def remove(self, path: str) -> None:
        """Remove a spec this driver wrote (already gone is fine)."""
        if not path:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

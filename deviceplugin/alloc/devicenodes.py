"""The device nodes a container of a GPU needs (`deviceSpecs`): the control nodes, /dev/nvidiaN and MIG capabilities."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..model.devices import Unit
from ..model.node import Gpu

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


class MissingCapability(Exception):
    """A MIG instance's capability nodes cannot be read: a container given it could not use it."""


@dataclass(frozen=True)
class DeviceNode:
    """A device node made available in the container at `container_path`, from `host_path` on the node."""

    container_path: str
    host_path: str
    permissions: str = "rw"


def _minor(gpu: Gpu) -> int:
    return gpu.minor_number if gpu.minor_number is not None else gpu.index


def _host_path(device_root: str, path: str) -> str:
    return str(Path(device_root) / path.lstrip("/"))


def device_specs(device_root: str, units: list[Unit]) -> list[DeviceNode]:
    """/dev/nvidiactl, the UVM nodes, each GPU's /dev/nvidiaN and, for MIG, its capability nodes."""
    paths = list(CONTROL_NODES)
    for unit in units:
        paths.append(f"/dev/nvidia{_minor(unit.gpu)}")
        if unit.mig:
            paths += mig_capability_devices(device_root, _minor(unit.gpu), unit.mig.gi_id, unit.mig.ci_id)
    return [DeviceNode(container_path=p, host_path=_host_path(device_root, p)) for p in dict.fromkeys(paths)]


def missing_device_nodes(device_root: str, gpu: Gpu) -> list[str]:
    """Host paths `deviceSpecs` hands a container of this GPU that do not exist (MIG capability nodes aside)."""
    paths = [_host_path(device_root, p) for p in (*CONTROL_NODES, f"/dev/nvidia{_minor(gpu)}")]
    return [p for p in paths if not Path(p).exists()]


_MIG_CAPABILITIES: dict[
    tuple[str, int, int, int], tuple[str, ...]
] = {}  # complete reads only (bounded by MIG instances)


def mig_capability_devices(device_root: str, minor: int, gi: int, ci: int) -> tuple[str, ...]:
    """The /dev/nvidia-caps nodes that grant access to one MIG instance, from /proc/driver/nvidia/capabilities.

    Only a read that found both nodes is remembered; a failed or partial one raises MissingCapability (the grant is
    refused, and the read retried on the next one).
    """
    key = (device_root, minor, gi, ci)
    if key in _MIG_CAPABILITIES:
        return _MIG_CAPABILITIES[key]
    found, problems = _read_capabilities(device_root, minor, gi, ci)
    if problems:
        raise MissingCapability(problems[0])
    if len(_MIG_CAPABILITIES) < 4096:
        _MIG_CAPABILITIES[key] = tuple(found)
    return tuple(found)


def missing_mig_capabilities(device_root: str, gpu: Gpu) -> dict[str, str]:
    """MIG UUID -> why `deviceSpecs` cannot hand out its capability nodes (unreadable, or missing on the host)."""
    problems = {}
    for mig in gpu.mig_devices:
        found, unread = _read_capabilities(device_root, _minor(gpu), mig.gi_id, mig.ci_id)
        missing = [p for p in (_host_path(device_root, f) for f in found) if not Path(p).exists()]
        if unread or missing:
            problems[mig.uuid] = "; ".join(unread + [f"MIG capability device node {p} missing" for p in missing])
    return problems


def _read_capabilities(device_root: str, minor: int, gi: int, ci: int) -> tuple[list[str], list[str]]:
    """(the capability nodes of one MIG instance found, why the others were not): the health check and the grant read
    them the same way."""
    base = Path(device_root) / "proc/driver/nvidia/capabilities" / f"gpu{minor}" / "mig" / f"gi{gi}"
    found, problems = [], []
    for access in (base / "access", base / f"ci{ci}" / "access"):
        try:
            text = access.read_text()
        except OSError as err:
            problems.append(f"cannot read MIG capability {access} ({err.strerror or err})")
            continue
        match = re.search(r"DeviceFileMinor:\s*(\d+)", text)
        if match:
            found.append(f"/dev/nvidia-caps/nvidia-cap{match.group(1)}")
        else:
            problems.append(f"MIG capability {access} names no DeviceFileMinor")
    return found, problems

"""Each DRA device's health, read from `state.NodeState`: what NodeWatchResources streams and what prepare refuses.

Pure: no transport. A device is Unhealthy when the health monitor marks its GPU or MIG instance (with the
monitor's reason), when the residue guard quarantines its GPU, or when its pool's MPS control daemon is not ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..logs import safe_text
from ..state import NodeView
from .devices import DraDevice

MAX_MESSAGE_CHARS = 1024  # the kubelet cuts longer health messages


@dataclass(frozen=True)
class DeviceHealth:
    name: str
    healthy: bool
    message: str


def unhealthy_reason(device: DraDevice, view: NodeView) -> str | None:
    """Why `device` must not be handed out now, or None when it is Healthy."""
    unit = device.unit
    if unit.is_unhealthy(view.unhealthy):
        reason = view.reasons.get(unit.uuid) or view.reasons.get(unit.gpu.uuid) or "marked unhealthy by the health monitor"
        return _bounded(f"GPU {unit.gpu.index} ({unit.uuid}): {reason}")
    if unit.gpu.uuid in view.quarantined_gpus:
        return _bounded(f"GPU {unit.gpu.index} ({unit.gpu.uuid}) is quarantined by the residue guard: a finished container's memory is still in use")
    pool = device.resource.pool
    if pool.mps and pool.name in view.mps_not_ready:
        return _bounded(f"the MPS control daemon of pool {pool.name} is not ready")
    return None


def device_health(devices: Sequence[DraDevice], view: NodeView) -> list[DeviceHealth]:
    """Every device with its verdict, in the order given."""
    result = []
    for device in devices:
        reason = unhealthy_reason(device, view)
        result.append(DeviceHealth(device.name, reason is None, reason or "healthy"))
    return result


def _bounded(message: str) -> str:
    return safe_text(message, MAX_MESSAGE_CHARS - 32)  # room for safe_text's "...(N chars)"

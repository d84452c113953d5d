"""Each DRA device's health, read from `state.NodeState`: what NodeWatchResources streams and what prepare refuses.

Pure: no transport. A device is Unhealthy when the health monitor marks its GPU or MIG instance (with the
monitor's reason), when the residue guard quarantines its GPU, or when its pool's MPS control daemon is not ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..logs import safe_text
from ..state import SHAPE_PENDING, NodeView
from .devices import DraDevice

MAX_MESSAGE_CHARS = 1024  # the kubelet cuts longer health messages


@dataclass(frozen=True)
class DeviceHealth:
    name: str
    healthy: bool
    message: str


def unhealthy_reason(device: DraDevice, view: NodeView) -> str | None:
    """Why `device` must not be handed out now, or None when it is Healthy: its unit's verdict (`NodeView.verdict`),
    less a shape that waits (the device keeps its old shape and stays Healthy; prepare refuses it, dra.prepare)."""
    verdict = view.verdict(device.unit, device.resource.pool)
    shown = next((f for f in verdict.findings if f.kind != SHAPE_PENDING), None)
    return _bounded(shown.reason) if shown else None


def device_health(devices: Sequence[DraDevice], view: NodeView) -> list[DeviceHealth]:
    """Every device with its verdict, in the order given."""
    result = []
    for device in devices:
        reason = unhealthy_reason(device, view)
        result.append(DeviceHealth(device.name, reason is None, reason or "healthy"))
    return result


def _bounded(message: str) -> str:
    return safe_text(message, MAX_MESSAGE_CHARS - 32)  # room for safe_text's "...(N chars)"

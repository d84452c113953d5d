"""Device taints from the node's runtime state: an unhealthy or quarantined unit is tainted `NoSchedule`, so
kube-scheduler gives it no new claim (claims already allocated keep it: the effect never evicts).

Pure data, no transport. Keys are under the driver's name (`gpu-share.<domain>/...`), values are label values:

- `<driver>/unhealthy`: the health monitor marked the GPU or MIG instance; the value is the reason class
  (the verdict's fault kinds, `state.FAULTS`). A MIG instance inherits its GPU's taint, and a shared device is
  tainted when its unit is.
- `<driver>/quarantined` = `residue`: the residue guard holds the GPU back (a finished tenant's memory is still
  in use on it).
- `<driver>/mps-unavailable` = `control-daemon`: the device's MPS pool has no ready control daemon.

Each taint goes away with its cause (docs/dra.md#device-taints).
"""

from __future__ import annotations

from typing import Any

from .. import state
from ..state import FAULTS, NodeView
from .devices import DraDevice

EFFECT = "NoSchedule"
UNHEALTHY = "unhealthy"
QUARANTINED = "quarantined"
MPS_UNAVAILABLE = "mps-unavailable"

# Verdict kind -> (taint name, value); a fault kind is its own value. A shape that waits is no taint: the device
# keeps its old shape in the slice (dra.shapes) and prepare refuses it.
TAINTS: dict[str, tuple[str, str] | None] = {
    **{kind: (UNHEALTHY, kind) for kind in FAULTS},
    state.QUARANTINED: (QUARANTINED, "residue"),
    state.MPS_DOWN: (MPS_UNAVAILABLE, "control-daemon"),
    state.SHAPE_PENDING: None,
}


def taint_key(driver: str, name: str) -> str:
    return f"{driver}/{name}"


def device_taints(device: DraDevice, view: NodeView, driver: str) -> list[dict[str, Any]]:
    """The device's taints (resource.k8s.io/v1 `DeviceTaint` dicts without `timeAdded`), in a fixed order: its
    unit's verdict (`NodeView.verdict`), one taint per finding."""
    taints = []
    for finding in view.verdict(device.unit, device.resource.pool).findings:
        mapped = TAINTS[finding.kind]
        if mapped is not None:
            taints.append({"key": taint_key(driver, mapped[0]), "value": mapped[1], "effect": EFFECT})
    return taints


def taint_inputs(view: NodeView) -> tuple[Any, ...]:
    """The part of the node state the taints depend on: a change of anything else needs no new slices."""
    return (view.reasons, view.awaiting_reset, view.quarantined_gpus, view.mps_not_ready)

"""Device taints from the node's runtime state: an unhealthy or quarantined unit is tainted `NoSchedule`, so
kube-scheduler gives it no new claim (claims already allocated keep it: the effect never evicts).

Pure data, no transport. Keys are under the driver's name (`gpu-share.<domain>/...`), values are label values:

- `<driver>/unhealthy`: the health monitor marked the GPU or MIG instance; the value is the reason class
  (`REASON_CLASSES`). A MIG instance inherits its GPU's taint, and a shared device is tainted when its unit is.
- `<driver>/quarantined` = `residue`: the residue guard holds the GPU back (a finished tenant's memory is still
  in use on it).
- `<driver>/mps-unavailable` = `control-daemon`: the device's MPS pool has no ready control daemon.

Each taint goes away with its cause (docs/dra.md#device-taints).
"""

from __future__ import annotations

import re
from typing import Any

from ..state import NodeView
from .devices import DraDevice

EFFECT = "NoSchedule"
UNHEALTHY = "unhealthy"
QUARANTINED = "quarantined"
MPS_UNAVAILABLE = "mps-unavailable"

# The value of the unhealthy taint: what kind of fault, from the health monitor's reason.
GPU_LOST = "gpu-lost"  # the GPU stopped answering (fell off the bus); cleared when it answers again
RESET_REQUIRED = "reset-required"  # a reset-class XID, a double-bit ECC error or the driver's recovery action
XID = "xid"  # another critical XID; cleared after the health monitor's quiet period
QUERY_FAILED = "query-failed"  # an NVML query (or a device-node check) failed
REASON_CLASSES = (GPU_LOST, RESET_REQUIRED, XID, QUERY_FAILED)

_XID = re.compile(r"\bXID \d+\b")


def taint_key(driver: str, name: str) -> str:
    return f"{driver}/{name}"


def reason_class(reason: str, awaiting_reset: bool) -> str:
    """The class of a health monitor reason ("XID 79", "GPU is lost", "NVML query on GPU ... failed: ...")."""
    if "lost" in reason.lower():
        return GPU_LOST
    if awaiting_reset:
        return RESET_REQUIRED
    if _XID.search(reason):
        return XID
    return QUERY_FAILED


def device_taints(device: DraDevice, view: NodeView, driver: str) -> list[dict[str, Any]]:
    """The device's taints (resource.k8s.io/v1 `DeviceTaint` dicts without `timeAdded`), in a fixed order."""
    unit, gpu = device.unit, device.unit.gpu
    taints = []
    # The GPU's own fault first: a MIG instance inherits it.
    for uuid in (gpu.uuid, unit.uuid):
        if uuid in view.reasons:
            value = reason_class(view.reasons[uuid], uuid in view.awaiting_reset)
            taints.append({"key": taint_key(driver, UNHEALTHY), "value": value, "effect": EFFECT})
            break
    if gpu.uuid in view.quarantined_gpus:
        taints.append({"key": taint_key(driver, QUARANTINED), "value": "residue", "effect": EFFECT})
    if device.resource.pool.mps and device.resource.pool.name in view.mps_not_ready:
        taints.append({"key": taint_key(driver, MPS_UNAVAILABLE), "value": "control-daemon", "effect": EFFECT})
    return taints


def taint_inputs(view: NodeView) -> tuple[Any, ...]:
    """The part of the node state the taints depend on: a change of anything else needs no new slices."""
    return (view.reasons, view.awaiting_reset, view.quarantined_gpus, view.mps_not_ready)

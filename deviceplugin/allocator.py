"""Where shares land (GetPreferredAllocation) and what a container receives (Allocate).

Everything here is a pure function of the resource and the device IDs in the request,
so repeated calls with the same IDs give the same answer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import grpc

from .api import deviceplugin_pb2 as pb
from .resources import Device, Resource, Unit

# Environment variables a share-aware application can read.
ENV_SHARE_COUNT = "GPU_SHARE_COUNT"
ENV_SHARE_TOTAL = "GPU_SHARE_TOTAL"
ENV_MEMORY_LIMIT = "GPU_SHARE_MEMORY_LIMIT_MIB"
ENV_COMPUTE_PERCENT = "GPU_SHARE_COMPUTE_PERCENT"


class AllocationError(Exception):
    """A request the plugin refuses; becomes a gRPC status with this code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def preferred_allocation(resource: Resource, available: Iterable[str], must_include: Iterable[str], size: int) -> list[str]:
    """Pick `size` devices from `available`, keeping `must_include`; all shares on one unit (GPU or MIG) when possible."""
    known = _dedupe(i for i in available if i in resource.devices)
    must = _dedupe(i for i in must_include if i in resource.devices)
    if size <= len(must):
        return must
    free: dict[str, list[Device]] = defaultdict(list)  # unit uuid -> its free devices
    for device_id in known:
        if device_id not in must:
            free[resource.devices[device_id].unit.uuid].append(resource.devices[device_id])
    chosen = list(must)
    for uuid in _unit_order(resource, free, must, size - len(must)):
        for device in sorted(free[uuid], key=lambda d: d.share or 0):
            if len(chosen) == size:
                return chosen
            chosen.append(device.id)
    return chosen


def _unit_order(resource: Resource, free: dict[str, list[Device]], must: list[str], wanted: int) -> list[str]:
    """Units in the order to take devices from."""
    rank = {u.uuid: i for i, u in enumerate(resource.units)}  # GPU index order, MIG instances in order
    in_order = sorted(free, key=rank.__getitem__)
    if not resource.pool.shared:
        return in_order
    must_units = {resource.devices[i].unit.uuid for i in must}
    if must_units:
        # Complete the unit(s) already holding must_include first.
        return sorted(in_order, key=lambda u: u not in must_units)
    fitting = [u for u in in_order if len(free[u]) >= wanted]
    if fitting:
        # binpack: the fullest unit (fewest free shares) that still fits; spread: the emptiest.
        sign = 1 if resource.allocation_policy == "binpack" else -1
        best = min(fitting, key=lambda u: (sign * len(free[u]), rank[u]))
        return [best] + [u for u in in_order if u != best]
    # Nothing fits on one unit: the largest pieces first, so the refusal in Allocate names few units.
    return sorted(in_order, key=lambda u: -len(free[u]))


def container_response(resource: Resource, device_ids: Iterable[str], unhealthy: frozenset[str] = frozenset()) -> pb.ContainerAllocateResponse:
    """The envs a container gets for these devices, or AllocationError."""
    ids = sorted(set(device_ids))
    if not ids:
        raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"no device IDs in the request for {resource.name}")
    unknown = [i for i in ids if i not in resource.devices]
    if unknown:
        raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown device IDs for {resource.name}: {_listing(unknown)}")
    devices = [resource.devices[i] for i in ids]
    sick = [d.id for d in devices if d.unit.uuid in unhealthy or d.gpu.uuid in unhealthy]
    if sick:
        raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION, f"devices on an unhealthy GPU for {resource.name}: {_listing(sick)}")
    units = _units_of(resource, devices)
    if resource.pool.shared and len(units) > 1:
        kind = "MIG instances" if units[0].mig else "GPUs"
        per_unit = "; ".join(f"{u.uuid} shares {','.join(str(d.share) for d in devices if d.unit is u)}" for u in units)
        raise AllocationError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"shares of {resource.name} span {len(units)} {kind} ({per_unit}); all shares of a container must be on one {kind[:-1]}",
        )
    visible = ",".join(u.uuid for u in units)
    envs = {"NVIDIA_VISIBLE_DEVICES": visible, "CUDA_VISIBLE_DEVICES": visible}
    if resource.pool.shared:
        unit, count, total = units[0], len(devices), resource.replicas
        envs[ENV_SHARE_COUNT] = str(count)
        envs[ENV_SHARE_TOTAL] = str(total)
        envs[ENV_MEMORY_LIMIT] = str(unit.memory_mib * count // total)
        envs[ENV_COMPUTE_PERCENT] = str(100 * count // total)
    return pb.ContainerAllocateResponse(envs=envs)


def _units_of(resource: Resource, devices: list[Device]) -> list[Unit]:
    used = {d.unit.uuid for d in devices}
    return [u for u in resource.units if u.uuid in used]


def _dedupe(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def _listing(ids: list[str], limit: int = 8) -> str:
    shown = ", ".join(ids[:limit])
    return shown if len(ids) <= limit else f"{shown} and {len(ids) - limit} more"

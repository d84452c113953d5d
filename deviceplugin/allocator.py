"""Where shares land (GetPreferredAllocation) and what a container receives (Allocate).

Everything here is a pure function of the resource and the device IDs in the request,
so repeated calls with the same IDs give the same answer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import grpc

from .api import deviceplugin_pb2 as pb
from .inventory import Gpu
from .resources import Device, Resource

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
    """Pick `size` devices from `available`, keeping `must_include`; all shares on one GPU when possible."""
    known = _dedupe(i for i in available if i in resource.devices)
    must = _dedupe(i for i in must_include if i in resource.devices)
    if size <= len(must):
        return must
    free_by_gpu: dict[str, list[Device]] = defaultdict(list)
    for device_id in known:
        if device_id not in must:
            free_by_gpu[resource.devices[device_id].gpu.uuid].append(resource.devices[device_id])
    wanted = size - len(must)
    gpu_order = _gpu_order(resource, free_by_gpu, must, wanted)
    chosen = list(must)
    for uuid in gpu_order:
        for device in sorted(free_by_gpu[uuid], key=lambda d: d.share or 0):
            if len(chosen) == size:
                return chosen
            chosen.append(device.id)
    return chosen


def _gpu_order(resource: Resource, free_by_gpu: dict[str, list[Device]], must: list[str], wanted: int) -> list[str]:
    """GPUs in the order to take devices from."""
    gpu_of = {g.uuid: g for g in resource.gpus}
    by_index = sorted(free_by_gpu, key=lambda u: gpu_of[u].index)
    if not resource.pool.shared:
        return by_index
    must_gpus = {resource.devices[i].gpu.uuid for i in must}
    if must_gpus:
        # Complete the GPU(s) already holding must_include first.
        return sorted(by_index, key=lambda u: u not in must_gpus)
    fitting = [u for u in by_index if len(free_by_gpu[u]) >= wanted]
    if fitting:
        # binpack: the fullest GPU (fewest free shares) that still fits; spread: the emptiest.
        sign = 1 if resource.allocation_policy == "binpack" else -1
        best = min(fitting, key=lambda u: (sign * len(free_by_gpu[u]), gpu_of[u].index))
        return [best] + [u for u in by_index if u != best]
    # Nothing fits on one GPU: the largest pieces first, so the refusal in Allocate names few GPUs.
    return sorted(by_index, key=lambda u: -len(free_by_gpu[u]))


def container_response(resource: Resource, device_ids: Iterable[str], unhealthy_gpus: frozenset[str] = frozenset()) -> pb.ContainerAllocateResponse:
    """The envs a container gets for these devices, or AllocationError."""
    ids = sorted(set(device_ids))
    if not ids:
        raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"no device IDs in the request for {resource.name}")
    unknown = [i for i in ids if i not in resource.devices]
    if unknown:
        raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown device IDs for {resource.name}: {_listing(unknown)}")
    devices = [resource.devices[i] for i in ids]
    sick = [d.id for d in devices if d.gpu.uuid in unhealthy_gpus]
    if sick:
        raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION, f"devices on an unhealthy GPU for {resource.name}: {_listing(sick)}")
    gpus = _gpus_of(devices)
    if resource.pool.shared and len(gpus) > 1:
        per_gpu = "; ".join(f"{g.uuid} shares {','.join(str(d.share) for d in devices if d.gpu is g)}" for g in gpus)
        raise AllocationError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"shares of {resource.name} span {len(gpus)} GPUs ({per_gpu}); all shares of a container must be on one GPU",
        )
    visible = ",".join(g.uuid for g in gpus)
    envs = {"NVIDIA_VISIBLE_DEVICES": visible, "CUDA_VISIBLE_DEVICES": visible}
    if resource.pool.shared:
        gpu, count, total = gpus[0], len(devices), resource.replicas
        envs[ENV_SHARE_COUNT] = str(count)
        envs[ENV_SHARE_TOTAL] = str(total)
        envs[ENV_MEMORY_LIMIT] = str(gpu.memory_mib * count // total)
        envs[ENV_COMPUTE_PERCENT] = str(100 * count // total)
    return pb.ContainerAllocateResponse(envs=envs)


def _gpus_of(devices: list[Device]) -> list[Gpu]:
    seen: dict[str, Gpu] = {}
    for device in devices:
        seen.setdefault(device.gpu.uuid, device.gpu)
    return sorted(seen.values(), key=lambda g: g.index)


def _dedupe(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def _listing(ids: list[str], limit: int = 8) -> str:
    shown = ", ".join(ids[:limit])
    return shown if len(ids) <= limit else f"{shown} and {len(ids) - limit} more"

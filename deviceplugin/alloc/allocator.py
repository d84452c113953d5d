"""Where shares land (GetPreferredAllocation) and what a container receives (Allocate).

Everything here is a pure function of the resource and the device IDs in the request,
so repeated calls with the same IDs give the same answer.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterable
from itertools import combinations
from math import comb
from pathlib import Path

import grpc

from ..api import deviceplugin_pb2 as pb
from ..logs import brief
from ..mps.paths import MpsPaths
from ..model.node import Gpu
from .plan import Device, Resource, Unit

log = logging.getLogger(__name__)

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
    if resource.pool.mode == "exclusive":  # whenever there is a choice (size > len(must)), topology decides
        return must + _best_connected(resource, [i for i in known if i not in must], must, size - len(must))
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
        if resource.allocation_policy in CLUSTER_POLICIES:
            best = _cluster_choice(resource, free, fitting, wanted)
        else:
            # binpack: the fullest unit (fewest free shares) that still fits; spread: the emptiest.
            sign = 1 if resource.allocation_policy == "binpack" else -1
            best = min(fitting, key=lambda u: (sign * len(free[u]), rank[u]))
        return [best] + [u for u in in_order if u != best]
    # Nothing fits on one unit: the largest pieces first, so the refusal in Allocate names few units.
    return sorted(in_order, key=lambda u: -len(free[u]))


CLUSTER_POLICIES = frozenset({"fgdstrand"})


def _cluster_choice(resource: Resource, free: dict[str, list[Device]], fitting: list[str], wanted: int) -> str:
    """The unit the cluster policy would pick on this node: each unit a GPU, k of N free shares = k/N of it free.

    Units with unequal share counts (MIG instances of different sizes) have no common measure: binpack then.
    """
    from ..cluster.policies import share_unit

    replicas = {u.replicas for u in resource.units}
    if len(replicas) != 1:
        return min(fitting, key=lambda u: len(free[u]))
    (n,) = replicas
    best = share_unit(resource.allocation_policy, [len(free.get(u.uuid, ())) for u in resource.units], n, wanted)
    return resource.units[best].uuid if best is not None else fitting[0]


_MAX_COMBINATIONS = 5000


def _best_connected(resource: Resource, candidates: list[str], must: list[str], wanted: int) -> list[str]:
    """Whole GPUs for a multi-GPU request: the most NVLinks among them, then the fewest NUMA nodes, then low indexes."""
    gpus = {i: resource.devices[i].gpu for i in candidates + must}

    def score(ids: Iterable[str]) -> tuple[int, int, int]:
        chosen = [gpus[i] for i in (*must, *ids)]
        nvlinks = sum(resource.link(a, b).nvlinks for a, b in combinations(chosen, 2))
        return (nvlinks, -len({g.numa_node for g in chosen}), -sum(g.index for g in chosen))

    candidates = sorted(candidates, key=lambda i: gpus[i].index)
    if len(candidates) <= wanted:
        return candidates
    if comb(len(candidates), wanted) <= _MAX_COMBINATIONS:
        return list(max(combinations(candidates, wanted), key=score))
    chosen: tuple[str, ...] = ()
    for _ in range(wanted):  # greedy on large nodes
        chosen += (max((i for i in candidates if i not in chosen), key=lambda i: score(chosen + (i,))),)
    return list(chosen)


def container_response(resource: Resource, device_ids: Iterable[str], unhealthy: frozenset[str] = frozenset()) -> pb.ContainerAllocateResponse:
    """What a container gets for these devices, or AllocationError."""
    ids = sorted(set(device_ids))
    if not ids:
        raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"no device IDs in the request for {resource.name}")
    unknown = [i for i in ids if i not in resource.devices]
    if unknown:
        raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown device IDs for {resource.name}: {brief(unknown, 8)}")
    devices = [resource.devices[i] for i in ids]
    sick = [d.id for d in devices if d.unit.uuid in unhealthy or d.gpu.uuid in unhealthy or d.id in unhealthy]
    if sick:
        raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION, f"devices on an unhealthy GPU for {resource.name}: {brief(sick, 8)}")
    pool, config = resource.pool, resource.config
    units = _units_of(resource, devices)
    if pool.shared and len(units) > 1 and not pool.allow_span:
        kind = "MIG instances" if units[0].mig else "GPUs"
        per_unit = "; ".join(f"{u.uuid} shares {brief([str(d.share) for d in devices if d.unit is u], 8)}" for u in units[:8])
        per_unit += f"; and {len(units) - 8} more" if len(units) > 8 else ""
        raise AllocationError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"shares of {resource.name} span {len(units)} {kind} ({per_unit}); all shares of a container must be on one {kind[:-1]}",
        )
    if pool.mps and pool.mps_limits == "strict" and len(devices) > 1:
        raise AllocationError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{resource.name} uses MPS with strict limits: one share per container, got {len(devices)} "
            "(ask for 1, or use mpsLimits: proportional)",
        )
    response = pb.ContainerAllocateResponse()
    visible = ",".join(u.uuid for u in units)
    response.envs["CUDA_VISIBLE_DEVICES"] = visible
    if config.device_list_strategy == "cdi":
        response.cdi_devices.extend(pb.CDIDevice(name=f"{config.cdi_kind}={u.uuid}") for u in units)
    else:
        response.envs["NVIDIA_VISIBLE_DEVICES"] = visible
    if config.device_specs:
        response.devices.extend(device_specs(config.device_root, units))
    if pool.shared:
        _share_facts(response, resource, units, devices)
    return response


def _share_facts(response: pb.ContainerAllocateResponse, resource: Resource, units: list[Unit], devices: list[Device]) -> None:
    """GPU_SHARE_* for every shared pool; the MPS pipe, mounts and (proportional) per-client limits."""
    count = len(devices)
    per_unit = [(u, sum(1 for d in devices if d.unit is u)) for u in units]
    memory = sum(u.memory_mib * k // u.replicas for u, k in per_unit)
    compute = sum(100 * k // u.replicas for u, k in per_unit)  # percent of one GPU; over 100 only when spanning
    envs = response.envs
    envs[ENV_SHARE_COUNT] = str(count)
    envs[ENV_SHARE_TOTAL] = str(units[0].replicas)
    envs[ENV_MEMORY_LIMIT] = str(memory)
    envs[ENV_COMPUTE_PERCENT] = str(compute)
    pool = resource.pool
    if not pool.mps:
        return
    paths = MpsPaths.of(resource.config.mps_root, pool.name)
    envs["CUDA_MPS_PIPE_DIRECTORY"] = str(paths.pipe)
    response.mounts.add(container_path=str(paths.pipe), host_path=str(paths.pipe), read_only=False)
    response.mounts.add(container_path="/dev/shm", host_path=str(paths.shm), read_only=False)
    if pool.mps_limits == "proportional":
        envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(compute)
        envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={memory}M"


CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def _minor(gpu: Gpu) -> int:
    return gpu.minor_number if gpu.minor_number is not None else gpu.index


def _host_path(device_root: str, path: str) -> str:
    return str(Path(device_root) / path.lstrip("/"))


def device_specs(device_root: str, units: list[Unit]) -> list[pb.DeviceSpec]:
    """/dev/nvidiactl, the UVM nodes, each GPU's /dev/nvidiaN and, for MIG, its capability nodes."""
    paths = list(CONTROL_NODES)
    for unit in units:
        paths.append(f"/dev/nvidia{_minor(unit.gpu)}")
        if unit.mig:
            paths += mig_capability_devices(device_root, _minor(unit.gpu), unit.mig.gi_id, unit.mig.ci_id)
    return [pb.DeviceSpec(container_path=p, host_path=_host_path(device_root, p), permissions="rw") for p in dict.fromkeys(paths)]


def missing_device_nodes(device_root: str, gpu: Gpu) -> list[str]:
    """Host paths `deviceSpecs` hands a container of this GPU that do not exist (MIG capability nodes aside)."""
    paths = [_host_path(device_root, p) for p in (*CONTROL_NODES, f"/dev/nvidia{_minor(gpu)}")]
    return [p for p in paths if not Path(p).exists()]


_MIG_CAPABILITIES: dict[tuple[str, int, int, int], tuple[str, ...]] = {}  # complete reads only (bounded by MIG instances)


def mig_capability_devices(device_root: str, minor: int, gi: int, ci: int) -> tuple[str, ...]:
    """The /dev/nvidia-caps nodes that grant access to one MIG instance, from /proc/driver/nvidia/capabilities.

    Only a read that found both nodes is remembered; a failed or partial one is retried on the next Allocate.
    """
    key = (device_root, minor, gi, ci)
    if key in _MIG_CAPABILITIES:
        return _MIG_CAPABILITIES[key]
    base = Path(device_root) / "proc/driver/nvidia/capabilities" / f"gpu{minor}" / "mig" / f"gi{gi}"
    found = []
    for access in (base / "access", base / f"ci{ci}" / "access"):
        try:
            text = access.read_text()
        except OSError as err:
            log.warning("cannot read MIG capability %s (%s): retried on the next allocation", access, err.strerror or err)
            continue
        match = re.search(r"DeviceFileMinor:\s*(\d+)", text)
        if match:
            found.append(f"/dev/nvidia-caps/nvidia-cap{match.group(1)}")
    if len(found) == 2 and len(_MIG_CAPABILITIES) < 4096:
        _MIG_CAPABILITIES[key] = tuple(found)
    return tuple(found)


def _units_of(resource: Resource, devices: list[Device]) -> list[Unit]:
    used = {d.unit.uuid for d in devices}
    return [u for u in resource.units if u.uuid in used]


def _dedupe(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))



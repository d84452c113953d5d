"""What a container receives for its devices (Allocate), as plain data: the plugin's wire module encodes it.

`container_grant` is a pure function of the resource, the device IDs and the devices that are unhealthy,
so repeated calls with the same IDs give the same answer.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..logs import brief
from ..model.devices import Device, Resource, Unit
from .devicenodes import DeviceNode, MissingCapability, device_specs
from .modes import mode_of

# Environment variables a share-aware application can read.
ENV_SHARE_COUNT = "GPU_SHARE_COUNT"
ENV_SHARE_TOTAL = "GPU_SHARE_TOTAL"
ENV_MEMORY_LIMIT = "GPU_SHARE_MEMORY_LIMIT_MIB"
ENV_COMPUTE_PERCENT = "GPU_SHARE_COMPUTE_PERCENT"


class Refusal(enum.Enum):
    """Why a request is refused, whatever the transport: the plugin maps each to a gRPC status code."""

    INVALID = "invalid"  # the request itself is wrong (unknown IDs, shares spanning units, bad sizes)
    PRECONDITION = "precondition"  # the request is fine, the devices are not fit for it now (unhealthy, held back)


class AllocationError(Exception):
    """A request the plugin refuses, with why (`code`) and a message for the kubelet's event."""

    def __init__(self, code: Refusal, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerGrant:
    """Everything one container is given: environment, mounts, device nodes and CDI device names."""

    envs: Mapping[str, str]
    mounts: tuple[Mount, ...] = ()
    device_specs: tuple[DeviceNode, ...] = ()
    cdi_devices: tuple[str, ...] = ()  # fully qualified CDI names, <cdiKind>=<UUID>


def container_grant(
    resource: Resource, device_ids: Iterable[str], unhealthy: frozenset[str] = frozenset(), held: frozenset[str] = frozenset()
) -> ContainerGrant:
    """What a container gets for these devices, or AllocationError.

    `unhealthy`: GPU and MIG UUIDs with every device on them; `held`: device IDs held back (quarantined).
    """
    ids = sorted(set(device_ids))
    if not ids:
        raise AllocationError(Refusal.INVALID, f"no device IDs in the request for {resource.name}")
    unknown = [i for i in ids if i not in resource.devices]
    if unknown:
        raise AllocationError(Refusal.INVALID, f"unknown device IDs for {resource.name}: {brief(unknown, 8)}")
    devices = [resource.devices[i] for i in ids]
    sick = [d.id for d in devices if d.is_unhealthy(unhealthy, held)]
    if sick:
        raise AllocationError(Refusal.PRECONDITION, f"devices on an unhealthy GPU for {resource.name}: {brief(sick, 8)}")
    pool = resource.pool
    units = _units_of(resource, devices)
    if pool.shared and len(units) > 1 and not pool.allow_span:
        kind = "MIG instances" if units[0].mig else "GPUs"
        per_unit = "; ".join(f"{u.uuid} shares {brief([str(d.share) for d in devices if d.unit is u], 8)}" for u in units[:8])
        per_unit += f"; and {len(units) - 8} more" if len(units) > 8 else ""
        raise AllocationError(
            Refusal.INVALID,
            f"shares of {resource.name} span {len(units)} {kind} ({per_unit}); all shares of a container must be on one {kind[:-1]}",
        )
    if pool.mps and pool.mps_limits == "strict" and len(devices) > 1:
        raise AllocationError(
            Refusal.INVALID,
            f"{resource.name} uses MPS with strict limits: one share per container, got {len(devices)} "
            "(ask for 1, or use mpsLimits: proportional)",
        )
    return unit_grant(resource, [(u, sum(1 for d in devices if d.unit is u)) for u in units])


def unit_grant(resource: Resource, holdings: Sequence[tuple[Unit, int]], mps_client_limits: bool | None = None) -> ContainerGrant:
    """What a container gets for `k` devices (shares, or 1 for a whole unit) of each unit: the one place both node
    APIs (the device plugin's Allocate, the DRA driver's NodePrepareResources) build a grant.

    `mps_client_limits`: give an MPS client its own limits from its shares (the pool's `mpsLimits: proportional`
    when None; the DRA driver always does, from the claim's consumed capacity)."""
    units = [u for u, _ in holdings]
    settings = resource.settings
    visible = ",".join(u.uuid for u in units)
    envs: dict[str, str] = {}
    cdi: tuple[str, ...] = ()
    if settings.device_list_strategy == "cdi":
        # The CDI devices alone say what the container sees. The kubelet merges the CDI devices of every resource a
        # container holds, but keeps one value of an env: a CUDA_VISIBLE_DEVICES here would hide the GPUs of the
        # container's other resource (a container holding both gpu and gpu-share).
        cdi = tuple(f"{settings.cdi_kind}={u.uuid}" for u in units)
    else:
        envs["CUDA_VISIBLE_DEVICES"] = envs["NVIDIA_VISIBLE_DEVICES"] = visible
    try:
        specs = tuple(device_specs(settings.device_root, units)) if settings.device_specs else ()
    except MissingCapability as err:
        raise AllocationError(Refusal.PRECONDITION, f"{resource.name}: {err}") from None
    share_envs, mounts = mode_of(resource.pool).grant_facts(resource, holdings, mps_client_limits)
    envs.update(share_envs)
    return ContainerGrant(envs=envs, mounts=mounts, device_specs=specs, cdi_devices=cdi)


def _units_of(resource: Resource, devices: list[Device]) -> list[Unit]:
    used = {d.unit.uuid for d in devices}
    return [u for u in resource.units if u.uuid in used]

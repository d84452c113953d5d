"""What a container receives for its devices, as plain data (the plugin's wire module encodes it), and why a
request is refused (`AllocationError`, `Refusal`). The checks of a request live in alloc/allocator.py."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..model.devices import Resource, Unit
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
    PRECONDITION = "precondition"  # the request is fine, the devices are not fit for it now (unhealthy, quarantined, pending)


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

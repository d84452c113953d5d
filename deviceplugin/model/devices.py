"""The devices a node advertises: units (a whole GPU or one MIG instance), their shares, and the resources that hold
them.

Plain data, no transport: the plugin's wire module encodes these for the kubelet, the cluster layer reads them as they
are.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from ..config.types import AllocationSettings, PoolConfig
from .node import Gpu, Link, MigDevice, link_between

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
SHARE_SEPARATOR = "::"


def share_device_id(unit_uuid: str, k: int) -> str:
    """The device plugin device ID of share k of a unit: `<uuid>::<k>` (not a DRA shareID)."""
    return f"{unit_uuid}{SHARE_SEPARATOR}{k}"


@dataclass(frozen=True)
class Unit:
    """What a container is given: a whole GPU or one MIG instance of it."""

    uuid: str
    gpu: Gpu
    memory_mib: int
    mig: MigDevice | None = None
    replicas: int = 1  # shares of this unit (1 for a whole device)

    def is_unhealthy(self, unhealthy_uuids: Collection[str]) -> bool:
        """Unhealthy when the unit itself (a MIG instance) or its GPU is among `unhealthy_uuids`."""
        return self.uuid in unhealthy_uuids or self.gpu.uuid in unhealthy_uuids


@dataclass(frozen=True)
class Device:
    """One advertised device: a whole unit or one share of it."""

    id: str
    unit: Unit
    share: int | None = None  # k of `<uuid>::<k>`; None for a whole unit

    @property
    def gpu(self) -> Gpu:
        return self.unit.gpu

    def is_unhealthy(self, unhealthy_uuids: Collection[str], quarantined_devices: Collection[str] = ()) -> bool:
        """Unhealthy when its unit (MIG instance) or its GPU is among `unhealthy_uuids`, or its own ID among
        `quarantined_devices`."""
        return self.unit.is_unhealthy(unhealthy_uuids) or self.id in quarantined_devices


@dataclass(frozen=True)
class Resource:
    """One extended resource served by one DevicePlugin server."""

    pool: PoolConfig
    name: str
    label: str  # unique per resource, [a-z0-9.-]: used in socket and thread names
    units: tuple[Unit, ...]
    devices: dict[str, Device]  # in advertising order
    settings: AllocationSettings  # the node-wide settings that decide its placement and Allocate answers
    links: dict[tuple[str, str], Link] = field(default_factory=dict)

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return tuple({u.gpu.uuid: u.gpu for u in self.units}.values())

    @property
    def allocation_policy(self) -> str:
        return self.settings.allocation_policy

    @property
    def with_topology(self) -> bool:
        """Devices carry NUMA topology only when every GPU reports it (the kubelet's hints need all or none)."""
        return bool(self.units) and all(u.gpu.numa_node is not None for u in self.units)

    def link(self, a: Gpu, b: Gpu) -> Link:
        return link_between(self.links, a, b)

    def health_keys(self) -> frozenset[str]:
        """The UUIDs whose health concerns this resource: its GPUs and its MIG instances."""
        return frozenset(u.uuid for u in self.units) | frozenset(u.gpu.uuid for u in self.units)

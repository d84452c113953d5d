"""The node's devices as DRA publishes them, and what a claim's allocation result gives a container.

Pure data, no transport: the slice publisher renders `DraDevice.to_api()` into ResourceSlices, the kubelet plugin
turns an allocation result into a `ClaimShare` and its `ContainerGrant` (docs/dra.md).

One DRA device per unit of the config's pools: a whole GPU (exclusive pool), a MIG instance (mig pool), or a
GPU/MIG instance of a shared pool, published once with `allowMultipleAllocations: true` and two consumable
capacities that stay proportional:

- `shares`: the unit's N shares; a claim consumes whole shares (default 1, step 1);
- `memory`: N x the memory of one share; a claim consumes whole shares' worth (default one share, step one share).

A dynamic-MIG device (one MIG profile at one placement, `dra.partitions`) of a pool with `replicas` N > 1 is published
the same way, with its counters beside: N shares of the instance made for its first claim, taking turns in it.

kube-scheduler checks each capacity on its own, and a capacity a claim does not name is consumed at its default.
So the driver grants `max(shares, memory / one share)` shares and keeps its own ledger of what prepared claims
hold on each device: a claim that names only one of the two can never make the node hand out more than N shares
(the ledger refuses it at prepare, with a message), and a claim that names neither gets one share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..alloc.allocator import ContainerGrant, unit_grant
from ..alloc.modes import TIME_SLICED, ClientLimits, SharingMode, mode_of
from ..config.types import Backend
from ..kube.dranames import CAPACITY_MEMORY, CAPACITY_SHARES
from ..model.devices import Resource, Unit
from ..model.node import MIB, NodeInfo, gpu_family
from ..model.quantity import MAX_QUANTITY_LENGTH, parse_quantity
from ..model.shares import share_memory_mib
from .partitions import Partition, partitions
from .partitions import device_name as partition_name

# One bool attribute per sharing strategy (list attributes need the alpha DRAListTypeAttributes gate), so a class or
# claim selects the devices whose pool offers the strategy its SharingConfig asks: refused at scheduling, not prepare.
STRATEGY_ATTRIBUTES = {"timeSlicing": "sharingTimeSlicing", "mps": "sharingMPS"}

# A slice holds at most 128 devices, 64 when any device has taints (the API's limits); the publisher splits by 64.
MAX_DEVICES_PER_SLICE = 64


class ClaimError(ValueError):
    """An allocation result this driver cannot prepare, with a message for the pod's event."""


@dataclass(frozen=True)
class DraDevice:
    """One published device: a unit of one of the config's resources."""

    name: str  # DNS label, unique in the node's pool
    unit: Unit  # for a dynamic-MIG device: its GPU whole (the instance is made at prepare)
    resource: Resource
    partition: Partition | None = None  # a dynamic-MIG device: the profile and placement it stands for

    @property
    def shared(self) -> bool:
        """Many claims may hold it at once, each a number of its shares: a unit of a shared pool, or a dynamic-MIG
        device of a pool with `replicas` over 1 (the claims share the one instance made for the first)."""
        return self.resource.pool.shared or (self.partition is not None and self.shares > 1)

    @property
    def sharing_mode(self) -> SharingMode:
        """What its claims run under unless a SharingConfig chose otherwise: the pool's mode; the shares of a dynamic
        MIG instance take turns in it (gpu-share runs no MPS daemon on MIG)."""
        return TIME_SLICED if self.partition is not None and self.shared else mode_of(self.resource.pool)

    @property
    def shares(self) -> int:
        return self.unit.replicas

    @property
    def strategies(self) -> tuple[Backend, ...]:
        """The sharing strategies a claim's SharingConfig may choose on it: a shared pool's `sharingStrategies`; a
        whole GPU or a MIG instance (dynamic or not) runs its one claim time-sliced."""
        pool = self.resource.pool
        return tuple(pool.strategies) if pool.shared else ("timeSlicing",)

    @property
    def share_memory_bytes(self) -> int:
        return share_memory_mib(self.unit, 1) * MIB

    def to_api(self, driver: str, node: NodeInfo) -> dict[str, Any]:
        """The device as resource.k8s.io/v1 `Device` (a plain dict, camelCase keys)."""
        gpu, unit = self.unit.gpu, self.unit
        attributes: dict[str, dict[str, Any]] = {
            "type": {"string": "mig" if unit.mig or self.partition else "gpu"},
            "uuid": {"string": unit.uuid},
            "index": {"int": gpu.index},
            "productName": {"string": gpu.model[:64]},
            "pool": {"string": self.resource.pool.name[:64]},
            "mode": {"string": self._mode()},
        }
        for strategy, attribute in STRATEGY_ATTRIBUTES.items():  # what a claim's SharingConfig may choose here
            attributes[attribute] = {"bool": strategy in self.strategies}
        if unit.mig:
            attributes["parentUUID"] = {"string": gpu.uuid}
            attributes["migProfile"] = {"string": unit.mig.profile}
        if self.partition:  # its MIG UUID exists only once prepare made the instance
            del attributes["uuid"]
            attributes["parentUUID"] = {"string": gpu.uuid}
            attributes["migProfile"] = {"string": self.partition.profile.name}
            attributes["migPlacementStart"] = {"int": self.partition.start}
        capability = _version(gpu.compute_capability)
        if capability:
            attributes["cudaComputeCapability"] = {"version": capability}
            major, minor = (int(p) for p in capability.split(".")[:2])
            attributes["architecture"] = {"string": gpu_family(major, minor)}
        for key, raw in (("driverVersion", node.driver_version), ("cudaDriverVersion", node.cuda_driver_version)):
            version = _version(raw)
            if version:
                attributes[key] = {"version": version}
        if node.driver_version.strip():  # as NVML reports it: the version form drops leading zeros (570.124.06 -> .6)
            attributes["driverVersionText"] = {"string": node.driver_version.strip()[:64]}
        if gpu.numa_node is not None:
            attributes["numaNode"] = {"int": gpu.numa_node}
        if gpu.pci_bus_id:
            attributes["pciBusID"] = {"string": gpu.pci_bus_id[:64]}
        device: dict[str, Any] = {"name": self.name, "attributes": attributes}
        if self.partition:  # the unit is its profile's memory (`dra_devices`)
            counters = {k: {"value": str(v)} for k, v in self.partition.consumes().items()}
            device["consumesCounters"] = [{"counterSet": self.partition.counter_set, "counters": counters}]
        if self.shared:
            n, one = self.shares, self.share_memory_bytes
            device["allowMultipleAllocations"] = True
            device["capacity"] = {
                CAPACITY_SHARES: {
                    "value": str(n),
                    "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": str(n), "step": "1"}},
                },
                CAPACITY_MEMORY: {
                    "value": str(n * one),
                    "requestPolicy": {
                        "default": str(one),
                        "validRange": {"min": str(one), "max": str(n * one), "step": str(one)},
                    },
                },
            }
        else:
            device["capacity"] = {CAPACITY_MEMORY: {"value": str(unit.memory_mib * MIB)}}
        return device

    def _mode(self) -> str:
        """The sharing mode's name (`time-slicing` for shares of a dynamic MIG instance, as for shares of a static one);
        a GPU with MIG mode off in a dynamic MIG pool is published as an exclusive GPU."""
        pool = self.resource.pool
        return "exclusive" if pool.dynamic_mig and not self.partition else self.sharing_mode.name


def _version(raw: str) -> str:
    """A semantic version from "8.0", "12.4" or "535.104.05" (three numeric parts, no leading zeros); "" if not one."""
    parts = raw.strip().split(".")
    if not raw or len(parts) > 3 or not all(p.isdigit() for p in parts):
        return ""
    return ".".join(str(int(p)) for p in (parts + ["0", "0"])[:3])


def device_name(unit: Unit) -> str:
    """A stable DNS label: `gpu-<index>`, or `gpu-<index>-mig-<gi>-<ci>` for a MIG instance."""
    if unit.mig:
        return f"gpu-{unit.gpu.index}-mig-{unit.mig.gi_id}-{unit.mig.ci_id}"
    return f"gpu-{unit.gpu.index}"


def dra_devices(resources: Iterable[Resource]) -> list[DraDevice]:
    """Every unit of every resource, in GPU-index order (the scheduler's first fit follows slice and device order); a
    MIG-enabled GPU of a dynamic MIG pool as its profiles' placements (`dra.partitions`), in their order."""
    devices = []
    for resource in resources:
        for unit in resource.units:
            if resource.pool.dynamic_mig and unit.gpu.mig_enabled:  # the GPU's unit, as big as the profile
                devices += [
                    DraDevice(
                        name=partition_name(p),
                        unit=replace(unit, memory_mib=p.profile.memory_mib),
                        resource=resource,
                        partition=p,
                    )
                    for p in partitions(unit.gpu)
                ]
            else:
                devices.append(DraDevice(name=device_name(unit), unit=unit, resource=resource))
    devices.sort(
        key=lambda d: (d.unit.gpu.index, d.unit.mig.index if d.unit.mig else -1)
    )  # stable: partitions keep their order
    names = [d.name for d in devices]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:  # one unit in two resources: the plan never builds that, so this is a programming error
        raise ValueError(f"device names used twice: {', '.join(duplicates)}")
    return devices


@dataclass(frozen=True)
class ClaimShare:
    """What one allocation result holds: a device, and for a shared device how many of its shares."""

    device: DraDevice
    shares: int  # 1 for an exclusive device
    share_id: str | None = None  # the result's shareID, for a shared device

    def grant(self, mode: SharingMode | None = None, limits: ClientLimits | None = None) -> ContainerGrant:
        """The container's grant: the device plugin's grant for the same holding, with MPS limits always from the
        claim (what the claim paid for is what it gets), or lower (`limits`), under `mode` when a claim's
        SharingConfig chose another strategy than the pool's (`dra.sharingconfig` checks both)."""
        holding = [(self.device.unit, self.shares)]
        mode = mode or self.device.sharing_mode
        return unit_grant(self.device.resource, holding, mps_client_limits=True, mode=mode, limits=limits)

    @property
    def memory_mib(self) -> int:
        return share_memory_mib(self.device.unit, self.shares)


def request_grant(
    shares: Sequence[ClaimShare], mode: SharingMode | None = None, limits: ClientLimits | None = None
) -> ContainerGrant:
    """One grant for all the devices of one request, so its container sees them all: a container runtime keeps one
    value of each variable across the CDI devices it injects, so a grant per device would hide all GPUs but one.
    `mode`, `limits`: the request's SharingConfig, as `ClaimShare.grant` takes them."""
    resources = {s.device.resource.name for s in shares}
    if len(resources) > 1 and any(s.device.shared for s in shares):
        raise ClaimError(
            f"one request holds shared devices of {len(resources)} pools ({', '.join(sorted(resources))}); "
            "ask for each in a request of its own"
        )
    if len(shares) == 1:
        return shares[0].grant(mode, limits)
    holdings = [(s.device.unit, s.shares) for s in shares]
    mode = mode or shares[0].device.sharing_mode
    return unit_grant(shares[0].device.resource, holdings, mps_client_limits=True, mode=mode, limits=limits)


def claim_share(device: DraDevice, consumed: Mapping[str, Any] | None, share_id: str | None) -> ClaimShare:
    """The shares an allocation result holds on `device`, from its `consumedCapacity`; ClaimError if they cannot be."""
    if not device.shared:
        return ClaimShare(device=device, shares=1)
    if not share_id:
        raise ClaimError(f"device {device.name} is shared but the allocation result has no shareID")
    consumed = consumed or {}
    shares = _count(consumed.get(CAPACITY_SHARES), 1, CAPACITY_SHARES, device)
    memory = _count(consumed.get(CAPACITY_MEMORY), device.share_memory_bytes, CAPACITY_MEMORY, device)
    wanted = max(shares, -(-memory // device.share_memory_bytes))
    if wanted > device.shares:
        raise ClaimError(f"the claim holds {wanted} shares of {device.name}, which has {device.shares}")
    return ClaimShare(device=device, shares=max(wanted, 1), share_id=share_id)


def _count(raw: Any, default: int, name: str, device: DraDevice) -> int:
    if raw is None:
        return default
    try:
        value = parse_quantity(str(raw))
    except ValueError as err:
        raise ClaimError(f"consumed {name} of {device.name}: {err}") from None
    if value < 0:
        raise ClaimError(f"consumed {name} of {device.name} is negative: {str(raw)[:MAX_QUANTITY_LENGTH]}")
    return int(value.to_integral_value(rounding="ROUND_CEILING"))


def by_name(devices: Sequence[DraDevice]) -> dict[str, DraDevice]:
    return {d.name: d for d in devices}

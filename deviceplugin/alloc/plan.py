"""Pools made concrete on one node: which GPUs each resource holds and which device IDs it advertises."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import cached_property

from ..api import deviceplugin_pb2 as pb
from ..config.types import MPS_LIMIT_REASON, Config, ConfigError, PoolConfig, max_replicas
from ..model.node import Gpu, Link, MigDevice, NodeInfo
from ..limits import LIST_BUDGET_BYTES

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
SHARE_SEPARATOR = "::"


@dataclass(frozen=True)
class Unit:
    """What a container is given: a whole GPU or one MIG instance of it."""

    uuid: str
    gpu: Gpu
    memory_mib: int
    mig: MigDevice | None = None
    replicas: int = 1  # shares of this unit (1 for a whole device)


@dataclass(frozen=True)
class Device:
    """One advertised device: a whole unit or one share of it."""

    id: str
    unit: Unit
    share: int | None = None  # k of `<uuid>::<k>`; None for a whole unit

    @property
    def gpu(self) -> Gpu:
        return self.unit.gpu


@dataclass(frozen=True)
class Resource:
    """One extended resource served by one DevicePlugin server."""

    pool: PoolConfig
    name: str
    label: str  # unique per resource, [a-z0-9.-]: used in socket and thread names
    units: tuple[Unit, ...]
    devices: dict[str, Device]  # in advertising order
    config: Config = field(default_factory=Config)
    links: dict[tuple[str, str], Link] = field(default_factory=dict)

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return tuple({u.gpu.uuid: u.gpu for u in self.units}.values())

    @property
    def allocation_policy(self) -> str:
        return self.config.allocation_policy

    @property
    def with_topology(self) -> bool:
        """Devices carry NUMA topology only when every GPU reports it (the kubelet's hints need all or none)."""
        return bool(self.units) and all(u.gpu.numa_node is not None for u in self.units)

    def link(self, a: Gpu, b: Gpu) -> Link:
        first, second = sorted((a, b), key=lambda g: g.index)
        return self.links.get((first.uuid, second.uuid), Link())

    def health_keys(self) -> frozenset[str]:
        """The UUIDs whose health concerns this resource: its GPUs and its MIG instances."""
        return frozenset(u.uuid for u in self.units) | frozenset(u.gpu.uuid for u in self.units)

    def list_response(
        self, unhealthy: frozenset[str] = frozenset(), all_unhealthy: bool = False, unhealthy_ids: frozenset[str] = frozenset()
    ) -> pb.ListAndWatchResponse:
        """The full device list as ListAndWatch sends it; a device is unhealthy when its unit or GPU is, or its ID is listed.

        Built from each device's encoded entry (a repeated field encodes as the concatenation of its
        elements), cached per health: a 10k-device list takes milliseconds instead of building 10k messages.
        """
        healthy = self._encoded_healthy
        if not (unhealthy or all_unhealthy or unhealthy_ids):
            return pb.ListAndWatchResponse.FromString(b"".join(healthy))
        sick = self._encoded_unhealthy
        parts = [
            sick[i] if all_unhealthy or d.unit.uuid in unhealthy or d.gpu.uuid in unhealthy or d.id in unhealthy_ids else healthy[i]
            for i, d in enumerate(self.devices.values())
        ]
        return pb.ListAndWatchResponse.FromString(b"".join(parts))

    @cached_property
    def _encoded_healthy(self) -> list[bytes]:
        return self._encode(HEALTHY)

    @cached_property
    def _encoded_unhealthy(self) -> list[bytes]:  # built on the first health problem only
        return self._encode(UNHEALTHY)

    def _encode(self, health: str) -> list[bytes]:
        """Per device, its encoded ListAndWatchResponse entry with this health."""
        topology = self.with_topology
        encoded = []
        for device in self.devices.values():
            item = pb.Device(ID=device.id, health=health)
            if topology:
                item.topology.nodes.add(ID=device.gpu.numa_node)
            encoded.append(pb.ListAndWatchResponse(devices=[item]).SerializeToString())
        return encoded


def share_id(unit_uuid: str, k: int) -> str:
    return f"{unit_uuid}{SHARE_SEPARATOR}{k}"


def build_resources(config: Config, node: NodeInfo, profile: str | None = None, budget_bytes: int = LIST_BUDGET_BYTES) -> list[Resource]:
    """Assign every GPU to its pool and list each pool's devices; errors name the config key."""
    pools = config.pools(profile)
    problems: list[str] = []
    owner: dict[str, PoolConfig] = {}  # GPU uuid -> the pool that selected it
    selected: dict[str, list[Gpu]] = {p.path: [] for p in pools}
    for pool in pools:
        if pool.gpus.selects_rest:
            continue
        for index in pool.gpus.indexes:
            if not any(g.index == index for g in node.gpus):
                problems.append(f"{pool.path}.gpus.indexes: no GPU with index {index} on this node ({_indexes(node)})")
        for uuid in pool.gpus.uuids:
            if not any(g.uuid == uuid for g in node.gpus):
                problems.append(f"{pool.path}.gpus.uuids: no GPU {uuid} on this node")
        for gpu in node.gpus:
            if not pool.gpus.matches(gpu):
                continue
            if gpu.uuid in owner:
                other = owner[gpu.uuid]
                problems.append(f"{pool.path}.gpus: GPU {gpu.index} ({gpu.uuid}) is already selected by {other.path} ({other.name})")
                continue
            owner[gpu.uuid] = pool
            selected[pool.path].append(gpu)
    for pool in pools:
        if pool.gpus.selects_rest:
            selected[pool.path] = [g for g in node.gpus if g.uuid not in owner]
            owner.update({g.uuid: pool for g in selected[pool.path]})
    if problems:
        raise ConfigError(problems, config.source)

    resources: list[Resource] = []
    for pool in pools:
        try:
            pool_resources = _pool_resources(pool, selected[pool.path])
        except ValueError as err:
            raise ConfigError([str(err)], config.source) from None
        for name, label, units in pool_resources:
            if not units:
                log.warning("pool %s has no usable GPU on this node; %s is not advertised", pool.name, name)
                continue
            problem = _over_budget(pool, units, budget_bytes)
            if problem:
                raise ConfigError([problem], config.source)
            resource = Resource(pool=pool, name=name, label=label, units=tuple(units), devices=_devices(pool, units), config=config, links=node.links)
            if any(r.name == name for r in resources):
                raise ConfigError([f"{pool.path}: resource {name} is also advertised by another pool"], config.source)
            resources.append(resource)
    for gpu in node.gpus:
        if gpu.uuid not in owner:
            log.info("GPU %d (%s) is in no pool and is not advertised", gpu.index, gpu.uuid)
    return resources


def _whole(gpu: Gpu) -> Unit:
    return Unit(uuid=gpu.uuid, gpu=gpu, memory_mib=gpu.memory_mib)


def _mig_units(gpu: Gpu) -> list[Unit]:
    return [Unit(uuid=m.uuid, gpu=gpu, memory_mib=m.memory_mib, mig=m) for m in gpu.mig_devices]


def _with_replicas(pool: PoolConfig, unit: Unit) -> Unit:
    """A shared unit with its share count: `replicas`, or as many `memoryPerShare` as fit (at most max_replicas)."""
    if pool.memory_per_share_mib is None:
        return replace(unit, replicas=pool.replicas)
    replicas = unit.memory_mib // pool.memory_per_share_mib
    what = f"MIG instance {unit.uuid} ({unit.mig.profile}" if unit.mig else f"GPU {unit.gpu.index} ({unit.gpu.model}"
    if replicas < 1:
        raise ValueError(f"{pool.path}.memoryPerShare: {pool.memory_per_share_mib} MiB is larger than {what}, {unit.memory_mib} MiB)")
    most = max_replicas(pool.backend)
    if replicas > most:
        why = f" ({MPS_LIMIT_REASON})" if pool.mps else ""
        raise ValueError(
            f"{pool.path}.memoryPerShare: {pool.memory_per_share_mib} MiB makes {replicas} shares of {what}, {unit.memory_mib} MiB), "
            f"over the limit of {most} shares per GPU or MIG instance{why}; use a larger memoryPerShare"
        )
    return replace(unit, replicas=replicas)


def _over_budget(pool: PoolConfig, units: list[Unit], budget_bytes: int) -> str | None:
    """Why these units' devices would not fit one ListAndWatch message, or None; computed, never built.

    A list's size is the sum of its entries' sizes, and an entry's size depends only on its ID's length: so each
    unit costs one encoded entry per ID length (share numbers of 1, 2, 3, 4 digits), with the longer Unhealthy health.
    """
    topology = all(u.gpu.numa_node is not None for u in units)
    count = size = 0
    for unit in units:
        for device_id, n in _id_lengths(pool, unit):
            count += n
            size += n * _entry_bytes(device_id, unit.gpu.numa_node if topology else None)
    if size <= budget_bytes:
        return None
    if pool.shared:
        per_unit = f"{max(u.replicas for u in units)} shares each"
        remedy = "raise memoryPerShare" if pool.memory_per_share_mib else "lower replicas"
    else:
        per_unit, remedy = "whole devices", "select fewer GPUs"
    return (
        f"{pool.path}: {count} devices ({len(units)} {'MIG instances' if units[0].mig else 'GPUs'}, {per_unit}) would make a ListAndWatch "
        f"message of up to {size} bytes, over the {budget_bytes} byte budget (the kubelet drops the stream at 4 MiB): at most about "
        f"{count * budget_bytes // size} devices fit; {remedy}"
    )


def _id_lengths(pool: PoolConfig, unit: Unit) -> list[tuple[str, int]]:
    """(the longest device ID of one length, how many IDs have that length) for one unit."""
    if not pool.shared:
        return [(unit.uuid, 1)]
    shapes = []
    low = 0
    while low < unit.replicas:
        high = min(unit.replicas, max(10, low * 10))  # share numbers low..high-1 have the same number of digits
        shapes.append((share_id(unit.uuid, high - 1), high - low))
        low = high
    return shapes


def _entry_bytes(device_id: str, numa_node: int | None) -> int:
    item = pb.Device(ID=device_id, health=UNHEALTHY)
    if numa_node is not None:
        item.topology.nodes.add(ID=numa_node)
    return pb.ListAndWatchResponse(devices=[item]).ByteSize()


def _pool_resources(pool: PoolConfig, gpus: list[Gpu]) -> list[tuple[str, str, list[Unit]]]:
    """(resource name, label, units) for each resource a pool yields; ValueError for a node the pool cannot serve."""
    if pool.mode == "exclusive":
        for gpu in gpus:
            if gpu.mig_enabled:
                log.warning("GPU %d (%s) has MIG enabled: pool %s (exclusive) does not advertise it whole; use mode mig", gpu.index, gpu.uuid, pool.name)
        return [(pool.resource, pool.name, [_whole(g) for g in gpus if not g.mig_enabled])]
    if pool.mode == "shared":
        if pool.mps and any(g.mig_enabled for g in gpus):
            mig = ", ".join(str(g.index) for g in gpus if g.mig_enabled)
            raise ValueError(f"{pool.path}.backend: mps is not supported on MIG-enabled GPUs (GPU {mig}); use timeSlicing or a mig pool")
        # A MIG-enabled GPU is shared instance by instance.
        units = [u for g in gpus for u in (_mig_units(g) if g.mig_enabled else [_whole(g)])]
        return [(pool.resource, pool.name, [_with_replicas(pool, u) for u in units])]
    by_profile: dict[str, list[Unit]] = {}
    for gpu in gpus:
        if not gpu.mig_enabled:
            log.warning("GPU %d (%s) does not have MIG enabled: pool %s (mig) does not advertise it", gpu.index, gpu.uuid, pool.name)
        for device, unit in zip(gpu.mig_devices, _mig_units(gpu)):
            by_profile.setdefault(device.profile, []).append(unit)
    if pool.mig_strategy == "single":
        if len(by_profile) > 1:
            found = "; ".join(f"{p} on GPU {', '.join(str(i) for i in sorted({u.gpu.index for u in units}))}" for p, units in sorted(by_profile.items()))
            raise ValueError(f"{pool.path}.strategy: single needs one MIG profile on every GPU of the pool, found {found}; use strategy mixed")
        return [(pool.resource, pool.name, [u for units in by_profile.values() for u in units])]
    return [
        (mig_resource_name(pool.domain, profile), f"{pool.name}-{profile.replace('+', '.')}", units)
        for profile, units in sorted(by_profile.items())
    ]


def mig_resource_name(domain: str, profile: str) -> str:
    """The mixed strategy's name: <domain>/mig-<profile>, with '+' (e.g. 1g.10gb+me) made '.'."""
    return f"{domain}/mig-{profile.replace('+', '.')}"


def _devices(pool: PoolConfig, units: list[Unit]) -> dict[str, Device]:
    if not pool.shared:
        return {u.uuid: Device(id=u.uuid, unit=u) for u in units}
    return {share_id(u.uuid, k): Device(id=share_id(u.uuid, k), unit=u, share=k) for u in units for k in range(u.replicas)}


def _indexes(node: NodeInfo) -> str:
    return "indexes " + ", ".join(str(g.index) for g in node.gpus) if node.gpus else "no GPUs"

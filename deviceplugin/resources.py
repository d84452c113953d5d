"""Pools made concrete on one node: which GPUs each resource holds and which device IDs it advertises."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .api import deviceplugin_pb2 as pb
from .config import Config, ConfigError, PoolConfig
from .inventory import Gpu, MigDevice, NodeInfo

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
SHARE_SEPARATOR = "::"
# The kubelet receives at most 4 MiB per ListAndWatch message; stay well below it.
LIST_BUDGET_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class Unit:
    """What a container is given: a whole GPU or one MIG instance of it."""

    uuid: str
    gpu: Gpu
    memory_mib: int
    mig: MigDevice | None = None


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
    allocation_policy: str = "binpack"

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return tuple({u.gpu.uuid: u.gpu for u in self.units}.values())

    @property
    def replicas(self) -> int:
        return self.pool.replicas

    @property
    def with_topology(self) -> bool:
        """Devices carry NUMA topology only when every GPU reports it (the kubelet's hints need all or none)."""
        return bool(self.units) and all(u.gpu.numa_node is not None for u in self.units)

    def health_keys(self) -> frozenset[str]:
        """The UUIDs whose health concerns this resource: its GPUs and its MIG instances."""
        return frozenset(u.uuid for u in self.units) | frozenset(u.gpu.uuid for u in self.units)

    def list_response(self, unhealthy: frozenset[str] = frozenset()) -> pb.ListAndWatchResponse:
        """The full device list as ListAndWatch sends it; a device is unhealthy when its unit or GPU is."""
        topology = self.with_topology
        devices = []
        for device in self.devices.values():
            sick = device.unit.uuid in unhealthy or device.gpu.uuid in unhealthy
            item = pb.Device(ID=device.id, health=UNHEALTHY if sick else HEALTHY)
            if topology:
                item.topology.nodes.add(ID=device.gpu.numa_node)
            devices.append(item)
        return pb.ListAndWatchResponse(devices=devices)


def share_id(gpu_uuid: str, k: int) -> str:
    return f"{gpu_uuid}{SHARE_SEPARATOR}{k}"


def build_resources(config: Config, node: NodeInfo) -> list[Resource]:
    """Assign every GPU to its pool and list each pool's devices; errors name the config key."""
    problems: list[str] = []
    owner: dict[str, int] = {}  # GPU uuid -> index of the pool that selected it
    selected: list[list[Gpu]] = [[] for _ in config.pools]
    for i, pool in enumerate(config.pools):
        if pool.gpus.selects_rest:
            continue
        for index in pool.gpus.indexes:
            if not any(g.index == index for g in node.gpus):
                problems.append(f"pools[{i}].gpus.indexes: no GPU with index {index} on this node ({_indexes(node)})")
        for uuid in pool.gpus.uuids:
            if not any(g.uuid == uuid for g in node.gpus):
                problems.append(f"pools[{i}].gpus.uuids: no GPU {uuid} on this node")
        for gpu in node.gpus:
            if not pool.gpus.matches(gpu):
                continue
            if gpu.uuid in owner:
                other = owner[gpu.uuid]
                problems.append(
                    f"pools[{i}].gpus: GPU {gpu.index} ({gpu.uuid}) is already selected by pools[{other}] ({config.pools[other].name})"
                )
                continue
            owner[gpu.uuid] = i
            selected[i].append(gpu)
    for i, pool in enumerate(config.pools):
        if pool.gpus.selects_rest:
            selected[i] = [g for g in node.gpus if g.uuid not in owner]
            owner.update({g.uuid: i for g in selected[i]})
    if problems:
        raise ConfigError(problems, config.source)

    resources = []
    for i, (pool, gpus) in enumerate(zip(config.pools, selected)):
        for name, label, units in _pool_units(pool, gpus):
            if not units:
                log.warning("pool %s has no usable GPU on this node; %s is not advertised", pool.name, name)
                continue
            resource = Resource(
                pool=pool, name=name, label=label, units=tuple(units), devices=_devices(pool, units), allocation_policy=config.allocation_policy
            )
            size = resource.list_response().ByteSize()
            if size > LIST_BUDGET_BYTES:
                raise ConfigError(
                    [
                        f"pools[{i}]: {len(resource.devices)} devices make a {size} byte ListAndWatch message, over the "
                        f"{LIST_BUDGET_BYTES} byte budget (the kubelet drops the stream at 4 MiB); lower replicas"
                    ],
                    config.source,
                )
            if any(r.name == name for r in resources):
                raise ConfigError([f"pools[{i}]: resource {name} is also advertised by another pool"], config.source)
            resources.append(resource)
    for gpu in node.gpus:
        if gpu.uuid not in owner:
            log.info("GPU %d (%s) is in no pool and is not advertised", gpu.index, gpu.uuid)
    return resources


def _whole(gpu: Gpu) -> Unit:
    return Unit(uuid=gpu.uuid, gpu=gpu, memory_mib=gpu.memory_mib)


def _mig_units(gpu: Gpu) -> list[Unit]:
    return [Unit(uuid=m.uuid, gpu=gpu, memory_mib=m.memory_mib, mig=m) for m in gpu.mig_devices]


def _pool_units(pool: PoolConfig, gpus: list[Gpu]) -> list[tuple[str, str, list[Unit]]]:
    """(resource name, label, units) for each resource a pool yields."""
    if pool.mode == "exclusive":
        for gpu in gpus:
            if gpu.mig_enabled:
                log.warning("GPU %d (%s) has MIG enabled: pool %s (exclusive) does not advertise it whole; use mode mig", gpu.index, gpu.uuid, pool.name)
        return [(pool.resource, pool.name, [_whole(g) for g in gpus if not g.mig_enabled])]
    if pool.mode == "shared":
        # A MIG-enabled GPU is shared instance by instance.
        return [(pool.resource, pool.name, [u for g in gpus for u in (_mig_units(g) if g.mig_enabled else [_whole(g)])])]
    by_profile: dict[str, list[Unit]] = {}
    for gpu in gpus:
        if not gpu.mig_enabled:
            log.warning("GPU %d (%s) does not have MIG enabled: pool %s (mig) does not advertise it", gpu.index, gpu.uuid, pool.name)
        for unit in _mig_units(gpu):
            by_profile.setdefault(unit.mig.profile, []).append(unit)
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
    return {share_id(u.uuid, k): Device(id=share_id(u.uuid, k), unit=u, share=k) for u in units for k in range(pool.replicas)}


def _indexes(node: NodeInfo) -> str:
    return "indexes " + ", ".join(str(g.index) for g in node.gpus) if node.gpus else "no GPUs"

"""Pools made concrete on one node: which GPUs each resource holds and which device IDs it advertises."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .api import deviceplugin_pb2 as pb
from .config import Config, ConfigError, PoolConfig
from .inventory import Gpu, NodeInfo

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
SHARE_SEPARATOR = "::"
# The kubelet receives at most 4 MiB per ListAndWatch message; stay well below it.
LIST_BUDGET_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class Device:
    """One advertised device: a whole GPU or one share of it."""

    id: str
    gpu: Gpu
    share: int | None = None  # k of `<uuid>::<k>`; None for a whole GPU


@dataclass(frozen=True)
class Resource:
    """One extended resource served by one DevicePlugin server."""

    pool: PoolConfig
    gpus: tuple[Gpu, ...]
    devices: dict[str, Device]  # in advertising order
    allocation_policy: str = "binpack"

    @property
    def name(self) -> str:
        return self.pool.resource

    @property
    def replicas(self) -> int:
        return self.pool.replicas

    @property
    def with_topology(self) -> bool:
        """Devices carry NUMA topology only when every GPU reports it (the kubelet's hints need all or none)."""
        return bool(self.gpus) and all(g.numa_node is not None for g in self.gpus)

    def list_response(self, unhealthy_gpus: frozenset[str] = frozenset()) -> pb.ListAndWatchResponse:
        """The full device list as ListAndWatch sends it."""
        topology = self.with_topology
        devices = []
        for device in self.devices.values():
            health = UNHEALTHY if device.gpu.uuid in unhealthy_gpus else HEALTHY
            item = pb.Device(ID=device.id, health=health)
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
    for pool, gpus in zip(config.pools, selected):
        if not gpus:
            log.warning("pool %s selects no GPU on this node; %s is not advertised", pool.name, pool.resource)
            continue
        resource = Resource(pool=pool, gpus=tuple(gpus), devices=_devices(pool, gpus), allocation_policy=config.allocation_policy)
        size = resource.list_response().ByteSize()
        if size > LIST_BUDGET_BYTES:
            i = config.pools.index(pool)
            raise ConfigError(
                [
                    f"pools[{i}]: {len(resource.devices)} devices make a {size} byte ListAndWatch message, over the "
                    f"{LIST_BUDGET_BYTES} byte budget (the kubelet drops the stream at 4 MiB); lower replicas"
                ],
                config.source,
            )
        resources.append(resource)
    unassigned = [g for g in node.gpus if g.uuid not in owner]
    for gpu in unassigned:
        log.info("GPU %d (%s) is in no pool and is not advertised", gpu.index, gpu.uuid)
    return resources


def _devices(pool: PoolConfig, gpus: list[Gpu]) -> dict[str, Device]:
    if not pool.shared:
        return {g.uuid: Device(id=g.uuid, gpu=g) for g in gpus}
    return {share_id(g.uuid, k): Device(id=share_id(g.uuid, k), gpu=g, share=k) for g in gpus for k in range(pool.replicas)}


def _indexes(node: NodeInfo) -> str:
    return "indexes " + ", ".join(str(g.index) for g in node.gpus) if node.gpus else "no GPUs"

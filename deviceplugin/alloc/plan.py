"""Pools made concrete on one node: which GPUs each resource holds and which device IDs it advertises."""

from __future__ import annotations

import logging

from ..cluster.capacity import FINEST_SPLIT
from ..config.types import Config, ConfigError, PoolConfig
from ..limits import LIST_BUDGET_BYTES, MIN_USEFUL_SHARE_MIB
from ..model.devices import UNHEALTHY, Resource, Unit
from ..model.node import Gpu, NodeInfo
from ..model.shares import share_memory_mib
from .modes import SharingMode, mode_of
from .placement import CLUSTER_POLICIES

log = logging.getLogger(__name__)


def build_resources(
    config: Config,
    node: NodeInfo,
    profile: str | None = None,
    budget_bytes: int = LIST_BUDGET_BYTES,
    dynamic_mig: bool = False,
) -> list[Resource]:
    """Assign every GPU to its pool and list each pool's devices; errors name the config key. `dynamic_mig`: the
    caller serves `strategy: dynamic` pools (the DRA driver); otherwise such a pool is refused."""
    pools = config.pools(profile)
    problems: list[str] = [
        f"{p.key_path}.strategy: dynamic makes MIG instances per claim, which only the DRA driver does "
        "(gpu-share run --api dra); the device plugin serves strategy mixed or single"
        for p in pools
        if p.dynamic_mig and not dynamic_mig
    ]
    if problems:
        raise ConfigError(problems, config.source)
    owner: dict[str, PoolConfig] = {}  # GPU uuid -> the pool that selected it
    selected: dict[str, list[Gpu]] = {p.key_path: [] for p in pools}
    for pool in pools:
        if pool.gpus.selects_rest:
            continue
        for index in pool.gpus.indexes:
            if not any(g.index == index for g in node.gpus):
                problems.append(
                    f"{pool.key_path}.gpus.indexes: no GPU with index {index} on this node ({_indexes(node)})"
                )
        for uuid in pool.gpus.uuids:
            if not any(g.uuid == uuid for g in node.gpus):
                problems.append(f"{pool.key_path}.gpus.uuids: no GPU {uuid} on this node")
        for gpu in node.gpus:
            if not pool.gpus.matches(gpu):
                continue
            if gpu.uuid in owner:
                other = owner[gpu.uuid]
                problems.append(
                    f"{pool.key_path}.gpus: GPU {gpu.index} ({gpu.uuid}) is already selected by {other.key_path} "
                    f"({other.name})"
                )
                continue
            owner[gpu.uuid] = pool
            selected[pool.key_path].append(gpu)
    for pool in pools:
        if pool.gpus.selects_rest:
            selected[pool.key_path] = [g for g in node.gpus if g.uuid not in owner]
            owner.update({g.uuid: pool for g in selected[pool.key_path]})
    if problems:
        raise ConfigError(problems, config.source)

    resources: list[Resource] = []
    settings = config.allocation_settings()
    for pool in pools:
        mode = mode_of(pool)
        try:
            pool_resources = mode.resources(pool, selected[pool.key_path])
        except ValueError as err:
            raise ConfigError([str(err)], config.source) from None
        if not pool_resources:  # a mixed mig pool without MIG instances yields no resource name at all
            why = "no GPU matches its gpus" if not selected[pool.key_path] else "its GPUs have no MIG instance"
            log.warning("pool %s has no usable GPU on this node (%s); it advertises nothing", pool.name, why)
        for name, label, units in pool_resources:
            if not units:
                log.warning("pool %s has no usable GPU on this node; %s is not advertised", pool.name, name)
                continue
            smallest = min(units, key=share_memory_mib) if pool.shared else None
            if smallest is not None and share_memory_mib(smallest) < MIN_USEFUL_SHARE_MIB:
                log.warning(
                    "pool %s: a share of GPU %d (%s) is %d MiB (%d shares), less than a CUDA context needs "
                    "(about %d MiB); lower replicas or use memoryPerShare",
                    pool.name,
                    smallest.gpu.index,
                    smallest.gpu.model,
                    share_memory_mib(smallest),
                    smallest.replicas,
                    MIN_USEFUL_SHARE_MIB,
                )
            problem = _over_budget(mode, pool, units, budget_bytes) or _too_fine(
                settings.allocation_policy, pool, units
            )
            if problem:
                raise ConfigError([problem], config.source)
            resource = Resource(
                pool=pool,
                name=name,
                label=label,
                units=tuple(units),
                devices=mode.devices(units),
                settings=settings,
                links=node.links,
            )
            if any(r.name == name for r in resources):
                raise ConfigError(
                    [f"{pool.key_path}: resource {name} is also advertised by another pool"], config.source
                )
            resources.append(resource)
    for gpu in node.gpus:
        if gpu.uuid not in owner:
            log.info("GPU %d (%s) is in no pool and is not advertised", gpu.index, gpu.uuid)
    return resources


def _too_fine(policy: str, pool: PoolConfig, units: list[Unit]) -> str | None:
    """fgdstrand scores a GPU in thousandths (the cluster model's finest split): units of one share count above that
    have no score. (Units of unequal counts are placed by binpack, `placement.choose_unit`: nothing to refuse.)"""
    finest = max(units, key=lambda u: u.replicas)
    if policy not in CLUSTER_POLICIES or finest.replicas <= FINEST_SPLIT or len({u.replicas for u in units}) > 1:
        return None
    return (
        "allocationPolicy: fgdstrand models a GPU in thousandths, so a GPU or MIG instance can have at "
        f"most {FINEST_SPLIT} shares under it; {pool.key_path} gives {finest.uuid} {finest.replicas}: lower "
        "replicas (or raise memoryPerShare), or use binpack"
    )


def _over_budget(mode: SharingMode, pool: PoolConfig, units: list[Unit], budget_bytes: int) -> str | None:
    """Why these units' devices would not fit one ListAndWatch message, or None; computed, never built.

    A list's size is the sum of its entries' sizes, and an entry's size depends only on its ID's length: so each
    unit costs one encoded entry per ID length (share numbers of 1, 2, 3, 4 digits), with the longer Unhealthy health.
    """
    topology = all(u.gpu.numa_node is not None for u in units)
    count = size = 0
    for unit in units:
        for device_id, n in mode.id_lengths(unit):
            count += n
            size += n * list_entry_bytes(device_id, unit.gpu.numa_node if topology else None)
    if size <= budget_bytes:
        return None
    per_unit, remedy = mode.budget_terms(pool, units)
    return (
        f"{pool.key_path}: {count} devices "
        f"({len(units)} {'MIG instances' if units[0].mig else 'GPUs'}, {per_unit}) would make a ListAndWatch "
        f"message of up to {size} bytes, over the {budget_bytes} byte budget (the kubelet drops the stream "
        f"at 4 MiB): at most about {count * budget_bytes // size} devices fit; {remedy}"
    )


def list_entry_bytes(device_id: str, numa_node: int | None, health: str = UNHEALTHY) -> int:
    """The encoded size of a ListAndWatchResponse holding this one device, from the protobuf wire format:

        ListAndWatchResponse { repeated Device devices = 1 }
        Device { string ID = 1; string health = 2; TopologyInfo topology = 3 }
        TopologyInfo { repeated NUMANode nodes = 1 }
        NUMANode { int64 ID = 1 }

    Every field number is below 16 (a one-byte tag); a length-delimited field is tag + varint(length) + payload;
    proto3 leaves out an empty string and a zero integer.
    """
    device = _string_field(device_id) + _string_field(health)
    if numa_node is not None:
        numa = 0 if numa_node == 0 else 1 + _varint_bytes(numa_node)
        device += _field(_field(numa))  # topology { nodes { ID } }
    return _field(device)


def _string_field(text: str) -> int:
    return _field(len(text.encode())) if text else 0


def _field(payload: int) -> int:
    """A length-delimited field with a one-byte tag and `payload` bytes."""
    return 1 + _varint_bytes(payload) + payload


def _varint_bytes(value: int) -> int:
    """A negative int64 is encoded as ten bytes (two's complement)."""
    return 10 if value < 0 else max(1, (value.bit_length() + 6) // 7)


def _indexes(node: NodeInfo) -> str:
    return "indexes " + ", ".join(str(g.index) for g in node.gpus) if node.gpus else "no GPUs"

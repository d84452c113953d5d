"""What the node agent sees each round: who holds which share (pod-resources), GPU stats and processes (NVML), and
which container each process belongs to (cgroups through the pod directory), hence each share's memory and the
memory of processes no active container owns."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from ..discovery.inventory import Inventory
from ..model.devices import Resource
from ..model.node import GpuProcess, GpuStats, NodeInfo
from ..model.usage import Usage
from . import residue
from .procmap import ProcessMapper
from .settings import AgentSettings
from .usage import PodResourcesClient, UsageBuilder, build_usage
from .watchdog import ContainerMemory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Observation:
    """One round of the agent; read-only once made (the NodeState hands it to every reader)."""

    usage: Usage = field(default_factory=Usage)
    stats: dict[str, GpuStats] = field(default_factory=dict)
    containers: tuple[ContainerMemory, ...] = ()
    residue_mib: dict[str, int] = field(default_factory=dict)  # GPU uuid -> MiB held by processes of ended containers
    unattributed_mib: dict[str, int] = field(
        default_factory=dict
    )  # GPU uuid -> MiB of processes no evidence attributes
    last_sync: float | None = None  # unix time of the last successful pod-resources List
    fresh: bool = False  # `usage` comes from this round's List (not the previous round's, kept after a failure)
    attributed: bool = False  # `containers` and the residue were measured this round (the pod directory was read)


class Observer:
    """Makes each round's Observation; backs off while the kubelet rate-limits pod-resources."""

    def __init__(
        self,
        inventory: Inventory,
        node: NodeInfo,
        client: PodResourcesClient,
        resources: Callable[[], list[Resource]],
        settings: AgentSettings,
        mapper: ProcessMapper | None,
        build: UsageBuilder = build_usage,
    ) -> None:
        self.inventory = inventory
        self.build = build  # the usage map from one List: device plugin devices, or DRA claims (dra.usage)
        self.node = node
        self.client = client
        self.resources = resources
        self.settings = settings
        self.mapper = mapper
        self.rate_limited = 0  # pod-resources calls refused by the kubelet's rate limit
        self.delay = settings.interval  # until the next round: longer after a rate-limit refusal

    def observe(self, previous: Observation) -> Observation:
        usage, last_sync, fresh = previous.usage, previous.last_sync, False
        try:
            usage = self.build(self.client.list(), self.resources())
            last_sync, fresh = time.time(), True
            self.delay = self.settings.interval
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.rate_limited += 1
                self.delay = min(self.delay * 2, self.settings.backoff_max)
                log.warning("pod-resources rate limit hit (%s); next poll in %.1fs", err.details(), self.delay)
            else:
                log.warning("pod-resources List failed: %s: %s", err.code().name, err.details())
        stats = {g.uuid: self.inventory.stats(g.uuid) for g in self.node.gpus}
        listed = {g.uuid: self.inventory.processes(g.uuid) for g in self.node.gpus}
        processes = [p for found in listed.values() for p in found or ()]
        found = self._attribute(usage, processes, previous)
        if found is None:  # the pod directory could not be read: judge nothing on stale owners
            containers, leftover, unattributed = previous.containers, previous.residue_mib, previous.unattributed_mib
        else:
            containers, leftover, unattributed = found
            unknown = {u for u, got in listed.items() if got is None}
            for uuid in unknown:  # unknown: what was known stays
                for now, before in ((leftover, previous.residue_mib), (unattributed, previous.unattributed_mib)):
                    now.pop(uuid, None)
                    if uuid in before:
                        now[uuid] = before[uuid]
            if unknown:  # and so does each container's memory there (not 0: the watchdog would end its episode)
                units = unknown | {m.uuid for g in self.node.gpus if g.uuid in unknown for m in g.mig_devices}
                known = {(c.share.key, c.share.unit_uuid): c for c in previous.containers}
                containers = tuple(
                    known.get((c.share.key, c.share.unit_uuid), c) if c.share.unit_uuid in units else c
                    for c in containers
                )
        return Observation(
            usage=usage,
            stats=stats,
            containers=containers,
            residue_mib=residue.reportable(leftover, previous.residue_mib, fresh),
            unattributed_mib=unattributed,
            last_sync=last_sync,
            fresh=fresh,
            attributed=found is not None,
        )

    def _attribute(
        self, usage: Usage, processes: list[GpuProcess], previous: Observation
    ) -> tuple[tuple[ContainerMemory, ...], dict[str, int], dict[str, int]] | None:
        """Each share's processes and memory; per GPU the memory of processes of ended containers (residue) and of
        processes no evidence attributes to an active container (unattributed: reported, never quarantined).

        Without a pod directory nothing is attributed; None when it could not be read this round.
        """
        if self.mapper is None:
            return (), {}, {}
        try:
            self.mapper.refresh()
        except Exception as err:
            log.warning("cannot list the node's pods: %s", err)
            return None
        owners = {p.pid: self.mapper.owner(p.pid) for p in processes}
        containers = []
        for share in usage.shares:
            mine = [
                p for p in processes if owners[p.pid].key == share.key and (p.mig_uuid or p.gpu_uuid) == share.unit_uuid
            ]
            containers.append(
                ContainerMemory(share=share, used_mib=sum(p.used_mib for p in mine), pids=tuple(p.pid for p in mine))
            )
        leftover: dict[str, int] = {}
        unattributed: dict[str, int] = {}
        why: dict[str, set[str]] = {}  # GPU uuid -> why its unattributed processes are
        for process in processes:
            owner = owners[process.pid]
            if process.used_mib <= 0 or owner.key in usage.active_containers:
                continue
            into = leftover if owner.ended else unattributed
            into[process.gpu_uuid] = into.get(process.gpu_uuid, 0) + process.used_mib
            if not owner.ended:
                why.setdefault(process.gpu_uuid, set()).add(
                    owner.unknown or f"container {'/'.join(owner.key or ())} is not in pod-resources"
                )
        for uuid in unattributed.keys() - previous.unattributed_mib.keys():  # said once per GPU while it lasts
            log.warning(
                "GPU %s: %d MiB held by processes not attributed to an active container (%s); reported, not "
                "quarantined",
                uuid,
                unattributed[uuid],
                "; ".join(sorted(why[uuid]))[:300],
            )
        return tuple(containers), leftover, unattributed

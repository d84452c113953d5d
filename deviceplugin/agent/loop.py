"""The node agent: every interval, who holds which share (pod-resources), what each container really uses
(NVML processes mapped through cgroups), the memory watchdog, the residue guard, metering, and node labels."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from ..model.node import GpuProcess, GpuStats, NodeInfo
from ..model.shares import share_gpu_fraction
from ..discovery.inventory import Inventory
from ..loop import BackgroundLoop
from ..plugin.manager import PluginManager
from .metering import Holding, Meter, MeterKey
from ..kube.labels import InventoryAnnotation, NodePublisher, node_labels
from ..runtime.options import AgentSettings
from .usage import PodResourcesClient, Usage, build_usage
from .procmap import ProcessMapper
from .watchdog import ContainerMemory, MemoryWatchdog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """What the agent saw in its last round; the metrics endpoint reads it."""

    usage: Usage = field(default_factory=Usage)
    stats: dict[str, GpuStats] = field(default_factory=dict)
    containers: tuple[ContainerMemory, ...] = ()
    residue_mib: dict[str, int] = field(default_factory=dict)  # GPU uuid -> MiB held by processes of ended containers
    unattributed_mib: dict[str, int] = field(default_factory=dict)  # GPU uuid -> MiB of processes no evidence attributes
    quarantined: frozenset[str] = frozenset()  # GPU uuids
    quarantined_devices: frozenset[str] = frozenset()  # device IDs advertised Unhealthy by the residue guard (the free ones)
    last_sync: float | None = None  # unix time of the last successful pod-resources List


class NodeAgent(BackgroundLoop):
    def __init__(
        self,
        inventory: Inventory,
        node: NodeInfo,
        manager: PluginManager,
        client: PodResourcesClient,
        settings: AgentSettings = AgentSettings(),
        mapper: ProcessMapper | None = None,
        watchdog: MemoryWatchdog | None = None,
        publisher: NodePublisher | None = None,
        unhealthy: Callable[[], frozenset[str]] | None = None,
        meter: Meter | None = None,
    ) -> None:
        super().__init__("node-agent")
        self.inventory = inventory
        self.node = node
        self.manager = manager
        self.client = client
        self.settings = settings
        self.mapper = mapper
        self.watchdog = watchdog or MemoryWatchdog()
        self.publisher = publisher
        self.annotation = InventoryAnnotation()
        self.unhealthy = unhealthy or (lambda: frozenset())
        # Rounds further apart than a few intervals (or one rate-limit backoff) are not metered: a gap, not a guess.
        self.meter = meter or Meter(max_gap=max(3 * settings.interval, settings.interval + settings.backoff_max))
        self.quarantine = settings.quarantine  # follows config reloads
        self.snapshot = Snapshot()
        self.rate_limited = 0
        self._delay = settings.interval
        if mapper is None:
            log.warning("no pod directory (Kubernetes API): per-container memory, the watchdog and the residue guard are off")

    def start(self) -> None:
        self._start_thread()

    def stop(self) -> None:
        self._stop_thread()
        self.client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception:  # the agent observes; it must never take the plugin down
                log.exception("node agent round failed")
            self._stop.wait(self._delay)

    def sync(self) -> Snapshot:
        """One round; returns (and keeps) the new snapshot."""
        previous = self.snapshot
        usage, last_sync, fresh = previous.usage, previous.last_sync, False
        try:
            usage = build_usage(self.client.list(), self.manager.resources)
            last_sync, fresh = time.time(), True
            self._delay = self.settings.interval
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.rate_limited += 1
                self._delay = min(self._delay * 2, self.settings.backoff_max)
                log.warning("pod-resources rate limit hit (%s); next poll in %.1fs", err.details(), self._delay)
            else:
                log.warning("pod-resources List failed: %s: %s", err.code().name, err.details())
        stats = {g.uuid: self.inventory.stats(g.uuid) for g in self.node.gpus}
        processes = [p for g in self.node.gpus for p in self.inventory.processes(g.uuid)]
        found = self._attribute(usage, processes)
        if found is None:  # the pod directory could not be read: judge nothing on stale owners
            containers, residue, unattributed = previous.containers, previous.residue_mib, previous.unattributed_mib
        else:
            containers, residue, unattributed = found
            self.watchdog.review(list(containers))
        if fresh:
            self.meter.observe(self._holdings(usage, containers))
        else:  # usage is stale: no new residue is judged on it, nothing is metered on it
            residue = {u: mib for u, mib in residue.items() if u in previous.residue_mib}
        # Residue seen in two rounds in a row: a process that started between the pod list and NVML's is not a leftover.
        confirmed = frozenset(u for u in residue if u in previous.residue_mib)
        quarantined = confirmed if self.quarantine else frozenset()
        if quarantined != previous.quarantined:
            for uuid in quarantined - previous.quarantined:
                log.warning("GPU %s holds %d MiB of a finished tenant: its free devices are Unhealthy until released", uuid, residue[uuid])
            for uuid in previous.quarantined - quarantined:
                log.info("GPU %s: leftover memory released, quarantine lifted", uuid)
        allocated = usage.allocated()
        held_back = frozenset(d.id for r in self.manager.resources for d in r.devices.values() if d.gpu.uuid in quarantined and d.id not in allocated)
        self.manager.set_quarantined(held_back)
        if self.publisher is not None:
            resources = self.manager.resources
            self.publisher.publish(
                node_labels(self.publisher.domain, self.node, resources, self.publisher.shared_product_suffix),
                self.annotation.build(self.node, resources, usage, self.unhealthy(), quarantined),
            )
        self.snapshot = Snapshot(
            usage=usage,
            stats=stats,
            containers=containers,
            residue_mib=residue,
            unattributed_mib=unattributed,
            quarantined=quarantined,
            quarantined_devices=held_back,
            last_sync=last_sync,
        )
        return self.snapshot

    def _holdings(self, usage: Usage, containers: tuple[ContainerMemory, ...]) -> dict[MeterKey, Holding]:
        """Per (namespace, pod, resource): devices held, the GPU fraction they are, and the memory really used."""
        by_name = {r.name: r for r in self.manager.resources}
        used = {(c.share.key, c.share.unit_uuid): c.used_mib for c in containers}
        holdings: dict[MeterKey, Holding] = {}
        for share in usage.shares:
            resource = by_name.get(share.resource)
            device = resource.devices.get(share.devices[0]) if resource else None
            if device is None:  # changed by a config reload since this round's List
                continue
            unit = device.unit
            key = (share.namespace, share.pod, share.resource)
            held = holdings.get(key, Holding())
            holdings[key] = Holding(
                shares=held.shares + share.shares,
                gpus=held.gpus + share_gpu_fraction(unit, share.shares),
                memory_bytes=held.memory_bytes + used.get((share.key, share.unit_uuid), 0) * 1024 * 1024,
            )
        return holdings

    def _attribute(
        self, usage: Usage, processes: list[GpuProcess]
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
            mine = [p for p in processes if owners[p.pid].key == share.key and (p.mig_uuid or p.gpu_uuid) == share.unit_uuid]
            containers.append(ContainerMemory(share=share, used_mib=sum(p.used_mib for p in mine), pids=tuple(p.pid for p in mine)))
        residue: dict[str, int] = {}
        unattributed: dict[str, int] = {}
        why: dict[str, set[str]] = {}  # GPU uuid -> why its unattributed processes are
        for process in processes:
            owner = owners[process.pid]
            if process.used_mib <= 0 or owner.key in usage.active_containers:
                continue
            into = residue if owner.ended else unattributed
            into[process.gpu_uuid] = into.get(process.gpu_uuid, 0) + process.used_mib
            if not owner.ended:
                why.setdefault(process.gpu_uuid, set()).add(owner.unknown or f"container {'/'.join(owner.key or ())} is not in pod-resources")
        for uuid in unattributed.keys() - self.snapshot.unattributed_mib.keys():  # said once per GPU while it lasts
            log.warning(
                "GPU %s: %d MiB held by processes not attributed to an active container (%s); reported, not quarantined",
                uuid, unattributed[uuid], "; ".join(sorted(why[uuid]))[:300],
            )
        return tuple(containers), residue, unattributed

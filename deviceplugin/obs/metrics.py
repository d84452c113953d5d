"""The Prometheus metrics (prometheus-client): GPUs, pools, containers and the plugin's own health. Every metric is
prefixed `gpushare_` and documented in docs/metrics.md; obs.http serves them with /healthz and /readyz."""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import __version__
from ..model.node import MIB, NodeInfo
from ..state import NodeState

if TYPE_CHECKING:  # annotations only: the exporter must not import the plugin it observes
    from ..agent.loop import NodeAgent
    from ..config.types import Config
    from ..kube.events import EventOutbox
    from ..model.devices import Resource
    from ..plugin.manager import PluginManager
    from ..runtime.reload import ConfigReloader

log = logging.getLogger(__name__)


class PluginMetrics:
    """Counters the gRPC layer feeds as things happen."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.allocations = Counter(
            "gpushare_allocate_requests",
            "Allocate calls by resource and result (ok, refused).",
            ["resource", "result"],
            registry=registry,
        )
        self.allocate_seconds = Histogram(
            "gpushare_allocate_duration_seconds",
            "Time to answer Allocate.",
            ["resource"],
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0),
            registry=registry,
        )
        self.registrations = Counter(
            "gpushare_registrations", "Successful registrations with the kubelet.", ["resource"], registry=registry
        )

    def declare(self, resources: Iterable[str]) -> None:
        """Create every child series of these resources at 0, so they exist before the first Allocate."""
        for name in resources:
            self.allocate_seconds.labels(name)
            self.allocations.labels(name, "ok")
            self.allocations.labels(name, "refused")
            self.registrations.labels(name)

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload (runtime.reload): the series of new resources exist at 0 from now on."""
        self.declare(r.name for r in resources)

    def allocated(self, resource: str, ok: bool, seconds: float) -> None:
        self.allocations.labels(resource, "ok" if ok else "refused").inc()
        self.allocate_seconds.labels(resource).observe(seconds)

    def registered(self, resource: str) -> None:
        self.registrations.labels(resource).inc()


class StateCollector(Collector):
    """Reads the current state on every scrape: nothing to keep in step, nothing stale."""

    def __init__(self, sources: MetricSources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        s = self.sources
        node = s.node
        view = s.state.snapshot()
        snapshot = view.observation
        awaiting_reset = view.awaiting_reset
        gpu_labels = ["gpu", "uuid", "model"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "memory_used": GaugeMetricFamily("gpushare_gpu_memory_used_bytes", "GPU memory in use.", labels=gpu_labels),
            "memory_total": GaugeMetricFamily(
                "gpushare_gpu_memory_total_bytes", "GPU memory in all.", labels=gpu_labels
            ),
            "utilization": GaugeMetricFamily(
                "gpushare_gpu_utilization_ratio", "GPU busy time over the last sample period (0-1).", labels=gpu_labels
            ),
            "temperature": GaugeMetricFamily("gpushare_gpu_temperature_celsius", "GPU temperature.", labels=gpu_labels),
            "power": GaugeMetricFamily("gpushare_gpu_power_watts", "GPU power draw.", labels=gpu_labels),
            "healthy": GaugeMetricFamily(
                "gpushare_gpu_healthy",
                "0 while the health monitor has a fault on the GPU itself (its devices are Unhealthy), else 1: the "
                "verdict's fault only; quarantine and a shape that waits have series of their own, and a MIG "
                "instance's own fault is not counted.",
                labels=gpu_labels,
            ),
            "reset": GaugeMetricFamily(
                "gpushare_gpu_reset_required",
                "1 while the health monitor waits for a GPU reset: a reset-class fault or a lost GPU keeps the GPU "
                "(or a MIG instance on it) Unhealthy until the GPU is reset.",
                labels=gpu_labels,
            ),
            "xid": CounterMetricFamily(
                "gpushare_gpu_xid_errors", "Critical XID errors seen (ignored XIDs excluded).", labels=gpu_labels
            ),
            "residue": GaugeMetricFamily(
                "gpushare_gpu_residue_memory_bytes",
                "GPU memory held by processes of containers known to have ended.",
                labels=gpu_labels,
            ),
            "unattributed": GaugeMetricFamily(
                "gpushare_gpu_unattributed_memory_bytes",
                "GPU memory of processes not attributed to an active container (reported, never quarantined).",
                labels=gpu_labels,
            ),
            "quarantined": GaugeMetricFamily(
                "gpushare_gpu_quarantined",
                "1 while the residue guard holds the GPU's free devices back.",
                labels=gpu_labels,
            ),
            "pending": GaugeMetricFamily(
                "gpushare_gpu_config_pending",
                "1 while a reload waits for the GPU's holders to leave before changing its shape.",
                labels=gpu_labels,
            ),
        }
        for gpu in node.gpus:
            labels = [str(gpu.index), gpu.uuid, gpu.model]
            stats = snapshot.stats.get(gpu.uuid) if snapshot else None
            families["memory_total"].add_metric(labels, gpu.memory_mib * MIB)
            if stats and stats.memory_used_mib is not None:
                families["memory_used"].add_metric(labels, stats.memory_used_mib * MIB)
            if stats and stats.utilization_percent is not None:
                families["utilization"].add_metric(labels, stats.utilization_percent / 100)
            if stats and stats.temperature_celsius is not None:
                families["temperature"].add_metric(labels, stats.temperature_celsius)
            if stats and stats.power_watts is not None:
                families["power"].add_metric(labels, stats.power_watts)
            families["healthy"].add_metric(labels, 0 if view.fault_of(gpu.uuid) else 1)  # the verdict's fault
            families["reset"].add_metric(
                labels, 1 if {gpu.uuid, *(m.uuid for m in gpu.mig_devices)} & awaiting_reset else 0
            )
            families["xid"].add_metric(labels, view.xid_counts.get(gpu.uuid, 0))
            # 0 before the first agent round, like every other state series
            families["residue"].add_metric(labels, snapshot.residue_mib.get(gpu.uuid, 0) * MIB if snapshot else 0)
            families["unattributed"].add_metric(
                labels, snapshot.unattributed_mib.get(gpu.uuid, 0) * MIB if snapshot else 0
            )
            families["quarantined"].add_metric(labels, 1 if gpu.uuid in view.quarantined_gpus else 0)
            families["pending"].add_metric(labels, 1 if gpu.uuid in view.pending_gpus else 0)
        yield from families.values()

        total = GaugeMetricFamily(
            "gpushare_shares",
            "Devices (shares, whole GPUs or MIG instances) advertised, per resource and GPU.",
            labels=["resource", "pool", "gpu", "uuid"],
        )
        allocated = GaugeMetricFamily(
            "gpushare_shares_allocated",
            "Devices held by active containers (from pod-resources).",
            labels=["resource", "pool", "gpu", "uuid"],
        )
        held: dict[tuple[str, str], int] = {}
        for share in snapshot.usage.shares if snapshot else ():
            held[(share.resource, share.gpu_uuid)] = held.get((share.resource, share.gpu_uuid), 0) + share.shares
        for resource in s.resources():
            per_gpu: dict[str, int] = {}
            for device in resource.devices.values():
                per_gpu[device.gpu.uuid] = per_gpu.get(device.gpu.uuid, 0) + 1
            for gpu in resource.gpus:
                labels = [resource.name, resource.pool.name, str(gpu.index), gpu.uuid]
                total.add_metric(labels, per_gpu.get(gpu.uuid, 0))
                allocated.add_metric(labels, held.get((resource.name, gpu.uuid), 0))
        yield total
        yield allocated

        container_labels = ["namespace", "pod", "container", "resource", "uuid"]
        shares = GaugeMetricFamily(
            "gpushare_container_shares",
            "Devices a container holds on one GPU or MIG instance.",
            labels=container_labels,
        )
        limit = GaugeMetricFamily(
            "gpushare_container_memory_limit_bytes", "GPU memory a container's shares allow.", labels=container_labels
        )
        used = GaugeMetricFamily(
            "gpushare_container_memory_used_bytes",
            "GPU memory a container's processes really use (NVML).",
            labels=container_labels,
        )
        over = GaugeMetricFamily(
            "gpushare_container_over_limit",
            "1 when a time-sliced container uses more GPU memory than its shares allow.",
            labels=container_labels,
        )
        # one series per label set: records that share one (a usage map that did not merge them) add up
        held_by: dict[tuple[str, ...], list[int]] = {}  # labels -> [shares, limit MiB]
        for share in snapshot.usage.shares if snapshot else ():
            totals = held_by.setdefault(
                (share.namespace, share.pod, share.container, share.resource, share.unit_uuid), [0, 0]
            )
            totals[0] += share.shares
            totals[1] += share.memory_limit_mib
        measured: dict[tuple[str, ...], list[int]] = {}  # labels -> [used MiB, over limit]
        for item in snapshot.containers if snapshot else ():
            share = item.share
            values = measured.setdefault(
                (share.namespace, share.pod, share.container, share.resource, share.unit_uuid), [0, 0]
            )
            values[0] = max(values[0], item.used_mib)  # the same processes, measured for each record
            values[1] |= item.over_limit
        for series, (count, limit_mib) in held_by.items():
            shares.add_metric(list(series), count)
            limit.add_metric(list(series), limit_mib * MIB)
            if series in measured:
                used.add_metric(list(series), measured[series][0] * MIB)
                over.add_metric(list(series), measured[series][1])
        yield from (shares, limit, used, over)

        yield CounterMetricFamily(
            "gpushare_kubelet_restarts", "Kubelet restarts seen (kubelet.sock recreated).", value=s.kubelet_restarts()
        )
        reloads = CounterMetricFamily("gpushare_config_reloads", "Config reloads by result.", labels=["result"])
        ok, failed = s.reloads()
        reloads.add_metric(["success"], ok)
        reloads.add_metric(["error"], failed)
        yield reloads
        agent = s.agent
        if agent:
            yield from _metering(agent.meter)
        yield CounterMetricFamily(
            "gpushare_pod_resources_rate_limited",
            "pod-resources calls refused by the kubelet's rate limit.",
            value=agent.rate_limited if agent else 0,
        )
        yield CounterMetricFamily(
            "gpushare_memory_violations",
            "Time-sliced containers found over their GPU memory (once per episode).",
            value=agent.watchdog.violations if agent else 0,
        )
        yield CounterMetricFamily(
            "gpushare_memory_kills",
            "Processes killed by the memory watchdog.",
            value=agent.watchdog.kills if agent else 0,
        )
        yield CounterMetricFamily(
            "gpushare_memory_kill_failures",
            "Processes the memory watchdog failed to kill (once per PID).",
            value=agent.watchdog.kill_failures if agent else 0,
        )
        yield CounterMetricFamily(
            "gpushare_reset_evidence_errors",
            "Failed reads (every GPU then held for a reset) and writes of the reset evidence file.",
            value=view.evidence_errors,
        )
        yield CounterMetricFamily(
            "gpushare_events_dropped",
            "Pod Events dropped, oldest first, because the outbox to the API was full.",
            value=s.events_dropped(),
        )
        last_sync = snapshot.last_sync if snapshot and snapshot.last_sync is not None else 0
        yield GaugeMetricFamily(
            "gpushare_pod_resources_last_sync_timestamp_seconds",
            "Unix time of the last successful pod-resources List; 0 before the first.",
            value=last_sync,
        )
        yield GaugeMetricFamily(
            "gpushare_gpus_skipped",
            "GPUs discovery could not describe at start-up: left out, the others are served "
            "(log: GPU N is not usable).",
            value=len(node.skipped),
        )
        yield GaugeMetricFamily(
            "gpushare_instance_standby",
            "1 while this process stands by for the instance lock another process holds, serving nothing.",
            value=1 if s.standby else 0,
        )
        yield GaugeMetricFamily(
            "gpushare_nvml_up",
            "1 when the GPUs were discovered (NVML loaded); 0 while the plugin runs without devices.",
            value=1 if s.nvml_up else 0,
        )
        info = GaugeMetricFamily(
            "gpushare_build_info", "Always 1; the labels say which gpu-share runs.", labels=["version", "python"]
        )
        info.add_metric([__version__, platform.python_version()], 1)
        yield info
        cdi = GaugeMetricFamily(
            "gpushare_cdi_devices_missing",
            "Advertised devices no CDI spec on the node names (CDI mode).",
            labels=["resource"],
        )
        missing: dict[str, list[str]] = s.cdi_missing()
        for resource in s.resources():
            cdi.add_metric([resource.name], len(missing.get(resource.name, ())))
        yield cdi
        yield GaugeMetricFamily(
            "gpushare_config_in_sync",
            "1 when the running config is the config file's current content.",
            value=1 if s.config_in_sync() else 0,
        )
        yield GaugeMetricFamily(
            "gpushare_config_pending_gpus",
            "GPUs kept in their previous shape until what holds them is released (a reload waits for them).",
            value=len(view.pending_gpus),
        )
        yield CounterMetricFamily(
            "gpushare_config_deferred_switches",
            "Times a GPU's change of shape had to wait for its holders (once per GPU and wait).",
            value=s.deferred_switches(),
        )
        yield CounterMetricFamily(
            "gpushare_holds_unreadable",
            "Reads of what containers hold (pod-resources, the kubelet checkpoint) that failed; "
            "no GPU changed shape after them.",
            value=s.unreadable_holds(),
        )
        registered = GaugeMetricFamily(
            "gpushare_resource_registered", "1 while the resource is registered with the kubelet.", labels=["resource"]
        )
        for name, is_registered in s.registration():
            registered.add_metric([name], 1 if is_registered else 0)
        yield registered


def _metering(meter) -> Iterator[Metric]:
    """The meter's totals as counters (no `_created` series: they would double the per-pod series)."""
    labels = ["namespace", "pod", "resource"]
    families = [
        (
            CounterMetricFamily(
                "gpushare_share_seconds",
                "Devices (shares, whole GPUs, MIG instances) held x seconds, per pod.",
                labels=labels,
            ),
            "share_seconds",
        ),
        (
            CounterMetricFamily(
                "gpushare_gpu_seconds",
                "GPU-equivalents held x seconds (a share of a 4-way GPU is 0.25), per pod.",
                labels=labels,
            ),
            "gpu_seconds",
        ),
        (
            CounterMetricFamily(
                "gpushare_memory_used_byte_seconds", "GPU memory really used (NVML) x seconds, per pod.", labels=labels
            ),
            "memory_byte_seconds",
        ),
    ]
    totals = meter.totals()
    for family, field in families:
        for key, total in totals.items():
            family.add_metric(list(key), getattr(total, field))
        yield family


class Exposition(Collector):
    """What /metrics serves: every series of `inner`, with a `node` label (the node's name, when given) so dashboards
    need no relabeling, and never two series with one name and label set, nor two families of one name (a scrape
    rejects either): a repeated series is left out and logged once per metric name."""

    def __init__(self, inner: CollectorRegistry, node: str | None) -> None:
        self.inner = inner
        self.node = node
        self.duplicates = 0  # series left out because an earlier one had the same name and labels
        self._logged: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for family in self.inner.collect():
            out = families.get(family.name)
            if out is None:
                out = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {**sample.labels, "node": self.node} if self.node else dict(sample.labels)
                series = (sample.name, tuple(sorted(labels.items())))
                if series in seen:
                    self._duplicate(sample.name, labels)
                    continue
                seen.add(series)
                out.samples.append(sample._replace(labels=labels))
        yield from families.values()

    def _duplicate(self, name: str, labels: dict[str, str]) -> None:
        self.duplicates += 1
        if name not in self._logged and len(self._logged) < 256:
            self._logged.add(name)
            log.warning(
                "metrics: a second %s series with labels %s was left out (a bug: please report it)", name, labels
            )


def exposed_registry(inner: CollectorRegistry, node: str | None) -> CollectorRegistry:
    """What /metrics serves: `inner` through the Exposition."""
    registry = CollectorRegistry()
    registry.register(Exposition(inner, node))
    return registry


class MetricSources:
    """Where the collector reads from: the node state, and the public counters of the parts that keep them; each
    part is optional so the endpoint also serves a partial plugin."""

    def __init__(
        self,
        node: NodeInfo,
        state: NodeState | None = None,
        manager: PluginManager | None = None,
        agent: NodeAgent | None = None,
        reloader: ConfigReloader | None = None,
        nvml_up: bool = True,
        cdi_missing: Callable[[], dict[str, list[str]]] | None = None,
        events: EventOutbox | None = None,
        standby: bool = False,
    ) -> None:
        self.node = node
        self.standby = standby  # a second instance waiting for the instance lock, serving nothing
        self.state = state or NodeState()
        self.nvml_up = nvml_up
        self.cdi_missing = cdi_missing or dict  # () -> {resource: [CDI names no spec defines]}
        self.manager = manager
        self.agent = agent
        self.reloader = reloader
        self.events = events

    def resources(self) -> list[Resource]:
        return self.manager.resources if self.manager else []

    def kubelet_restarts(self) -> int:
        return self.manager.kubelet_restarts if self.manager else 0

    def deferred_switches(self) -> int:
        return self.manager.shapes.deferred if self.manager else 0

    def unreadable_holds(self) -> int:
        return self.manager.shapes.unreadable_holds if self.manager else 0

    def reloads(self) -> tuple[int, int]:
        return (self.reloader.reloads, self.reloader.errors) if self.reloader else (0, 0)

    def events_dropped(self) -> int:
        return self.events.dropped if self.events else 0

    def config_in_sync(self) -> bool:
        return self.reloader.in_sync if self.reloader else True

    def registration(self) -> list[tuple[str, bool]]:
        return self.manager.registration() if self.manager else []

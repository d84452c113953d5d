"""The composition root of `gpu-share run`: every part of the plugin, wired and started in order."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from .agent import AgentSettings, NodeAgent
from .config import Config
from .health import HealthMonitor, HealthSettings
from .inventory import Inventory, NodeInfo
from .kube import NodeClient
from .manager import PluginManager
from .metrics import MetricSources, MetricsServer, PluginMetrics, StateCollector
from .nodelabels import NodePublisher
from .podresources import PodResourcesClient
from .procmap import PodDirectory, ProcessMapper
from .reload import ConfigReloader, ProfileSource, load_plan
from .server import Timings
from .watchdog import MemoryWatchdog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DaemonOptions:
    config_file: str | None = None
    profile: str | None = None
    plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    metrics_port: int = 9410  # 0: no endpoint
    metrics_host: str = "0.0.0.0"
    proc_root: str = "/proc"
    reload_interval: float = 10.0
    profile_label_interval: float = 60.0
    label_interval: float = 5.0
    timings: Timings = Timings()
    health: HealthSettings = HealthSettings()
    agent: AgentSettings = AgentSettings()


class PluginDaemon:
    """Discovery -> config -> servers <-> kubelet; health; node agent -> labels and metrics."""

    def __init__(self, inventory: Inventory, options: DaemonOptions, client: NodeClient | None = None, pod_directory: PodDirectory | None = None) -> None:
        self.inventory = inventory
        self.options = options
        self.node: NodeInfo = inventory.discover()
        profiles = ProfileSource(options.profile, client, options.profile_label_interval)
        config, profile, resources = load_plan(options.config_file, self.node, profiles)
        log.info("serving profile %s", profile or config.default_profile)
        self.config: Config = config
        self.registry = CollectorRegistry()
        self.manager = PluginManager(resources, options.plugin_dir, options.timings, PluginMetrics(self.registry))
        self.monitor = HealthMonitor(inventory, self.node, self.manager.set_unhealthy, options.health)
        self.reloader = ConfigReloader(options.config_file, self.node, self.manager, profiles, options.reload_interval, self._reloaded)
        directory = pod_directory or client
        self.agent = NodeAgent(
            inventory,
            self.node,
            self.manager,
            PodResourcesClient(options.pod_resources_socket),
            AgentSettings(options.agent.interval, options.agent.backoff_max, quarantine=config.quarantine),
            mapper=ProcessMapper(directory, options.proc_root) if directory else None,
            watchdog=MemoryWatchdog(config.watchdog_policy, events=self._event_sink(client)),
            publisher=NodePublisher(client, config.domain, options.label_interval) if client else None,
            unhealthy=lambda: frozenset(self.monitor.unhealthy),
        )
        self.registry.register(StateCollector(MetricSources(self.node, self.manager, self.agent, self.monitor, self.reloader)))
        self.metrics_server = (
            MetricsServer(self.registry, self.manager.health, self.manager.readiness, options.metrics_port, options.metrics_host)
            if options.metrics_port
            else None
        )

    def _reloaded(self, config: Config) -> None:
        """Settings outside the resources follow the new config too."""
        self.config = config
        self.agent.watchdog.policy = config.watchdog_policy
        self.agent.quarantine = config.quarantine

    @staticmethod
    def _event_sink(client: NodeClient | None):
        if client is None:
            return None
        return lambda namespace, pod, reason, message: client.pod_event(namespace, pod, None, reason, message)

    def start(self) -> None:
        if self.metrics_server:
            self.metrics_server.start()
        self.manager.start()
        self.monitor.start()
        self.reloader.start(self.config)  # the config load_plan already parsed
        self.agent.start()
        for resource in self.manager.resources:
            log.info("%s: %d devices on %d GPUs", resource.name, len(resource.devices), len(resource.gpus))

    def stop(self) -> None:
        self.agent.stop()
        self.reloader.stop()
        self.monitor.stop()
        self.manager.stop()
        if self.metrics_server:
            self.metrics_server.stop()
        self.inventory.close()

"""The composition root of `gpu-share run`: every part of the plugin, wired and started in order."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from ..agent.loop import AgentSettings, NodeAgent
from ..agent.procmap import ProcessMapper
from ..agent.publish import PublishLoop
from ..agent.usage import PodResourcesClient
from ..agent.watchdog import MemoryWatchdog
from ..alloc.cdi import CdiCheck
from ..alloc.devicenodes import missing_device_nodes
from ..config.types import Config
from ..discovery.inventory import Inventory
from ..health.monitor import HealthMonitor
from ..kube.client import NodeClient
from ..kube.events import EventOutbox
from ..kube.labels import NodePublisher
from ..model.devices import Resource
from ..model.node import NodeInfo
from ..model.pods import PodDirectory
from ..obs.http import MetricsServer
from ..obs.metrics import MetricSources, PluginMetrics, StateCollector
from ..state import NodeState
from .options import DaemonOptions
from .reload import ConfigConsumer, ConfigReloader
from .serving import Serving, plan_serving

log = logging.getLogger(__name__)


class PluginDaemon:
    """Discovery -> config -> servers <-> kubelet; health monitor and node agent -> node state -> servers, labels,
    metrics."""

    def __init__(
        self,
        inventory: Inventory,
        options: DaemonOptions,
        client: NodeClient | None = None,
        pod_directory: PodDirectory | None = None,
        serving: Serving | None = None,
    ) -> None:
        """With `serving`, take over its (possibly started) manager and plan; else plan here with `client`."""
        self.inventory = inventory
        self.options = options
        serving = serving or plan_serving(inventory, options, lambda: client)
        if serving.profiles.client is None:
            serving.profiles.client = client  # the profile label follows reloads from now on
        self.node: NodeInfo = serving.node
        self.config: Config = serving.config
        self._config_data = serving.config_data
        self._label_refused = serving.profile is None and serving.profiles.current(serving.config) is not None
        self.cdi = CdiCheck(options.cdi_spec_dirs)
        self.cdi.on_config(self.config, serving.manager.resources)
        self.registry = CollectorRegistry()
        self.manager = serving.manager
        self.state: NodeState = self.manager.state  # the node's runtime state: health, quarantine, MPS pools, usage
        self.plugin_metrics = PluginMetrics(self.registry)
        self.plugin_metrics.on_config(self.config, self.manager.resources)
        self.manager.attach_metrics(self.plugin_metrics)
        profiles = serving.profiles
        self.serving = serving
        self.monitor: HealthMonitor = serving.monitor  # its first pass ran before the servers did (Serving.start)
        directory = pod_directory or client
        self.events = EventOutbox(client) if client else None  # the watchdog's Events, posted on a thread of their own
        self.agent = NodeAgent(
            inventory,
            self.node,
            self.state,
            lambda: self.manager.resources,  # the served resources, which follow reloads
            PodResourcesClient(options.pod_resources_socket),
            AgentSettings(options.agent.interval, options.agent.backoff_max, quarantine=self.config.quarantine),
            mapper=ProcessMapper(directory, options.proc_root) if directory else None,
            watchdog=MemoryWatchdog(self.config.watchdog_policy, events=self.events.post if self.events else None),
        )
        self.publisher = (
            PublishLoop(NodePublisher(client, self.config.domain, options.label_interval, self.config.shared_product_suffix, self.config.deprecated_cuda_labels), self.state, self.node, lambda: self.manager.resources, options.agent.interval)
            if client
            else None
        )
        # A reload reaches every part that follows the config, the manager first (see ConfigReloader).
        consumers: list[ConfigConsumer] = [self.manager, self.plugin_metrics, self.cdi, self.agent.watchdog, self.agent, self]
        if self.publisher is not None:
            consumers.append(self.publisher)
        self.reloader = ConfigReloader(options.config_file, self.node, profiles, options.reload_interval, consumers)
        sources = MetricSources(self.node, self.state, self.manager, self.agent, self.reloader, cdi_missing=lambda: self.cdi.missing, events=self.events)
        self.registry.register(StateCollector(sources))
        self.metrics_server = (
            MetricsServer(
                self.registry, self.manager.health, self.manager.readiness, options.metrics_port, options.metrics_host, node=options.node_name or self.node.name
            )
            if options.metrics_port
            else None
        )

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload: the device-node health check follows its deviceSpecs and deviceRoot."""
        self.config = config
        self.serving.device_nodes.config = config

    def start(self) -> None:
        if self.config.device_specs:
            missing = sorted({p for gpu in self.node.gpus for p in missing_device_nodes(self.config.device_root, gpu)})
            if missing:
                log.warning("deviceSpecs: device nodes not found: %s; the GPUs that need them are Unhealthy until they exist", ", ".join(missing))
        if self.metrics_server:
            self.metrics_server.start()
        if not self.manager.started:
            self.serving.start()
        self.monitor.start()
        self.reloader.start(self.config, self._config_data, self._label_refused)  # the config plan_serving already parsed
        if self.events:
            self.events.start()
        self.agent.start()
        if self.publisher:
            self.publisher.start()
        for resource in self.manager.resources:
            log.info("%s: %d devices on %d GPUs", resource.name, len(resource.devices), len(resource.gpus))

    def stop(self) -> None:
        if self.publisher:
            self.publisher.stop()
        self.agent.stop()
        if self.events:
            self.events.stop()
        self.reloader.stop()
        self.monitor.stop()
        self.manager.stop()
        if self.metrics_server:
            self.metrics_server.stop()
        self.inventory.close()

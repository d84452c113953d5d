"""The composition root of `gpu-share run`: every part of the plugin, wired and started in order.

Phase one (`serving.plan_serving`: plan, counters, manager, health monitor) is built first and may start on its own,
so the kubelet sees devices before the Kubernetes client loads; `PluginDaemon` builds phase two on it (the API
client's parts, the node agent, the exporter, hot reload) and never plans again. `build_daemon` does both at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

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
from ..loop import BackgroundLoop, Clock
from ..model.devices import Resource
from ..model.node import NodeInfo
from ..model.pods import PodDirectory
from ..obs.http import MetricsServer
from ..obs.metrics import MetricSources, StateCollector
from ..state import NodeState
from .options import DaemonOptions
from .plan import ConfigFile
from .reload import ConfigConsumer, ConfigReloader
from .serving import Serving, plan_serving

log = logging.getLogger(__name__)


class PluginDaemon:
    """Discovery -> config -> servers <-> kubelet; health monitor and node agent -> node state -> servers, labels,
    metrics."""

    def __init__(self, serving: Serving, client: NodeClient | None = None, pod_directory: PodDirectory | None = None) -> None:
        """Phase two on `serving` (started or not); `client`: the node's API (None: no labels, Events or profile
        label), `pod_directory` maps GPU processes to containers (default: `client`)."""
        plan, options = serving.plan, serving.options
        self.serving = serving
        self.inventory = serving.inventory
        self.options = options
        self.node: NodeInfo = plan.node
        self.config: Config = plan.config
        profiles = plan.profiles.reading(client)  # the profile label follows reloads from now on
        self._label_refused = plan.profile is None and profiles.current(plan.config) is not None
        self.cdi = CdiCheck(options.cdi_spec_dirs)
        self.cdi.on_config(self.config, serving.manager.resources)
        self.registry = serving.registry
        self.manager = serving.manager
        self.state: NodeState = self.manager.state  # the node's runtime state: health, quarantine, MPS pools, usage
        self.plugin_metrics = serving.metrics
        self.monitor: HealthMonitor = serving.monitor  # its first pass runs before the servers do (Serving.start)
        directory = pod_directory or client
        self.events = EventOutbox(client) if client else None  # the watchdog's Events, posted on a thread of their own
        self.agent = NodeAgent(
            self.inventory,
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
        self.reloader = ConfigReloader(options.config_file, self.node, profiles, options.reload_interval, consumers, serving.clock)
        sources = MetricSources(self.node, self.state, self.manager, self.agent, self.reloader, cdi_missing=lambda: self.cdi.missing, events=self.events)
        self.registry.register(StateCollector(sources))
        self.metrics_server = metrics_endpoint(options, self.registry, self.manager.health, self.manager.readiness, options.node_name or self.node.name)

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
        self.reloader.start(self.config, self.serving.plan.digest, self._label_refused)  # the config plan_serving already parsed
        if self.events:
            self.events.start()
        self.agent.start()
        if self.publisher:
            self.publisher.start()
        for resource in self.manager.resources:
            log.info("%s: %d devices on %d GPUs", resource.name, len(resource.devices), len(resource.gpus))

    def stop(self) -> None:
        """The reloader first (a round in progress may apply a config to the servers), then the servers: their
        sockets go and the kubelet marks the devices gone at once. The loops were all asked to end before, so their
        last rounds end side by side while the servers stop; each step's time is logged at debug level."""
        loops: list[BackgroundLoop] = [p for p in (self.publisher, self.agent, self.events, self.monitor) if p is not None]
        for loop in loops:
            loop.request_stop()
        steps: list[tuple[str, Callable[[], None]]] = [("config reloader", self.reloader.stop), ("device-plugin servers", self.manager.stop)]
        steps += [(loop.name, loop.stop) for loop in loops]
        if self.metrics_server:
            steps.append(("metrics endpoint", self.metrics_server.stop))
        steps.append(("inventory", self.inventory.close))
        for name, step in steps:
            started = time.perf_counter()
            step()
            log.debug("stop: %s in %.1f ms", name, (time.perf_counter() - started) * 1000)


def build_daemon(
    inventory: Inventory,
    options: DaemonOptions,
    client: NodeClient | None = None,
    pod_directory: PodDirectory | None = None,
    start: ConfigFile | None = None,
    clock: Clock = time.monotonic,
) -> PluginDaemon:
    """Both phases at once, not started (`start` serves, then starts the rest): the demo's and the tests' daemon.
    `gpu-share run` makes the same two calls with a start in between."""
    return PluginDaemon(plan_serving(inventory, options, lambda: client, start, clock), client, pod_directory)


def metrics_endpoint(
    options: DaemonOptions, registry: CollectorRegistry, healthz: Callable[[], tuple[bool, str]], readyz: Callable[[], tuple[bool, str]], node: str
) -> MetricsServer | None:
    """`/metrics` of `registry`, `/healthz` and `/readyz` on the options' port (None where the port is 0); not started."""
    if not options.metrics_port:
        return None
    return MetricsServer(registry, healthz, readyz, options.metrics_port, options.metrics_host, node=node)

"""The device plugin's front end of `gpu-share run`: PluginManager's servers on the node core (`runtime.core`).

Phase one (`serving.plan_serving`: the core's plan, NodeState and health monitor, the counters, the manager) is built
first and may start on its own, so the kubelet sees devices before the Kubernetes client loads; `PluginDaemon` builds
phase two on it (`NodeCore.operate`: the node agent, labels, Events, the exporter, hot reload, with this front end's
consumers and probes) and never plans again. `build_daemon` does both at once.
"""

from __future__ import annotations

import logging
import time

from ..alloc.cdi import CdiCheck
from ..config.types import Config
from ..discovery.inventory import Inventory
from ..kube.client import NodeClient
from ..loop import Clock
from ..model.node import NodeInfo
from ..model.pods import PodDirectory
from .core import NodeCore
from .options import DaemonOptions
from .plan import ConfigFile
from .serving import Serving, plan_serving

log = logging.getLogger(__name__)


class PluginDaemon:
    """Discovery -> config -> servers <-> kubelet; health monitor and node agent -> node state -> servers, labels,
    metrics. The core holds everything but the servers and the CDI check."""

    def __init__(
        self, serving: Serving, client: NodeClient | None = None, pod_directory: PodDirectory | None = None
    ) -> None:
        """Phase two on `serving` (started or not); `client`: the node's API (None: no labels, Events or profile
        label), `pod_directory` maps GPU processes to containers (default: `client`)."""
        core: NodeCore = serving.core
        self.serving = serving
        self.core = core
        self.inventory = core.inventory
        self.options: DaemonOptions = core.options
        self.node: NodeInfo = core.node
        self.cdi = CdiCheck(self.options.cdi_spec_dirs)
        self.cdi.on_config(self.config, serving.manager.resources)
        self.registry = core.registry
        self.manager = serving.manager
        self.state = core.state
        self.plugin_metrics = serving.metrics
        self.monitor = core.monitor  # its first pass runs before the servers do (Serving.start)
        # A reload reaches the manager first (see ConfigReloader), then the counters, the CDI check, the core's parts.
        core.operate(
            lambda: self.manager.resources,  # the served resources, which follow reloads
            [self.manager, self.plugin_metrics, self.cdi],
            (self.manager.health, self.manager.readiness),
            client,
            pod_directory,
            manager=self.manager,
            cdi_missing=lambda: self.cdi.missing,
        )
        assert core.agent is not None and core.reloader is not None
        self.agent, self.reloader = core.agent, core.reloader
        self.events, self.publisher, self.metrics_server = core.events, core.publisher, core.metrics_server

    @property
    def config(self) -> Config:
        """The config served now (it follows reloads)."""
        return self.core.config

    def start(self) -> None:
        self.core.start(self._serve)
        for resource in self.manager.resources:
            log.info("%s: %d devices on %d GPUs", resource.name, len(resource.devices), len(resource.gpus))

    def _serve(self) -> None:
        if not self.manager.started:  # `gpu-share run` served before the API client loaded
            self.serving.start()

    def stop(self) -> None:
        """The core's stop order, with the device-plugin servers as this front end's servers."""
        self.core.stop([("device-plugin servers", self.manager.stop)])


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

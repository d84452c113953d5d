"""Phase one of `gpu-share run`: discover, plan, a first health pass, and serve, so the kubelet sees devices before
anything else loads — and never a device before its health is known.

The node core's phase one (`core.NodeCore`: the plan, NodeState, the health monitor with its node checks) and the
plugin's counters (`PluginMetrics`: prometheus-client is cheap to import) exist from here on, so the manager counts
every registration as it happens. The Kubernetes client (about a second and 20 MiB to import), the metrics
exporter and the node agent come after registration (`daemon.PluginDaemon`, through `NodeCore.operate`). The API is
needed first only when a node label picks the profile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..agent.holds import ContainerHolds
from ..agent.usage import PodResourcesClient
from ..discovery.inventory import Inventory
from ..health import evidence
from ..kube.client import NodeClient
from ..loop import Clock
from ..obs.metrics import PluginMetrics
from ..plugin.manager import PluginManager
from .core import NodeCore
from .options import DaemonOptions
from .plan import ConfigFile, plan_node, read_config


@dataclass(frozen=True)
class Serving:
    """The node core's phase one and the device-plugin servers on it: built by `plan_serving`, started by `start`."""

    core: NodeCore
    metrics: PluginMetrics  # in the core's registry, fed by the manager's servers from their first registration
    manager: PluginManager  # serving plan.resources on the core's NodeState, not started

    def start(self) -> None:
        """The core's first health pass, then serve and register: the first list the kubelet gets already marks what
        is unhealthy, and no Allocate grants a device before that is known."""
        self.core.first_pass()
        self.manager.start()


def plan_serving(
    inventory: Inventory,
    options: DaemonOptions,
    connect: Callable[[], NodeClient | None],
    start: ConfigFile | None = None,
    clock: Clock = time.monotonic,
) -> Serving:
    """The node's plan (runtime.plan) from `start` (else options.config_file, read now), the core's phase one, the
    plugin's counters and a manager for its resources (not started); ConfigError on a bad config. `connect` is
    called only when the node label picks the profile."""
    start = start or read_config(options.config_file)
    plan = plan_node(inventory, start, options.profile, options.profile_label_interval, connect, clock)
    core = NodeCore(
        inventory, options, plan, options.plugin_dir / evidence.DEVICE_PLUGIN_DIR / evidence.FILE_NAME, clock
    )
    units = {g.uuid for g in plan.node.gpus} | {m.uuid for g in plan.node.gpus for m in g.mig_devices}
    holdings = ContainerHolds(PodResourcesClient(options.pod_resources_socket), options.plugin_dir, units.__contains__)
    metrics = PluginMetrics(core.registry)
    metrics.on_config(plan.config, plan.resources)
    manager = PluginManager(
        plan.resources,
        options.plugin_dir,
        options.timings,
        metrics=metrics,
        mps=core.mps,
        state=core.state,
        holdings=holdings,
    )
    return Serving(core, metrics, manager)

"""Phase one of `gpu-share run`: discover, plan, a first health pass, and serve, so the kubelet sees devices before
anything else loads — and never a device before its health is known.

The plugin's counters (`PluginMetrics`: prometheus-client is cheap to import) exist from here on, so the manager
counts every registration as it happens. The Kubernetes client (about a second and 20 MiB to import), the metrics
exporter and the node agent come after registration (`daemon.PluginDaemon`). The API is needed first only when a
node label picks the profile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from ..agent.holds import ContainerHolds
from ..agent.usage import PodResourcesClient
from ..alloc.devicenodes import missing_device_nodes, missing_mig_capabilities
from ..config.types import Config
from ..discovery.inventory import Inventory
from ..health import evidence
from ..health.monitor import HealthMonitor
from ..kube.client import NodeClient
from ..loop import Clock
from ..model.node import Gpu
from ..mps.control import MpsLiveness
from ..obs.metrics import PluginMetrics
from ..plugin.manager import PluginManager
from .options import DaemonOptions
from .plan import ConfigFile, Plan, plan_node, read_config


class DeviceNodeCheck:
    """With deviceSpecs, a GPU whose device nodes are missing on the host, or a MIG instance whose capability nodes
    are, cannot be handed out: Unhealthy (GPU or MIG UUID -> why). Follows reloads (`config` is replaced)."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def __call__(self, gpu: Gpu) -> dict[str, str]:
        config = self.config
        if not config.device_specs:
            return {}
        missing = missing_device_nodes(config.device_root, gpu)
        if missing:
            return {gpu.uuid: f"deviceSpecs: device node(s) missing under deviceRoot {config.device_root}: {', '.join(missing)}"}
        return {uuid: f"deviceSpecs: {why}" for uuid, why in missing_mig_capabilities(config.device_root, gpu).items()}


@dataclass(frozen=True)
class Serving:
    """A node's plan and what serves it: built by `plan_serving`, started by `start`."""

    plan: Plan
    inventory: Inventory
    options: DaemonOptions
    clock: Clock  # what the profile label's interval and the reloader read
    registry: CollectorRegistry  # every metric of the process; the exporter serves it later
    metrics: PluginMetrics  # in `registry`, fed by the manager's servers from their first registration
    manager: PluginManager  # serving plan.resources, not started
    monitor: HealthMonitor  # not started; its first pass runs in start()
    device_nodes: DeviceNodeCheck

    def start(self) -> None:
        """One health pass (NVML queries, device nodes, MIG capabilities), then serve and register: the first list
        the kubelet gets already marks what is unhealthy, and no Allocate grants a device before that is known."""
        self.monitor.first_pass()
        self.manager.start()


def plan_serving(
    inventory: Inventory,
    options: DaemonOptions,
    connect: Callable[[], NodeClient | None],
    start: ConfigFile | None = None,
    clock: Clock = time.monotonic,
) -> Serving:
    """The node's plan (runtime.plan) from `start` (else options.config_file, read now), the plugin's counters and a
    manager for its resources (not started); ConfigError on a bad config. `connect` is called only when the node
    label picks the profile."""
    start = start or read_config(options.config_file)
    plan = plan_node(inventory, start, options.profile, options.profile_label_interval, connect, clock)
    units = {g.uuid for g in plan.node.gpus} | {m.uuid for g in plan.node.gpus for m in g.mig_devices}
    holdings = ContainerHolds(PodResourcesClient(options.pod_resources_socket), options.plugin_dir, units.__contains__)
    registry = CollectorRegistry()
    metrics = PluginMetrics(registry)
    metrics.on_config(plan.config, plan.resources)
    manager = PluginManager(
        plan.resources, options.plugin_dir, options.timings, metrics=metrics, mps=MpsLiveness(options.mps_control), holdings=holdings
    )
    device_nodes = DeviceNodeCheck(plan.config)
    health = options.health.keeping_evidence_in(options.plugin_dir / evidence.DEVICE_PLUGIN_DIR / evidence.FILE_NAME)
    monitor = HealthMonitor(inventory, plan.node, manager.state, health, node_check=device_nodes)
    return Serving(plan, inventory, options, clock, registry, metrics, manager, monitor, device_nodes)

"""Phase one of `gpu-share run`: discover, plan, a first health pass, and serve, so the kubelet sees devices before
anything else loads — and never a device before its health is known.

The Kubernetes client (about a second and 20 MiB to import), the metrics exporter and the node agent come
after registration (`daemon.PluginDaemon`). The API is needed first only when a node label picks the profile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..agent.holds import ContainerHolds
from ..agent.usage import PodResourcesClient
from ..alloc.devicenodes import missing_device_nodes, missing_mig_capabilities
from ..config.types import Config
from ..discovery.inventory import Inventory
from ..health.monitor import HealthMonitor
from ..kube.client import NodeClient
from ..model.node import Gpu
from ..mps.control import MpsLiveness
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


@dataclass
class Serving(Plan):
    manager: PluginManager  # serving plan.resources, not started
    monitor: HealthMonitor  # not started; its first pass runs in start()
    device_nodes: DeviceNodeCheck

    def start(self) -> None:
        """One health pass (NVML queries, device nodes, MIG capabilities), then serve and register: the first list
        the kubelet gets already marks what is unhealthy, and no Allocate grants a device before that is known."""
        self.monitor.first_pass()
        self.manager.start()


def plan_serving(
    inventory: Inventory, options: DaemonOptions, connect: Callable[[], NodeClient | None], start: ConfigFile | None = None
) -> Serving:
    """The node's plan (runtime.plan) from `start` (else options.config_file, read now) and a manager for its
    resources (not started); ConfigError on a bad config."""
    start = start or read_config(options.config_file)
    plan = plan_node(inventory, start, options.profile, options.profile_label_interval, connect)
    units = {g.uuid for g in plan.node.gpus} | {m.uuid for g in plan.node.gpus for m in g.mig_devices}
    holdings = ContainerHolds(PodResourcesClient(options.pod_resources_socket), options.plugin_dir, units.__contains__)
    manager = PluginManager(plan.resources, options.plugin_dir, options.timings, mps=MpsLiveness(options.mps_control), holdings=holdings)
    device_nodes = DeviceNodeCheck(plan.config)
    monitor = HealthMonitor(inventory, plan.node, manager.state, options.health, node_check=device_nodes)
    return Serving(plan.node, plan.config, plan.profiles, plan.resources, plan.client, plan.config_data, plan.profile, manager, monitor, device_nodes)

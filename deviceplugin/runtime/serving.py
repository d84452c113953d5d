"""Phase one of `gpu-share run`: discover, plan and serve, so the kubelet sees devices before anything else loads.

The Kubernetes client (about a second and 20 MiB to import), the metrics exporter and the node agent come
after registration (`daemon.PluginDaemon`). The API is needed first only when a node label picks the profile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..agent.holds import ContainerHolds
from ..agent.usage import PodResourcesClient
from ..discovery.inventory import Inventory
from ..kube.client import NodeClient
from ..mps.control import MpsLiveness
from ..plugin.manager import PluginManager
from .options import DaemonOptions
from .plan import ConfigFile, Plan, plan_node, read_config


@dataclass
class Serving(Plan):
    manager: PluginManager  # serving plan.resources, not started


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
    return Serving(plan.node, plan.config, plan.profiles, plan.resources, plan.client, plan.config_data, manager)

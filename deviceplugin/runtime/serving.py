"""Phase one of `gpu-share run`: discover, plan and serve, so the kubelet sees devices before anything else loads.

The Kubernetes client (about a second and 20 MiB to import), the metrics exporter and the node agent come
after registration (`daemon.PluginDaemon`). The API is needed first only when a node label picks the profile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..config.types import Config, default_config
from ..config.parse import parse_config_bytes, read_config_bytes
from ..discovery.inventory import Inventory
from ..model.node import NodeInfo
from ..kube.client import NodeClient
from ..plugin.manager import PluginManager
from ..mps.control import MpsLiveness
from .options import DaemonOptions
from .reload import ProfileSource
from ..alloc.plan import build_resources

log = logging.getLogger(__name__)


@dataclass
class Serving:
    node: NodeInfo
    config: Config
    profiles: ProfileSource
    manager: PluginManager
    client: NodeClient | None
    config_data: bytes | None  # the file the config was parsed from: a change after it is reloaded, never missed


def plan_serving(inventory: Inventory, options: DaemonOptions, connect: Callable[[], NodeClient | None]) -> Serving:
    """The node, its config and profile, and a manager for its resources (not started); ConfigError on a bad config."""
    node = inventory.discover()
    data = read_config_bytes(options.config_file) if options.config_file else None
    config = parse_config_bytes(data, str(options.config_file)) if data is not None else default_config()
    label_decides = options.profile is None and len(config.profiles) > 1
    client = connect() if label_decides else None
    profiles = ProfileSource(options.profile, client, options.profile_label_interval)
    profile = profiles.current(config)
    resources = build_resources(config, node, profile)
    log.info("serving profile %s", profile or config.default_profile)
    manager = PluginManager(resources, options.plugin_dir, options.timings, mps=MpsLiveness(options.mps_control))
    return Serving(node, config, profiles, manager, client, data)


"""The start-up plan of `gpu-share run` and `gpu-share mps`: the node, its config and profile, the resources they yield."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..alloc.plan import build_resources
from ..config.parse import parse_config_bytes, read_config_bytes
from ..config.types import Config, ConfigError, default_config
from ..discovery.inventory import Inventory
from ..kube.client import NodeClient
from ..model.devices import Resource
from ..model.node import NodeInfo
from .reload import ProfileSource

log = logging.getLogger(__name__)


@dataclass
class Plan:
    node: NodeInfo
    config: Config
    profiles: ProfileSource
    resources: list[Resource]
    client: NodeClient | None  # connected only when the node label picks the profile
    config_data: bytes | None  # the file the config was parsed from: a change after it is reloaded, never missed
    profile: str | None  # the profile served (None: the default), which the label may not name


@dataclass(frozen=True)
class ConfigFile:
    config: Config
    data: bytes | None  # what `config` was parsed from; None: no file, the built-in default


def read_config(path: str | None) -> ConfigFile:
    """The config to start with: `path` read and parsed (ConfigError on any problem), else the built-in default."""
    if not path:
        return ConfigFile(default_config(), None)
    data = read_config_bytes(path)
    return ConfigFile(parse_config_bytes(data, path), data)


def plan_node(
    inventory: Inventory, start: ConfigFile, profile: str | None, label_interval: float, connect: Callable[[], NodeClient | None]
) -> Plan:
    """Discover the node, pick the profile (the flag, else the node label when the config has several, else the
    default) and build its resources; ConfigError when the profile does not work on the node. A profile the node
    label names that does not work (a typo, a pool the node cannot serve) is refused as a reload would refuse it:
    the default profile serves, and hot reload tries the label again (and says why it refuses it) until it changes."""
    node = inventory.discover()
    config = start.config
    label_decides = profile is None and len(config.profiles) > 1
    client = connect() if label_decides else None
    profiles = ProfileSource(profile, client, label_interval)
    chosen = profiles.current(config)
    try:
        resources = build_resources(config, node, chosen)
    except ConfigError as err:
        if not label_decides or not chosen:
            raise
        log.error("the node label asks for profile %s, which is refused: %s; serving the default profile %s", chosen, err, config.default_profile)
        chosen = None
        resources = build_resources(config, node, None)
    log.info("serving profile %s", chosen or config.default_profile)
    return Plan(node, config, profiles, resources, client, start.data, chosen)

"""The start-up plan of `gpu-share run` and `gpu-share mps`: the node, its config and profile, the resources they
yield; the config file as read (content and digest) and the profile source, which hot reload follows too."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from .. import defaults
from ..alloc.plan import build_resources
from ..config.parse import parse_config_bytes, read_config_bytes
from ..config.types import Config, ConfigError, default_config
from ..discovery.inventory import Inventory
from ..kube.client import NodeClient, profile_label
from ..loop import Clock
from ..model.devices import Resource
from ..model.node import NodeInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConfigContent:
    """The config file's bytes as read, or why they cannot be read; `digest` (SHA-256) tells contents apart."""

    digest: str
    data: bytes | ConfigError

    def parse(self, path: str) -> Config:
        """ConfigError when the file could not be read or does not parse."""
        if isinstance(self.data, ConfigError):
            raise self.data
        return parse_config_bytes(self.data, path)


def read_content(path: str) -> ConfigContent:
    """The file's bytes (bounded) and their digest; never raises for a file that cannot be read."""
    try:
        data = read_config_bytes(path)
    except ConfigError as err:
        return ConfigContent(_digest(str(err).encode()), err)
    return ConfigContent(_digest(data), data)


@dataclass(frozen=True)
class ConfigFile:
    config: Config
    digest: str  # of the content `config` was parsed from ("": no file, the built-in default)


def read_config(path: str | None) -> ConfigFile:
    """The config to start with: `path` read and parsed (ConfigError on any problem), else the built-in default."""
    if not path:
        return ConfigFile(default_config(), "")
    content = read_content(path)
    return ConfigFile(content.parse(path), content.digest)


class ProfileSource:
    """Which profile a node serves: --profile, else the node label, else the config's default.

    The label is read at most every `interval` seconds of `clock` (one GET per node: cheap for the API server even on
    large fleets), and an API error keeps the last value read, so a blip never moves a node to another profile.
    """

    def __init__(
        self,
        flag: str | None,
        client: NodeClient | None,
        interval: float = defaults.PROFILE_LABEL_INTERVAL,
        clock: Clock = time.monotonic,
    ) -> None:
        self.flag = flag
        self.client = client
        self.interval = interval
        self.clock = clock
        self._label: str | None = None
        self._read_at = float("-inf")

    def reading(self, client: NodeClient | None) -> ProfileSource:
        """This source, or, where it reads no label for want of a client, a new one reading it through `client`."""
        if self.flag or self.client is not None or client is None:
            return self
        return ProfileSource(self.flag, client, self.interval, self.clock)

    def current(self, config: Config) -> str | None:
        if self.flag or self.client is None:
            return self.flag
        if self.clock() - self._read_at >= self.interval:
            try:
                self._label = self.client.labels().get(profile_label(config.domain))
                self._read_at = self.clock()
            except Exception as err:  # API errors must not stop the plugin or flip its profile
                log.warning("cannot read the node's labels (%s); keeping profile %s", err, self._label or "(default)")
        return self._label


@dataclass(frozen=True)
class Plan:
    node: NodeInfo
    config: Config
    digest: str  # of the file `config` was parsed from: a change after it is reloaded, never missed
    profiles: ProfileSource  # reads the label only when it picked the profile (the API client was needed first)
    resources: list[Resource]
    profile: str | None  # the profile served (None: the default), which the label may not name
    dynamic_mig: bool = False  # built for a front end that serves `strategy: dynamic` MIG pools (the DRA driver)


def plan_node(
    inventory: Inventory,
    start: ConfigFile,
    profile: str | None,
    label_interval: float,
    connect: Callable[[], NodeClient | None],
    clock: Clock = time.monotonic,
    dynamic_mig: bool = False,
) -> Plan:
    """Discover the node, pick the profile (the flag, else the node label when the config has several, else the
    default) and build its resources; ConfigError when the profile does not work on the node. A profile the node
    label names that does not work (a typo, a pool the node cannot serve) is refused as a reload would refuse it:
    the default profile serves, and hot reload tries the label again (and says why it refuses it) until it changes."""
    node = inventory.discover()
    config = start.config
    label_decides = profile is None and len(config.profiles) > 1
    profiles = ProfileSource(profile, connect() if label_decides else None, label_interval, clock)
    chosen = profiles.current(config)
    try:
        resources = build_resources(config, node, chosen, dynamic_mig=dynamic_mig)
    except ConfigError as err:
        if not label_decides or not chosen:
            raise
        log.error(
            "the node label asks for profile %s, which is refused: %s; serving the default profile %s",
            chosen,
            err,
            config.default_profile,
        )
        chosen = None
        resources = build_resources(config, node, None, dynamic_mig=dynamic_mig)
    log.info("serving profile %s", chosen or config.default_profile)
    return Plan(node, config, start.digest, profiles, resources, chosen, dynamic_mig)


def _digest(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()

"""Hot reload: follow the config file (a mounted ConfigMap) and the node's profile label.

A valid change restarts only the resources whose devices or answers changed; an invalid one keeps the
last good config serving, and is logged and counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from .config import Config, ConfigError, default_config, load_config, parse_config_text
from .inventory import NodeInfo
from .kube import NodeClient, profile_label
from .loop import BackgroundLoop
from .manager import PluginManager
from .resources import Resource, build_resources

log = logging.getLogger(__name__)


class ProfileSource:
    """Which profile a node serves: --profile, else the node label, else the config's default.

    The label is read at most every `interval` seconds (one GET per node: cheap for the API server even on large
    fleets), and an API error keeps the last value read, so a blip never moves a node to another profile.
    """

    def __init__(self, flag: str | None, client: NodeClient | None, interval: float = 60.0) -> None:
        self.flag = flag
        self.client = client
        self.interval = interval
        self._label: str | None = None
        self._read_at = float("-inf")

    def current(self, config: Config) -> str | None:
        if self.flag or self.client is None:
            return self.flag
        if time.monotonic() - self._read_at >= self.interval:
            try:
                self._label = self.client.labels().get(profile_label(config.domain))
                self._read_at = time.monotonic()
            except Exception as err:  # API errors must not stop the plugin or flip its profile
                log.warning("cannot read the node's labels (%s); keeping profile %s", err, self._label or "(default)")
        return self._label


def load_plan(path: str | None, node: NodeInfo, profiles: ProfileSource) -> tuple[Config, str | None, list[Resource]]:
    """Config, chosen profile and resources for this node; ConfigError on any problem."""
    config = load_config(path) if path else default_config()
    profile = profiles.current(config)
    return config, profile, build_resources(config, node, profile)


class ConfigReloader(BackgroundLoop):
    def __init__(
        self,
        path: str | None,
        node: NodeInfo,
        manager: PluginManager,
        profiles: ProfileSource,
        interval: float,
        on_reload: Callable[[Config], None] | None = None,
    ) -> None:
        super().__init__("config-reload")
        self.path = path
        self.on_reload = on_reload
        self.node = node
        self.manager = manager
        self.profiles = profiles
        self.interval = interval
        self.reloads = 0
        self.errors = 0
        self._last: tuple[str, str | None] | None = None

    def start(self, config: Config, text: str | None = None) -> None:
        """Watch from `config`, parsed from `text` (read now when not given); a later difference is applied."""
        self._last = (self._read() if text is None else text, self.profiles.current(config))
        self._start_thread()

    def stop(self) -> None:
        self._stop_thread()

    def _read(self) -> str:
        if not self.path:
            return ""
        try:
            return Path(self.path).read_text()
        except OSError as err:
            return f"<unreadable: {err}>"

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def check(self) -> bool:
        """Reload if the file or the profile label changed; True when a new config was applied."""
        text = self._read()
        try:
            config = parse_config_text(text, self.path) if self.path else default_config()
        except ConfigError as err:
            return self._failed((text, self._last[1] if self._last else None), err)
        state = (text, self.profiles.current(config))
        if state == self._last:
            return False
        try:
            resources = build_resources(config, self.node, state[1])
        except ConfigError as err:
            return self._failed(state, err)
        self._last = state
        changes = self.manager.apply(resources)
        if self.on_reload:
            self.on_reload(config)
        self.reloads += 1
        log.info("config reloaded (profile %s): %s", state[1] or config.default_profile, "; ".join(changes) or "no resource changed")
        return True

    def _failed(self, state: tuple[str, str | None], err: ConfigError) -> bool:
        if state != self._last:
            self.errors += 1
            log.error("config change rejected, still serving the last good config: %s", err)
            self._last = state
        return False

"""Hot reload: follow the config file (a mounted ConfigMap) and the node's profile label.

A valid change is handed to every consumer (`ConfigConsumer.on_config`) in one fan-out: the plugin manager
restarts only the resources whose devices or answers changed, the others (label publisher, watchdog, quarantine,
CDI check, metrics, MPS supervisor) take the settings they follow. An invalid change keeps the last good config
serving, and is logged and counted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from typing import Protocol

from .. import defaults
from ..alloc.plan import build_resources
from ..config.parse import parse_config_bytes, read_config_bytes
from ..config.types import Config, ConfigError, default_config
from ..kube.client import NodeClient, profile_label
from ..logs import RepeatLimiter, safe_text
from ..loop import BackgroundLoop
from ..model.devices import Resource
from ..model.node import NodeInfo

log = logging.getLogger(__name__)


class ProfileSource:
    """Which profile a node serves: --profile, else the node label, else the config's default.

    The label is read at most every `interval` seconds (one GET per node: cheap for the API server even on large
    fleets), and an API error keeps the last value read, so a blip never moves a node to another profile.
    """

    def __init__(self, flag: str | None, client: NodeClient | None, interval: float = defaults.PROFILE_LABEL_INTERVAL) -> None:
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


class ConfigConsumer(Protocol):
    """A part of the process that follows config reloads."""

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """Serve or use this config and the resources it yields on the node from now on."""


class ConfigReloader(BackgroundLoop):
    """Follows the config file and the profile label; a round never raises, so the loop never dies.

    The file is read only when its resolved target's stat (device, inode, size, mtime, ctime) changed, and parsed
    only when its content (SHA-256) differs from the running one and has been the same for one interval, so a
    half-written file is not applied. A refused change is logged and counted once and not retried until the file
    or the label changes again; any other exception in a round is caught, logged with its cause (repeats summarised)
    and counted the same way. `in_sync` tells whether the running config is the file's current content.

    A new config goes to `consumers` in their order; the first that raises ends the round (a failed reload). Put
    the plugin manager first: it refuses a plan whose sockets cannot exist before anything changed, so a refused
    plan reaches no other consumer.
    """

    def __init__(
        self,
        path: str | None,
        node: NodeInfo,
        profiles: ProfileSource,
        interval: float,
        consumers: Sequence[ConfigConsumer],
    ) -> None:
        super().__init__("config-reload")
        self.path = path
        self.consumers = tuple(consumers)
        self.node = node
        self.profiles = profiles
        self.interval = interval
        self.reloads = 0
        self.errors = 0
        self.reads = 0  # times the file was read (its stat changed)
        self.parses = 0  # times new content was parsed (it differed from the running one and had settled)
        self.in_sync = True
        self._config = default_config()
        self._running: tuple[str, str | None] = ("", None)  # (content digest, profile) being served
        self._fingerprint: tuple | None = None
        self._digest = ""  # of the content last read
        self._data: bytes | ConfigError = b""  # the content last read, or why it cannot be read
        self._pending = ""  # the digest seen in the previous round
        self._refused_digest: str | None = None  # content that does not parse
        self._refused: tuple[str, str | None] | None = None  # (digest, profile) that failed to build or apply
        self._attempt: tuple[str, str | None] = self._running  # the state this round tries to serve
        self._failures = RepeatLimiter(log, window=max(60.0, interval))

    def start(self, config: Config, data: bytes | None = None, label_refused: bool = False) -> None:
        """Follow changes from now on. `config` is what the plugin serves, parsed from `data` (the file's bytes; the
        file as it is now when not given): content that differs from it, even if written meanwhile, is applied.
        `label_refused`: start-up served the default profile because the one the node label names was refused; the
        first round tries the label again and refuses it as any reload would (logged, counted, until it changes)."""
        self._config = config
        self._pending = self._observe()
        self._running = (self._pending if data is None else _digest(data), None if label_refused else self.profiles.current(config))
        self._start_thread()

    def stop(self) -> None:
        self._stop_thread()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def check(self) -> bool:
        """One round; True when a new config was applied. Never raises."""
        try:
            return self._round()
        except Exception as err:  # a bug or a failing apply must not end hot reload
            self.in_sync = False
            # Not retried until something changes: new content waits for the next change, a profile for the next label.
            if self._pending != self._running[0]:
                self._refused_digest = self._pending
            else:
                self._refused = self._attempt
            self._failures.log(logging.ERROR, (type(err), safe_text(str(err), 200)), "config reload failed, still serving the last good config: %s: %s", type(err).__name__, safe_text(str(err), 500))
            log.debug("config reload failure", exc_info=True)
            self.errors += 1
            return False
        finally:
            self._failures.flush()

    def _round(self) -> bool:
        self._attempt = self._running
        digest = self._observe()
        settled, self._pending = digest == self._pending, digest
        config, source = self._config, self._running[0]
        if digest != self._running[0] and settled and digest != self._refused_digest:
            try:
                config, source = self._parse(), digest
            except ConfigError as err:
                self._refuse(err)
                self._refused_digest = digest
                config, source = self._config, self._running[0]
        applied = self._follow(config, source) if settled or digest == self._running[0] else False
        self.in_sync = digest == self._running[0]
        return applied

    def _follow(self, config: Config, digest: str) -> bool:
        """Serve `config` with the node's current profile, unless that is what runs or was refused."""
        state = (digest, self.profiles.current(config))
        if state in (self._running, self._refused):
            return False
        self._attempt = state
        try:
            resources = build_resources(config, self.node, state[1])
        except ConfigError as err:
            self._refuse(err)
            self._refused = state
            return False
        for consumer in self.consumers:
            consumer.on_config(config, resources)
        self._config, self._running = config, state
        self.reloads += 1
        log.info("config reloaded (profile %s)", state[1] or config.default_profile)
        return True

    def _observe(self) -> str:
        """The digest of the file's content, read again only when its resolved target's stat changed."""
        if not self.path:
            return ""
        try:
            info = os.stat(self.path)
            fingerprint: tuple = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        except OSError as err:
            fingerprint = ("unreadable", err.errno)
        if fingerprint != self._fingerprint:
            self._fingerprint = fingerprint
            self.reads += 1
            try:
                self._data = read_config_bytes(self.path)
            except ConfigError as err:
                self._data = err
            self._digest = _digest(self._data if isinstance(self._data, bytes) else str(self._data).encode())
        return self._digest

    def _parse(self) -> Config:
        self.parses += 1
        if not self.path:
            return default_config()
        if isinstance(self._data, ConfigError):
            raise self._data
        return parse_config_bytes(self._data, self.path)

    def _refuse(self, err: ConfigError) -> None:
        log.error("config change rejected, still serving the last good config: %s", err)
        self.errors += 1


def _digest(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()

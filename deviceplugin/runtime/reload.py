"""Hot reload: follow the config file (a mounted ConfigMap) and the node's profile label.

A valid change is handed to every consumer (`ConfigConsumer.on_config`) in one fan-out: the plugin manager
restarts only the resources whose devices or answers changed, the others (label publisher, watchdog, quarantine,
CDI check, metrics, MPS supervisor) take the settings they follow. An invalid change keeps the last good config
serving, and is logged and counted.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..alloc.plan import build_resources
from ..config.types import Config, ConfigError, default_config
from ..logs import RepeatLimiter, safe_text
from ..loop import BackgroundLoop, Clock
from ..model.devices import Resource
from ..model.node import NodeInfo
from .plan import ConfigContent, ProfileSource, read_content

log = logging.getLogger(__name__)


class ConfigConsumer(Protocol):
    """A part of the process that follows config reloads."""

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """Serve or use this config and the resources it yields on the node from now on."""


Served = tuple[str, str | None]  # (content digest, profile)


@dataclass(frozen=True)
class FileRead:
    """The config file as a round last read it: its resolved target's stat, and what it held then."""

    stat: tuple
    content: ConfigContent


@dataclass(frozen=True)
class ReloadState:
    """What the reloader knows between rounds; each round replaces it, none changes it in place."""

    config: Config  # serving
    served: Served
    file: FileRead | None = None  # None: no config file
    seen: str = ""  # the digest the last round read: content is parsed once two rounds in a row read it (settled)
    refused_content: str | None = None  # does not parse, or failed to apply: not tried again until the file changes
    refused: Served | None = None  # failed to build or apply: not tried again until the file or the label changes


class ConfigReloader(BackgroundLoop):
    """Follows the config file and the profile label; a round never raises, so the loop never dies.

    The file is read only when its resolved target's stat (device, inode, size, mtime, ctime) changed, and parsed
    only when its content (SHA-256) differs from the running one and has been the same for one interval, so a
    half-written file is not applied. A refused change is logged and counted once and not retried until the file
    or the label changes again; any other exception in a round is caught, logged with its cause (repeats summarised
    per minute of `clock`) and counted the same way. `in_sync` tells whether the running config is the file's
    current content.

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
        clock: Clock = time.monotonic,
        dynamic_mig: bool = False,
    ) -> None:
        """`dynamic_mig`: the consumers serve `strategy: dynamic` MIG pools (the DRA driver)."""
        super().__init__("config-reload")
        self.dynamic_mig = dynamic_mig
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
        self._state = ReloadState(default_config(), ("", None))
        self._failures = RepeatLimiter(log, window=max(60.0, interval), clock=clock)

    def start(self, config: Config, digest: str | None = None, label_refused: bool = False) -> None:
        """Follow changes from now on. `config` is what the plugin serves, parsed from content of `digest` (the file
        as it is now when not given): content that differs from it, even if written meanwhile, is applied.
        `label_refused`: start-up served the default profile because the one the node label names was refused; the
        first round tries the label again and refuses it as any reload would (logged, counted, until it changes)."""
        file = self._read(None)
        seen = file.content.digest if file else ""
        served = (seen if digest is None else digest, None if label_refused else self.profiles.current(config))
        self._state = ReloadState(config, served, file, seen)
        self._start_thread()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def check(self) -> bool:
        """One round; True when a new config was applied. Never raises."""
        last = now = self._state
        attempt = last.served  # what this round tries to serve
        try:
            file = self._read(last.file)
            digest = file.content.digest if file else ""
            settled = digest == last.seen
            now = dataclasses.replace(now, file=file, seen=digest)
            config, source = last.config, last.served[0]
            if digest != source and settled and digest != last.refused_content:
                try:
                    config, source = self._parse(file), digest
                except ConfigError as err:
                    self._refuse(err)
                    now = dataclasses.replace(now, refused_content=digest)
            applied = False
            if settled or digest == last.served[0]:
                attempt = (source, self.profiles.current(config))
                if attempt not in (last.served, now.refused):
                    applied, now = self._apply(now, config, attempt)
            self.in_sync = digest == now.served[0]
            return applied
        except Exception as err:  # a bug or a failing apply must not end hot reload
            self.in_sync = False
            # Not retried until something changes: new content waits for the next change, a profile for the next label.
            if now.seen != now.served[0]:
                now = dataclasses.replace(now, refused_content=now.seen)
            else:
                now = dataclasses.replace(now, refused=attempt)
            self._failures.log(
                logging.ERROR,
                (type(err), safe_text(str(err), 200)),
                "config reload failed, still serving the last good config: %s: %s",
                type(err).__name__,
                safe_text(str(err), 500),
            )
            log.debug("config reload failure", exc_info=True)
            self.errors += 1
            return False
        finally:
            self._state = now
            self._failures.flush()

    def _apply(self, state: ReloadState, config: Config, served: Served) -> tuple[bool, ReloadState]:
        """Serve `config` with profile `served[1]`: built, then handed to every consumer (one that raises, raises)."""
        try:
            resources = build_resources(config, self.node, served[1], dynamic_mig=self.dynamic_mig)
        except ConfigError as err:
            self._refuse(err)
            return False, dataclasses.replace(state, refused=served)
        for consumer in self.consumers:
            consumer.on_config(config, resources)
        self.reloads += 1
        log.info("config reloaded (profile %s)", served[1] or config.default_profile)
        return True, dataclasses.replace(state, config=config, served=served)

    def _read(self, last: FileRead | None) -> FileRead | None:
        """The file, read again only when its resolved target's stat differs from `last`'s."""
        if not self.path:
            return None
        try:
            info = os.stat(self.path)
            stat: tuple = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        except OSError as err:
            stat = ("unreadable", err.errno)
        if last is not None and last.stat == stat:
            return last
        self.reads += 1
        return FileRead(stat, read_content(self.path))

    def _parse(self, file: FileRead | None) -> Config:
        self.parses += 1
        if file is None or not self.path:
            return default_config()
        return file.content.parse(self.path)

    def _refuse(self, err: ConfigError) -> None:
        log.error("config change rejected, still serving the last good config: %s", err)
        self.errors += 1

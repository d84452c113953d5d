"""Held GPUs keep their shape on the DRA path: a config reload is handed to the kubelet plugin and the slice
publisher through `HeldShapes`, which applies it (alloc.pending.reconcile) to every GPU no prepared claim holds and
keeps a held GPU as it was: the driver prepares against, and the slice publishes, its old devices (shares, memory
per share, mode) until the last claim on it is unprepared (`check`, after each unprepare round), then it switches.
Prepared claims are written to the NodeState as holds (source "dra")."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from ..alloc.shapeguard import ShapeGuard
from ..config.types import Config
from ..model.devices import Resource
from ..model.usage import Hold
from ..state import NodeState
from .prepare import Driver

log = logging.getLogger(__name__)

SOURCE = "dra"


class ConfigConsumer(Protocol):  # runtime.reload's, which this layer does not import
    def on_config(self, config: Config, resources: list[Resource]) -> None: ...


class HeldShapes:
    """A ConfigConsumer in front of `consumers`. `served` starts as the start-up plan: a restart does not know the
    shape a claim was prepared in, so it is the one the config gives (the prepare ledger still refuses by memory)."""

    def __init__(
        self,
        driver: Driver,
        state: NodeState,
        consumers: Sequence[ConfigConsumer],
        config: Config,
        resources: list[Resource],
    ) -> None:
        self.driver, self.state, self.consumers = driver, state, list(consumers)
        self.config, self.wanted, self.served = config, list(resources), list(resources)
        self.guard = ShapeGuard()  # the core's, shared with the device plugin
        self._lock = threading.Lock()

    def holds(self) -> frozenset[Hold]:
        """What prepared claims hold, as holds on the units of the devices served now. A record that could not be
        read (`Checkpoint.damaged`) holds every unit in an unknown shape: fail closed, no GPU changes shape."""
        by_name = {d.name: d for d in self.driver.devices}
        if self.driver.checkpoint.damaged:
            damaged = ", ".join(sorted(self.driver.checkpoint.damaged)[:3])
            return frozenset(
                Hold(d.resource.name, d.unit.uuid, None, f"damaged claim record(s) {damaged}") for d in by_name.values()
            )
        return frozenset(
            Hold(d.resource.name, d.unit.uuid, d.unit.replicas, f"claim {c.namespace}/{c.name}")
            for c in self.driver.prepared()
            for p in c.devices
            if (d := by_name.get(p.device)) is not None
        )

    def add_consumer(self, consumer: ConfigConsumer) -> list[Resource]:
        """Follow `consumer` too from now on; the resources served now, for its first config."""
        with self._lock:
            self.consumers.append(consumer)
            return list(self.served)

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        with self._lock:
            self.config, self.wanted = config, list(resources)
            self._apply()

    def check(self) -> None:
        """Switch the held GPUs whose claims are all gone (cheap when none waits)."""
        with self._lock:
            if self.guard.pending:
                self._apply()

    def _apply(self) -> None:
        holds = self.holds()
        self.state.set_holds(SOURCE, holds)
        self.served = self.guard.apply(self.served, self.wanted, holds)
        self.state.set_pending(self.guard.described())
        for consumer in self.consumers:
            consumer.on_config(self.config, self.served)

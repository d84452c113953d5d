"""GPU health: critical XIDs, lost GPUs and failing queries make devices Unhealthy; a quiet period heals them.

Unlike a plugin that marks one replica per XID and never recovers, an event marks the GPU (or the one MIG
instance it names) and so every share and MIG instance on it; after `recovery_period` seconds with passing
queries and no new critical event, its devices are Healthy again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from .inventory import HealthEvent, Inventory, NodeInfo
from .loop import BackgroundLoop

log = logging.getLogger(__name__)

# Application errors (illegal address, page fault, graphics exception, ...): the process is at fault, not the GPU.
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})


@dataclass(frozen=True)
class HealthSettings:
    enabled: bool = True
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    recovery_period: float = 300.0  # seconds of quiet before devices are Healthy again
    check_interval: float = 1.0  # seconds between query checks; also the longest event wait


class HealthMonitor(BackgroundLoop):
    """Follows the backend's health events and checks; publishes the set of unhealthy GPU/MIG UUIDs."""

    def __init__(
        self,
        inventory: Inventory,
        node: NodeInfo,
        publish: Callable[[frozenset[str]], None],
        settings: HealthSettings = HealthSettings(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__("health")
        self.inventory = inventory
        self.node = node
        self.publish = publish
        self.settings = settings
        self.clock = clock
        self.xid_counts: dict[str, int] = {g.uuid: 0 for g in node.gpus}
        self._last_bad: dict[str, float] = {}  # unhealthy uuid -> when it last misbehaved
        self._reasons: dict[str, str] = {}

    @property
    def unhealthy(self) -> dict[str, str]:
        """Unhealthy GPU or MIG UUID -> the reason."""
        return dict(self._reasons)

    def start(self) -> None:
        if not self.settings.enabled:
            log.warning("health checks are disabled: failed GPUs stay advertised as Healthy")
            return
        self._start_thread()

    def stop(self) -> None:
        self._stop_thread()

    def _run(self) -> None:
        next_check = 0.0
        while not self._stop.is_set():
            try:
                event = self.inventory.wait_for_event(self.settings.check_interval)
            except Exception as err:  # a backend failure must never end health monitoring
                log.error("health event wait failed: %s", err)
                self._stop.wait(self.settings.check_interval)
                event = None
            changed = self.handle(event) if event else False
            now = self.clock()
            if now >= next_check:
                changed |= self._check_all(now)
                next_check = now + self.settings.check_interval
            if changed:
                self.publish(frozenset(self._reasons))

    def handle(self, event: HealthEvent) -> bool:
        """Apply one event; True when the unhealthy set changed."""
        if event.xid is not None:
            if event.xid in self.settings.ignored_xids:
                log.info("ignoring application XID %d on GPU %s", event.xid, event.gpu_uuid)
                return False
            self.xid_counts[event.gpu_uuid] = self.xid_counts.get(event.gpu_uuid, 0) + 1
        target = event.mig_uuid or event.gpu_uuid
        return self._mark(target, event.reason, self.clock())

    def _check_all(self, now: float) -> bool:
        changed = False
        for gpu in self.node.gpus:
            try:
                problem = self.inventory.check(gpu.uuid)
            except Exception as err:  # a check that raises counts as a failing query
                problem = f"health check raised {err}"
            if problem:
                changed |= self._mark(gpu.uuid, problem, now)
        for uuid, last in list(self._last_bad.items()):
            if now - last >= self.settings.recovery_period:
                del self._last_bad[uuid]
                log.info("%s is healthy again after %.0fs without errors (was: %s)", uuid, now - last, self._reasons.pop(uuid))
                changed = True
        return changed

    def _mark(self, uuid: str, reason: str, now: float) -> bool:
        new = uuid not in self._reasons
        self._last_bad[uuid] = now
        self._reasons[uuid] = reason
        if new:
            log.warning("marking %s and every device on it Unhealthy: %s", uuid, reason)
        return new

"""Node labels and the inventory annotation, kept in step with the NodeState on a thread of their own.

A change of what it publishes (unhealthy GPUs, quarantine, MPS daemons, the agent's usage) wakes the loop at once;
other changes
of the node state (an XID count, the agent's timestamps) do not. It also goes round every `interval` (a patch the
debounce held back); a config reload wakes it too. A Kubernetes API call that hangs delays
only this loop: the agent's watchdog and the servers never wait for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..config.types import Config
from ..kube.labels import InventoryAnnotation, NodePublisher
from ..loop import BackgroundLoop
from ..model.devices import Resource
from ..model.node import NodeInfo
from ..state import QUARANTINED, NodeState, NodeView

log = logging.getLogger(__name__)


class PublishLoop(BackgroundLoop):
    def __init__(
        self,
        publisher: NodePublisher,
        state: NodeState,
        node: NodeInfo,
        resources: Callable[[], list[Resource]],
        interval: float,
    ) -> None:
        super().__init__("node-publisher")
        self.publisher = publisher
        self.state = state
        self.node = node
        self.resources = resources
        self.interval = interval
        self.annotation = InventoryAnnotation()
        self._unsubscribe: Callable[[], None] | None = None
        self._woken_for: tuple | None = None  # what the last wake-up was for

    def start(self) -> None:
        self._unsubscribe = self.state.subscribe(self._changed)
        self._start_thread()

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._stop_thread()

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload (runtime.reload): the publisher takes its domain and product suffix, published at once."""
        self.publisher.on_config(config, resources)
        self.nudge()

    def _changed(self, view: NodeView) -> None:
        """A NodeState subscriber: wake the loop when what it publishes changed."""
        usage = view.observation.usage if view.observation else None
        published = (view.unhealthy, view.pending_gpus, view.quarantined_gpus, view.mps_not_ready, usage)
        if published != self._woken_for:
            self._woken_for = published
            self.nudge()

    def _run(self) -> None:
        self._repeat(self._round, self.interval)

    def _round(self) -> float:
        self.publish_now()
        return self.interval

    def publish_now(self) -> bool:
        """Patch the Node with the current labels and annotation; False when nothing was patched (nothing changed,
        the debounce, an API error) or nothing is known yet (before the agent's first round)."""
        view = self.state.snapshot()
        if view.observation is None:
            return False
        resources = self.resources()
        unhealthy = published_unhealthy(view, resources)
        annotation = self.annotation.build(
            self.node, resources, view.observation.usage, unhealthy, view.quarantined_gpus
        )
        return self.publisher.publish_node(self.node, resources, annotation)


def published_unhealthy(view: NodeView, resources: list[Resource]) -> frozenset[str]:
    """The GPU and unit UUIDs the labels and the annotation show Unhealthy, mapped from each unit's verdict
    (`NodeView.verdict`): a fault, a down MPS control daemon or a shape that waits; quarantine is its own value."""
    shown = set(view.unhealthy) | set(view.pending_gpus)
    for resource in resources:
        for unit in resource.units:
            if set(view.verdict(unit, resource.pool).kinds()) - {QUARANTINED}:
                shown.add(unit.uuid)
    return frozenset(shown)

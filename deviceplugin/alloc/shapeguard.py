"""The core's shape guard, one for both front ends: a new plan reaches only the GPUs nothing holds (alloc.pending).

`ShapeGuard` keeps the GPUs pending across reconciles, counts how often a GPU had to wait (`deferred`) and how often
the holds could not be read (`unreadable_holds`), and logs each GPU that starts waiting or is released. The device
plugin's `PluginManager` and the DRA driver's `dra.shapes.HeldShapes` each read their own holds (pod-resources and
Allocate's recent grants; prepared claims) and hand them here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..logs import safe_text
from ..model.devices import Resource
from ..model.usage import Hold
from .pending import PendingGpu, changing_gpus, reconcile

log = logging.getLogger(__name__)

SWITCHING = "switching to a new configuration"


class ShapeGuard:
    """Held GPUs keep their shape: `apply` gives the resources to serve, `pending` the GPUs kept as they were."""

    def __init__(self) -> None:
        self.pending: dict[str, PendingGpu] = {}  # GPU UUID -> kept in its old shape until released
        self.deferred = 0  # GPUs whose new shape had to wait for their holders (each time one starts waiting)
        self.unreadable_holds = 0  # reads of the holds that failed (nothing changed shape after them)

    def fence(self, served: list[Resource], wanted: list[Resource]) -> dict[str, str] | None:
        """GPU UUID -> why it takes no new work while the holds are read: the served GPUs about to change and the
        pending ones. None when no GPU changes and none waits (serve `wanted` as it is)."""
        changing = changing_gpus(served, wanted, self.pending)
        if not changing and not self.pending:
            return None
        served_gpus = {g.uuid for r in served for g in r.gpus}
        return {**{u: SWITCHING for u in changing & served_gpus}, **self.described()}

    def unreadable(self, err: Exception, retry_in: float) -> None:
        """The holds could not be read: nothing changes shape; counted and logged."""
        self.unreadable_holds += 1
        log.error(
            "cannot read what holds the GPUs (%s): the GPUs about to change keep their devices; trying again in %.1fs",
            safe_text(str(err), 300),
            retry_in,
        )

    def apply(self, served: list[Resource], wanted: list[Resource], holds: Iterable[Hold]) -> list[Resource]:
        """The resources to serve: `wanted`, with every held GPU whose shape would change kept as it is."""
        result = reconcile(served, wanted, holds, self.pending)
        for uuid, waiting in result.pending.items():
            if uuid not in self.pending:
                self.deferred += 1
                log.warning("%s", waiting.describe())
        for uuid, waited in self.pending.items():
            if uuid not in result.pending:
                released = ", ".join(waited.wanted) or "no resource"
                log.info("GPU %d (%s) is released: it switches to %s", waited.index, uuid, released)
        self.pending = result.pending
        return result.resources

    def described(self) -> dict[str, str]:
        """GPU UUID -> one line saying why it waits (for NodeState.set_pending)."""
        return {uuid: waiting.describe() for uuid, waiting in self.pending.items()}

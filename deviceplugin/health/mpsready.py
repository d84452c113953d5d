"""MPS pools' readiness, for both node APIs: whether each MPS pool's control daemon (`gpu-share mps`) answers,
written into NodeState (`mps_not_ready`), where the device plugin's servers and Allocate, the DRA health stream,
the slice taints and prepare read it.

Every MPS pool starts not ready (no container or claim may get a pool whose daemon never came up) and is asked
with `MpsLiveness` (the ready marker, then an answer on the control pipe, asked off the caller's thread) on every
`check`. The DRA driver runs it as a loop of its own (`start`); the device plugin's manager calls `check` from its
kubelet watch and serves a pool's resource once `ready` says so.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..loop import BackgroundLoop
from ..model.devices import Resource
from ..mps.control import MpsLiveness
from ..mps.paths import MpsPaths
from ..state import NodeState

if TYPE_CHECKING:
    from ..config.types import Config

log = logging.getLogger(__name__)


class MpsReadiness(BackgroundLoop):
    def __init__(self, state: NodeState, liveness: MpsLiveness, resources: list[Resource], interval: float) -> None:
        super().__init__("mps-ready")
        self.state = state
        self.liveness = liveness
        self.interval = interval
        self._pools: dict[str, MpsPaths] = {}
        self.on_config(None, resources)

    def on_config(self, config: Config | None, resources: list[Resource]) -> None:
        """Follow the MPS pools of these resources (a pool no longer MPS, or gone, is no longer held back; a new one
        is not ready until its daemon answers)."""
        pools = {r.pool.name: MpsPaths.of(r.settings.mps_root, r.pool.name) for r in resources if r.pool.mps}
        for name in set(self._pools) - set(pools):
            self.state.set_mps_ready(name, True)
        for name in set(pools) - set(self._pools):
            self.state.set_mps_ready(name, False)
        self._pools = pools
        self.nudge()

    def paths(self, pool: str) -> MpsPaths | None:
        return self._pools.get(pool)

    def ready(self, pool: str) -> bool:
        """The pool's daemon answered at the last check (a pool that is not MPS is always ready)."""
        return pool not in self.state.snapshot().mps_not_ready

    def first_check(self) -> None:
        """Ask every MPS pool whose ready marker exists and wait for the answers (each within the liveness timeout):
        the first prepare or Allocate after start meets the daemon's answer, not "not asked yet"."""
        for paths in list(self._pools.values()):
            if paths.ready.exists():
                self.liveness.probe(paths)
        self.check()

    def start(self) -> None:
        self._start_thread()

    def _run(self) -> None:
        self._repeat(self.check, self.interval)

    def check(self) -> float:
        """Ask every MPS pool once and write what changed; the seconds to the next round."""
        not_ready = self.state.snapshot().mps_not_ready
        for name, paths in list(self._pools.items()):
            ready = self.liveness.ready(paths)
            if ready and name in not_ready:
                log.info("MPS control daemon of pool %s is ready", name)
            elif not ready and name not in not_ready:
                log.warning("MPS control daemon of pool %s is down: devices Unhealthy", name)
            self.state.set_mps_ready(name, ready)
        return self.interval

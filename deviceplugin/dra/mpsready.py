"""MPS pools' readiness for the DRA driver: whether each MPS pool's control daemon (`gpu-share mps`) answers,
written into NodeState, where the health stream, the slice taints and prepare read it.

The device plugin's manager does the same for its servers; here nothing else would. Every MPS pool starts not
ready (a claim must not get a pool whose daemon never came up) and is checked every `interval` seconds with
`MpsLiveness` (the ready marker, then an answer on the control pipe, asked off this thread).
"""

from __future__ import annotations

from ..config.types import Config
from ..loop import BackgroundLoop
from ..model.devices import Resource
from ..mps.control import MpsLiveness
from ..mps.paths import MpsPaths
from ..state import NodeState


class MpsReadiness(BackgroundLoop):
    def __init__(self, state: NodeState, liveness: MpsLiveness, resources: list[Resource], interval: float) -> None:
        super().__init__("dra-mps-ready")
        self.state = state
        self.liveness = liveness
        self.interval = interval
        self._pools: dict[str, MpsPaths] = {}
        self.on_config(None, resources)

    def on_config(self, config: Config | None, resources: list[Resource]) -> None:
        """A reload: follow the MPS pools it yields (a pool no longer MPS, or gone, is no longer held back)."""
        pools = {r.pool.name: MpsPaths.of(r.settings.mps_root, r.pool.name) for r in resources if r.pool.mps}
        for name in set(self._pools) - set(pools):
            self.state.set_mps_ready(name, True)
        for name in set(pools) - set(self._pools):
            self.state.set_mps_ready(name, False)
        self._pools = pools
        self.nudge()

    def start(self) -> None:
        self._start_thread()

    def _run(self) -> None:
        self._repeat(self.check, self.interval)

    def check(self) -> float:
        """One round; the seconds to the next."""
        for name, paths in list(self._pools.items()):
            self.state.set_mps_ready(name, self.liveness.ready(paths))
        return self.interval

"""The device plugin's side of MPS readiness: a resource of an MPS pool is served only once the pool's control daemon
is ready (`health.mpsready`, shared with the DRA driver), and its server waits, unserved, until then. The manager asks
at every kubelet watch round (`check`) and starts the servers it hands back.
"""

from __future__ import annotations

from ..health.mpsready import MpsReadiness
from ..model.devices import Resource
from ..mps.control import MpsLiveness
from ..state import NodeState
from .server import DevicePluginServer


class MpsGate:
    """Which servers wait for their MPS pool's control daemon."""

    def __init__(self, state: NodeState, liveness: MpsLiveness, resources: list[Resource], interval: float) -> None:
        self.readiness = MpsReadiness(state, liveness, resources, interval)

    def on_config(self, resources: list[Resource]) -> None:
        """Follow the MPS pools of the resources served now (a new pool waits for its daemon)."""
        self.readiness.on_config(None, resources)

    def first_check(self) -> None:
        """Before the first servers start: each MPS pool's daemon answers or not (`MpsReadiness.first_check`), so
        a pool whose daemon is up is served at once rather than a kubelet watch round later."""
        self.readiness.first_check()

    def waits(self, server: DevicePluginServer) -> bool:
        """The server's pool is MPS and its control daemon is not ready: it is not to be served yet."""
        pool = server.resource.pool
        return pool.mps and not self.readiness.ready(pool.name)

    def waiting_for(self, server: DevicePluginServer) -> str | None:
        """What the server waits for (`MPS pool <name> (<root>)`, for the manager's log); None when it does not."""
        if not self.waits(server):
            return None
        pool = server.resource.pool
        paths = self.readiness.paths(pool.name)
        return f"MPS pool {pool.name} ({paths.root if paths else '?'})"

    def check(self, servers: list[DevicePluginServer]) -> list[DevicePluginServer]:
        """Ask every MPS pool's daemon once (its readiness goes to the NodeState); the servers of MPS pools not
        serving whose daemon is ready now, to be started."""
        self.readiness.check()
        ready = self.readiness.ready
        return [s for s in servers if s.resource.pool.mps and not s.serving and ready(s.resource.pool.name)]

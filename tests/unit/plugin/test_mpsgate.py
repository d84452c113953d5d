"""plugin.mpsgate: a server of an MPS pool waits, unserved, until its control daemon answers; a pool that is not MPS
never waits; each check hands back the waiting servers whose daemon is ready now. (The flow, with a real control
daemon and kubelet, is in tests/test_modes.py.)"""

from __future__ import annotations

from pathlib import Path

from deviceplugin.mps.paths import MpsPaths
from deviceplugin.plugin.mpsgate import MpsGate
from deviceplugin.plugin.registration import RegistrationChannel
from deviceplugin.plugin.server import DevicePluginServer
from deviceplugin.state import NodeState
from tests.conftest import node
from tests.support.resources import resources_of

POOLS = [
    {"name": "a", "mode": "shared", "backend": "mps", "replicas": 2, "gpus": {"indexes": [0]}, "resource": "x.io/a"},
    {"name": "t", "mode": "shared", "replicas": 2, "gpus": {"indexes": [1]}, "resource": "x.io/t"},
]


class Liveness:
    """What MpsLiveness would answer, per pool directory name."""

    def __init__(self) -> None:
        self.answering: set[str] = set()

    def ready(self, paths: MpsPaths) -> bool:
        return paths.root.name in self.answering


def _gate(tmp_path: Path) -> tuple[MpsGate, Liveness, NodeState, list[DevicePluginServer]]:
    resources = resources_of({"version": "v1", "mpsRoot": str(tmp_path / "mps"), "pools": POOLS}, node("2xT4"))
    state, liveness = NodeState(), Liveness()
    channel = RegistrationChannel(tmp_path / "kubelet.sock")  # never opened: nothing here is served
    servers = [DevicePluginServer(r, tmp_path, state=state, kubelet_channel=channel) for r in resources]
    return MpsGate(state, liveness, resources, interval=1.0), liveness, state, servers  # type: ignore[arg-type]


def test_an_mps_pools_server_waits_for_its_daemon_and_is_handed_back_once_it_answers(tmp_path: Path) -> None:
    gate, liveness, state, (mps, plain) = _gate(tmp_path)
    assert gate.waits(mps) and not gate.waits(plain)
    assert gate.waiting_for(mps) == f"MPS pool a ({tmp_path / 'mps' / 'a'})" and gate.waiting_for(plain) is None
    assert gate.check([mps, plain]) == [] and state.snapshot().mps_not_ready == {"a"}
    liveness.answering = {"a"}
    assert gate.check([mps, plain]) == [mps]  # the plain pool's server is the manager's to serve, never held here
    assert not gate.waits(mps) and state.snapshot().mps_not_ready == frozenset()
    liveness.answering = set()
    assert gate.check([mps, plain]) == [] and gate.waits(mps)  # down again: its devices Unhealthy, it waits


def test_a_reload_follows_the_pools_served_now(tmp_path: Path) -> None:
    gate, liveness, state, (mps, plain) = _gate(tmp_path)
    gate.on_config([plain.resource])  # the MPS pool is gone: nothing waits for it any more
    assert state.snapshot().mps_not_ready == frozenset() and not gate.waits(plain)
    gate.on_config([mps.resource, plain.resource])  # back: it waits for its daemon again
    assert gate.waits(mps) and gate.check([mps]) == []

"""One MPS readiness for both node APIs: every MPS pool starts not ready, follows its daemon's answers (each change
logged once), and a reload holds a new pool back and lets a removed one go."""

from __future__ import annotations

import logging

from deviceplugin.health.mpsready import MpsReadiness
from deviceplugin.mps.paths import MpsPaths
from deviceplugin.state import NodeState
from tests.conftest import node
from tests.support.resources import resources_of


class Liveness:
    """What MpsLiveness would answer, per pool directory name."""

    def __init__(self) -> None:
        self.answering: set[str] = set()

    def ready(self, paths: MpsPaths) -> bool:
        return paths.root.name in self.answering


def _mps(*pools: str):
    pools = [
        {
            "name": p,
            "mode": "shared",
            "backend": "mps",
            "replicas": 2,
            "gpus": {"indexes": [i]},
            "resource": f"example.com/mps-{p}",
        }
        for i, p in enumerate(pools)
    ]
    config = {"version": "v1", "pools": pools}
    return resources_of(config, node("2xT4"))


def test_pools_start_not_ready_and_follow_their_daemon(caplog) -> None:
    state, liveness = NodeState(), Liveness()
    readiness = MpsReadiness(state, liveness, _mps("a", "b"), interval=1.0)  # type: ignore[arg-type]
    assert state.snapshot().mps_not_ready == {"a", "b"} and not readiness.ready("a")
    liveness.answering = {"a"}
    with caplog.at_level(logging.INFO, logger="deviceplugin.health.mpsready"):
        readiness.check()
        readiness.check()
        liveness.answering = set()
        readiness.check()
    assert readiness.ready("b") is False and state.snapshot().mps_not_ready == {"a", "b"}
    assert [r.getMessage() for r in caplog.records] == [
        "MPS control daemon of pool a is ready",
        "MPS control daemon of pool a is down: devices Unhealthy",
    ]


def test_a_reload_holds_a_new_pool_back_and_releases_a_removed_one() -> None:
    state, liveness = NodeState(), Liveness()
    liveness.answering = {"a"}
    readiness = MpsReadiness(state, liveness, _mps("a"), interval=1.0)  # type: ignore[arg-type]
    readiness.check()
    assert readiness.ready("a")
    readiness.on_config(None, _mps("a", "b"))
    assert state.snapshot().mps_not_ready == {"b"}
    readiness.on_config(None, [])
    assert state.snapshot().mps_not_ready == frozenset() and readiness.paths("a") is None

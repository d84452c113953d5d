"""alloc.shapeguard: the one shape guard of both front ends (the reconcile it runs is tested in test_pending.py)."""

from __future__ import annotations

from deviceplugin.alloc.shapeguard import SWITCHING, ShapeGuard
from deviceplugin.model.usage import Hold
from tests.unit.alloc.test_pending import GPU0, GPU1, plan

FOUR = [{"name": "s", "mode": "shared", "replicas": 4}]
EIGHT = [{"name": "s", "mode": "shared", "replicas": 8}]
HELD = [Hold("example.com/gpu-share", f"{GPU0}::1", 4)]


def test_no_change_and_nothing_pending_needs_no_fence() -> None:
    assert ShapeGuard().fence(plan(FOUR), plan(FOUR)) is None


def test_a_held_gpu_waits_counted_once_then_switches_when_released() -> None:
    guard = ShapeGuard()
    served, wanted = plan(FOUR), plan(EIGHT)
    assert guard.fence(served, wanted) == {GPU0: SWITCHING, GPU1: SWITCHING}
    kept = guard.apply(served, wanted, HELD)
    assert set(guard.pending) == {GPU0} and guard.deferred == 1
    assert {d.unit.replicas for r in kept for d in r.devices.values() if d.gpu.uuid == GPU0} == {4}
    assert "held by 1 holder" in guard.described()[GPU0]
    guard.apply(kept, wanted, HELD)  # still held: still waiting, not counted again
    assert guard.deferred == 1
    switched = guard.apply(kept, wanted, [])
    assert guard.pending == {} and guard.described() == {}
    assert {d.unit.replicas for r in switched for d in r.devices.values()} == {8}


def test_an_unreadable_read_is_counted() -> None:
    guard = ShapeGuard()
    guard.unreadable(OSError("pod-resources down"), 1.0)
    assert guard.unreadable_holds == 1 and guard.pending == {}

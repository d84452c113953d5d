"""NodeState, the one owner of the node's runtime state: writes -> views, subscribers, isolation, threads."""

from __future__ import annotations

import logging
import threading

import pytest

from deviceplugin.agent.observe import Observation
from deviceplugin.state import NodeState, NodeView

G0, G1, M0 = "GPU-0", "GPU-1", "MIG-0"


def _health(state: NodeState) -> None:
    state.set_health({G0: "XID 79", M0: "XID 48"}, frozenset({M0}), {G0: 2})


# (name, writes, what the view holds afterwards)
WRITES = [
    ("nothing", lambda s: None, {"version": 0, "unhealthy": frozenset(), "reasons": {}, "mps_not_ready": frozenset()}),
    (
        "health",
        _health,
        {
            "version": 1,
            "unhealthy": frozenset({G0, M0}),
            "reasons": {G0: "XID 79", M0: "XID 48"},
            "awaiting_reset": frozenset({M0}),
            "xid_counts": {G0: 2},
        },
    ),
    (
        "health without XID counts keeps them",
        lambda s: (_health(s), s.set_health({})),
        {"version": 2, "unhealthy": frozenset(), "xid_counts": {G0: 2}},
    ),
    ("the same health twice is one change", lambda s: (_health(s), _health(s)), {"version": 1}),
    (
        "quarantine",
        lambda s: s.set_quarantine(frozenset({G1}), frozenset({"GPU-1::2"})),
        {"quarantined_gpus": frozenset({G1}), "quarantined_devices": frozenset({"GPU-1::2"})},
    ),
    ("a pool down", lambda s: s.set_mps_ready("mps-a", False), {"version": 1, "mps_not_ready": frozenset({"mps-a"})}),
    (
        "a pool down and back",
        lambda s: (s.set_mps_ready("mps-a", False), s.set_mps_ready("mps-b", False), s.set_mps_ready("mps-a", True)),
        {"version": 3, "mps_not_ready": frozenset({"mps-b"})},
    ),
    ("a ready pool that was never down: no change", lambda s: s.set_mps_ready("mps-a", True), {"version": 0}),
    (
        "an observation",
        lambda s: s.set_observation(Observation(last_sync=5.0)),
        {"version": 1, "observation": Observation(last_sync=5.0)},
    ),
    (
        "parts are independent",
        lambda s: (_health(s), s.set_quarantine(frozenset({G1}), frozenset())),
        {"unhealthy": frozenset({G0, M0}), "quarantined_gpus": frozenset({G1})},
    ),
]


@pytest.mark.parametrize("name, write, expected", WRITES, ids=[w[0] for w in WRITES])
def test_writes_make_the_view(name, write, expected):
    state = NodeState()
    write(state)
    view = state.snapshot()
    for key, value in expected.items():
        assert getattr(view, key) == value, key


def test_views_are_immutable_and_not_tied_to_what_the_writer_keeps():
    state = NodeState()
    reasons = {G0: "lost"}
    state.set_health(reasons)
    view = state.snapshot()
    reasons[G1] = "later"  # the monitor goes on changing its own dict
    assert dict(view.reasons) == {G0: "lost"} and state.snapshot().reasons == {G0: "lost"}
    with pytest.raises(TypeError):
        view.reasons[G1] = "x"  # type: ignore[index]
    with pytest.raises(AttributeError):
        view.version = 7  # type: ignore[misc]


def test_subscribers_get_each_change_once_in_order_and_not_unchanged_writes():
    state = NodeState()
    seen: list[NodeView] = []
    unsubscribe = state.subscribe(seen.append)
    _health(state)
    _health(state)  # unchanged: nobody is called
    state.set_mps_ready("p", False)
    assert [v.version for v in seen] == [1, 2] and seen[-1].mps_not_ready == {"p"}
    unsubscribe()
    state.set_mps_ready("p", True)
    assert len(seen) == 2


def test_a_failing_subscriber_is_logged_and_neither_the_writer_nor_the_others_break(caplog):
    state = NodeState()
    seen: list[int] = []

    def broken(view: NodeView) -> None:
        raise RuntimeError("reader bug")

    state.subscribe(broken)
    state.subscribe(lambda v: seen.append(v.version))
    with caplog.at_level(logging.ERROR, "deviceplugin.state"):
        _health(state)  # does not raise
        state.set_mps_ready("p", False)
    assert seen == [1, 2] and state.snapshot().version == 2
    failures = [r for r in caplog.records if "subscriber failed" in r.getMessage()]
    assert len(failures) == 2 and failures[0].exc_info and "reader bug" in str(failures[0].exc_info[1])


def test_callbacks_run_outside_the_lock_and_may_read_or_write():
    """A subscriber reading the state (or writing it) does not deadlock; its write is delivered after the current
    one."""
    state = NodeState()
    seen: list[tuple[int, frozenset[str]]] = []

    def follow(view: NodeView) -> None:
        seen.append((view.version, state.snapshot().mps_not_ready))
        if view.version == 1:
            state.set_mps_ready("echo", False)

    state.subscribe(follow)
    state.set_mps_ready("p", False)
    assert [v for v, _ in seen] == [1, 2] and seen[1][1] == {"p", "echo"}


def test_many_writers_and_readers_lose_nothing():
    state = NodeState()
    versions: list[int] = []
    state.subscribe(lambda v: versions.append(v.version))
    pools = [f"pool-{i}" for i in range(8)]
    errors: list[BaseException] = []

    def writer(pool: str) -> None:
        try:
            for n in range(200):
                state.set_mps_ready(pool, n % 2 == 1)  # down, up, ... ends up (n = 199)
                state.set_health({pool: f"round {n}"} if n < 199 else {})
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    def reader() -> None:
        last = -1
        for _ in range(2000):
            view = state.snapshot()
            if view.version < last:
                errors.append(AssertionError(f"version went back: {last} -> {view.version}"))
            last = view.version

    threads = [threading.Thread(target=writer, args=(p,)) for p in pools] + [
        threading.Thread(target=reader) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    final = state.snapshot()
    assert final.mps_not_ready == frozenset() and final.unhealthy == frozenset()
    assert versions == sorted(versions) and len(set(versions)) == len(versions)  # in order, each once
    assert versions[-1] == final.version  # the last change was delivered


def test_a_resources_health_is_its_own_part_of_the_view():
    """Unhealthy GPUs and MIG instances of its units (pending GPUs too), its quarantined devices, its MPS daemon."""
    from deviceplugin.alloc.allocator import ResourceHealth
    from tests.conftest import node
    from tests.support.resources import one_pool

    info = node("2xT4")
    resource = one_pool(
        info, {"name": "m", "mode": "shared", "backend": "mps", "replicas": 4, "gpus": {"indexes": [1]}}
    )
    t0, t1 = (g.uuid for g in info.gpus)
    state = NodeState()
    assert state.snapshot().resource_health(resource) == ResourceHealth()
    state.set_health({t0: "XID 79", t1: "XID 48"})
    state.set_quarantine(frozenset({t0, t1}), frozenset({f"{t0}::0", f"{t1}::2"}))
    state.set_pending({t1: "waiting for its holders"})
    state.set_mps_ready("other", False)
    assert state.snapshot().resource_health(resource) == ResourceHealth(
        frozenset({t1}), frozenset({f"{t1}::2"}), frozenset({t1}), True
    )
    state.set_health({})
    state.set_mps_ready("m", False)
    view = state.snapshot()
    assert (
        view.resource_health(resource)
        == view.resource_health(resource, resource.health_keys())
        == ResourceHealth(frozenset({t1}), frozenset({f"{t1}::2"}), frozenset({t1}), mps_ready=False)
    )

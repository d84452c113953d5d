"""Bounded logs: ID lists are cut to a few and a count, long values are cut, storms of identical events become
one line and a "repeated N times" summary per window."""

from __future__ import annotations

import logging

from deviceplugin.alloc.allocator import AllocationError, ResourceAllocator
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.health.monitor import HealthMonitor
from deviceplugin.logs import RepeatLimiter, brief, safe_text
from deviceplugin.model.node import HealthEvent
from deviceplugin.state import NodeState
from tests.conftest import EXAMPLES, node
from tests.support.clock import ManualClock
from tests.support.resources import resources_of


def test_brief_keeps_the_first_ids_and_counts_the_rest():
    ids = [f"GPU-{i}::0" for i in range(100)]
    assert brief(ids) == "GPU-0::0, GPU-1::0, GPU-2::0, GPU-3::0, GPU-4::0 and 95 more"
    assert brief(ids[:5]) == "GPU-0::0, GPU-1::0, GPU-2::0, GPU-3::0, GPU-4::0"
    assert brief([], limit=3) == ""
    assert brief(iter("abcdefghij"), limit=2) == "a, b and 8 more"
    assert len(brief(["x" * 4_000_000] * 100_000)) < 1000  # a 4 MiB ID from a gRPC request stays a short line


def test_safe_text_escapes_and_cuts():
    assert safe_text("short") == "short"
    assert safe_text("a" * 100, 10) == "aaaaaaaaaa...(100 chars)"
    assert safe_text("line\nforged: caf\u00e9") == "line\\x0aforged: caf\\xe9"


def test_repeated_events_are_summarised_once_per_window(caplog):
    clock = ManualClock(0.0)
    limiter = RepeatLimiter(logging.getLogger("storm"), window=60, clock=clock)
    caplog.set_level(logging.INFO, "storm")
    for i in range(120_000):
        clock.now = i / 1000  # 120,000 events over 120 s
        limiter.log(logging.INFO, ("xid", 13), "ignoring XID %d", 13)
    limiter.flush(force=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "ignoring XID 13",
        "ignoring XID 13 (repeated 59999 times in 60s)",
        "ignoring XID 13",
        "ignoring XID 13 (repeated 59999 times in 60s)",
    ]


def test_a_quiet_key_is_summarised_at_flush_and_different_keys_are_kept_apart(caplog):
    clock = ManualClock(0.0)
    limiter = RepeatLimiter(logging.getLogger("keys"), window=10, max_keys=3, clock=clock)
    caplog.set_level(logging.INFO, "keys")
    for key in ("a", "a", "b"):
        limiter.log(logging.WARNING, key, "event %s", key)
    limiter.flush()
    assert [r.getMessage() for r in caplog.records] == ["event a", "event b"]  # windows still open
    clock.now = 10
    limiter.flush()
    assert [r.getMessage() for r in caplog.records][-1] == "event a (repeated 1 times in 10s)"
    assert caplog.records[-1].levelno == logging.WARNING
    # Only max_keys keys are followed: the oldest is summarised and dropped for a new one.
    for key in ("c", "c", "d", "e", "f"):
        limiter.log(logging.INFO, key, "event %s", key)
    assert "event c (repeated 1 times in 0s)" in [r.getMessage() for r in caplog.records]


def test_an_xid_storm_writes_a_few_lines(caplog):
    inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml")
    node = inventory.discover()
    clock = ManualClock(0.0)
    monitor = HealthMonitor(inventory, node, NodeState(), clock=clock)
    caplog.set_level(logging.INFO, "deviceplugin.health.monitor")
    for i in range(10_000):
        clock.now = i * 0.01
        assert not monitor.handle(HealthEvent(gpu_uuid=node.gpus[i % 2].uuid, xid=13, reason="XID 13"))
    ignored = [r.getMessage() for r in caplog.records if "ignoring application XID 13" in r.getMessage()]
    assert len(ignored) == 2 * 2 + 2  # per GPU: 100 s of events -> first line, summary, first line of the next window
    assert f"ignoring application XID 13 on GPU {node.gpus[0].uuid} (repeated 2999 times in 60s)" in ignored
    assert monitor.state.snapshot().reasons == {}


def test_an_allocation_error_over_thousands_of_ids_stays_short():
    resource = resources_of(
        {"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 1024}]}, node("2xT4")
    )[0]
    spanning = f"{resource.units[0].uuid} 1024 shares; {resource.units[1].uuid} 1024 shares"  # counted, not listed
    for ids, shown in (
        (list(resource.devices), spanning),
        ([f"bogus-{i}" for i in range(5000)] + ["x" * 4_000_000], "and 4993 more"),
    ):
        try:
            ResourceAllocator(resource).grant(ids)
        except AllocationError as err:
            assert shown in err.message and len(err.message) < 1500, err.message[:300]
        else:
            raise AssertionError("not refused")

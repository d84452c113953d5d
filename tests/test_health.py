"""Health through the whole stack: simulated faults -> HealthMonitor -> ListAndWatch -> the kubelet's counts."""

from __future__ import annotations

import time

import pytest

from deviceplugin.config.parse import parse_config
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.health.monitor import DEFAULT_RESET_XIDS, EVENT_WAIT, HealthMonitor, HealthSettings
from deviceplugin.plugin.manager import PluginManager
from deviceplugin.state import NodeState
from tests.support.clock import SteppedClock
from tests.support.resources import resources_of

from .conftest import EXAMPLES, FAST, registered, wait_until

SHARES = "example.com/gpu-share"
MIG = "example.com/mig-3g.40gb"
FAST_HEALTH = HealthSettings(recovery_period=0.4, check_interval=0.05)


@pytest.fixture
def stack(plugin_dir, kubelet):
    """GPU 2 of the A100 node (two 3g.40gb MIG instances) shared in 5 -> 10 shares; GPU 3 as MIG devices; GPU 5
    whole."""
    inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "8xA100-80GB-mig.yaml")
    node = inventory.discover()
    config = parse_config(
        {
            "version": "v1",
            "pools": [
                {"name": "shares", "mode": "shared", "replicas": 5, "gpus": {"indexes": [2]}},
                {"name": "mig", "mode": "mig", "gpus": {"indexes": [3]}},
                {"name": "whole", "mode": "exclusive", "gpus": {"indexes": [5]}},
            ],
        }
    )
    manager = PluginManager(resources_of(config, node), plugin_dir, FAST)
    monitor = HealthMonitor(inventory, node, manager.state, FAST_HEALTH, clock=SteppedClock())
    manager.start()
    monitor.start()
    assert kubelet.wait_for(registered(SHARES, "example.com/gpu"), timeout=5)
    yield inventory, node, monitor
    monitor.stop()
    manager.stop()


class Checks:
    """Counts the monitor's GPU queries, so a test waits for whole check rounds instead of sleeping through them."""

    def __init__(self, inventory: SimulatedInventory, gpus: int) -> None:
        self.calls, self.gpus, self._check = 0, gpus, inventory.check
        inventory.check = self._counted

    def _counted(self, gpu_uuid: str) -> str | None:
        self.calls += 1
        return self._check(gpu_uuid)

    def wait(self, rounds: int) -> None:
        """Until `rounds` check rounds begun after this call have ended (one more is counted: one may be under way)."""
        target = self.calls + (rounds + 1) * self.gpus
        assert wait_until(lambda: self.calls >= target, timeout=5)


@pytest.fixture
def checks(stack) -> Checks:
    inventory, node, _ = stack
    return Checks(inventory, len(node.gpus))


def skip_quiet_period(monitor: HealthMonitor, checks: Checks, periods: float) -> None:
    """`periods` recovery periods pass on the monitor's clock, and it checks every GPU after that."""
    monitor.clock.advance(FAST_HEALTH.recovery_period * periods)
    checks.wait(2)


def test_xid_marks_every_share_and_mig_instance_of_the_gpu_within_1s_then_recovers(stack, kubelet):
    inventory, node, monitor = stack
    gpu = node.gpus[2]
    assert kubelet.resources()[SHARES].allocatable == 10
    started = time.monotonic()
    inventory.inject_xid(gpu.uuid, 8)  # GPU stopped processing: not reset-class
    assert kubelet.wait_for(lambda st: st[SHARES].allocatable == 0 and st[SHARES].capacity == 10, timeout=1.0)
    assert time.monotonic() - started < 1.0
    assert kubelet.resources()["example.com/gpu"].allocatable == 1  # other GPUs untouched
    assert monitor.state.snapshot().xid_counts[gpu.uuid] == 1
    # Quiet for the (shortened) recovery period: every share comes back.
    assert kubelet.wait_for(lambda st: st[SHARES].allocatable == 10, timeout=3)


def test_attributed_xid_marks_only_that_mig_instance(stack, kubelet):
    inventory, node, _ = stack
    gpu = node.gpus[2]
    inventory.inject_xid(gpu.uuid, 48, mig_uuid=gpu.mig_devices[1].uuid)
    assert kubelet.wait_for(lambda st: st[SHARES].allocatable == 5, timeout=1.0)
    unhealthy = kubelet.resources()[SHARES].unhealthy
    assert sorted(unhealthy) == [f"{gpu.mig_devices[1].uuid}::{k}" for k in range(5)]


def test_unattributed_xid_marks_every_mig_device(stack, kubelet):
    inventory, node, _ = stack
    gpu3 = node.gpus[3]  # 4g.40gb + 2g.20gb + 1g.10gb in the mig pool
    assert kubelet.wait_for(
        registered("example.com/mig-4g.40gb", "example.com/mig-2g.20gb", "example.com/mig-1g.10gb"), timeout=2
    )
    inventory.inject_xid(gpu3.uuid, 94)
    assert kubelet.wait_for(
        lambda st: all(st[f"example.com/mig-{p}"].allocatable == 0 for p in ("4g.40gb", "2g.20gb", "1g.10gb")),
        timeout=1.0,
    )
    assert kubelet.resources()[SHARES].allocatable == 10


def test_ignored_xid_changes_nothing(stack, kubelet):
    inventory, node, monitor = stack
    messages = kubelet.resources()[SHARES].messages
    inventory.inject_xid(node.gpus[2].uuid, 13)  # application error
    inventory.inject_xid(node.gpus[5].uuid, 79)  # a real one elsewhere, to know the first was processed
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 0, timeout=1.0)
    assert kubelet.resources()[SHARES].messages == messages and kubelet.resources()[SHARES].allocatable == 10
    assert monitor.state.snapshot().xid_counts[node.gpus[2].uuid] == 0


def test_lost_gpu_stays_unhealthy_while_queries_fail_and_never_crashes(stack, kubelet, checks):
    inventory, node, monitor = stack
    gpu = node.gpus[5]
    inventory.lose_gpu(gpu.uuid)
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 0, timeout=1.0)
    skip_quiet_period(monitor, checks, 2)  # longer than the quiet period: still failing, still Unhealthy
    assert kubelet.resources()["example.com/gpu"].allocatable == 0
    assert "GPU is lost" in monitor.state.snapshot().reasons[gpu.uuid]
    inventory.restore(gpu.uuid)  # answering again is no evidence of a reset ...
    checks.wait(4)
    assert kubelet.resources()["example.com/gpu"].allocatable == 0
    inventory.set_reset_required(gpu.uuid, True)  # ... the driver's recovery action is
    checks.wait(4)
    inventory.set_reset_required(gpu.uuid, False)
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 1, timeout=3)
    assert kubelet.resources()[SHARES].allocatable == 10


def test_scheduled_failure_from_the_node_file(plugin_dir, kubelet, tmp_path):
    node_file = tmp_path / "node.yaml"
    node_file.write_text(
        "gpus:\n  - {index: 0, uuid: GPU-x, model: T4, memoryMiB: 15360}\nfailures:\n  - {gpu: 0, after: 0, xid: 79}\n"
    )
    inventory = SimulatedInventory.from_file(node_file)
    node = inventory.discover()
    events = [inventory.wait_for_event(0.5)]
    assert events[0].gpu_uuid == "GPU-x" and events[0].xid == 79
    monitor = HealthMonitor(inventory, node, NodeState(), HealthSettings(enabled=False))
    monitor.start()  # disabled: returns without a thread
    assert not monitor.running


@pytest.mark.parametrize("xid", [48, 79, 95])
def test_reset_class_xid_stays_unhealthy_until_the_driver_shows_a_reset(stack, kubelet, checks, xid):
    inventory, node, monitor = stack
    gpu = node.gpus[5]
    inventory.inject_xid(gpu.uuid, xid)
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 0, timeout=1.0)
    skip_quiet_period(monitor, checks, 2)  # the quiet period passes: no recovery
    assert kubelet.resources()["example.com/gpu"].allocatable == 0 and monitor.state.snapshot().awaiting_reset == {
        gpu.uuid
    }
    inventory.set_reset_required(gpu.uuid, False)  # the driver says "no reset needed", but it never asked for one
    checks.wait(4)
    assert kubelet.resources()["example.com/gpu"].allocatable == 0
    inventory.set_reset_required(gpu.uuid, True)  # recovery action: GPU reset
    checks.wait(4)
    inventory.set_reset_required(gpu.uuid, False)  # ... and after `nvidia-smi -r` it is clear
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 1, timeout=2)
    assert monitor.state.snapshot().awaiting_reset == frozenset() and gpu.uuid not in monitor.state.snapshot().reasons


def test_reset_class_xid_on_a_driver_that_cannot_tell_stays_unhealthy(stack, kubelet, checks):
    inventory, node, monitor = stack
    gpu = node.gpus[5]
    inventory.inject_xid(gpu.uuid, 95)  # reset_required() is None: no recovery-action field
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 0, timeout=1.0)
    skip_quiet_period(monitor, checks, 3)
    assert (
        kubelet.resources()["example.com/gpu"].allocatable == 0
        and "XID 95" in monitor.state.snapshot().reasons[gpu.uuid]
    )


def test_every_reset_xid_is_documented():
    from .conftest import ROOT

    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("| XID | meaning | why a reset |") :].split("\n\n")[0]
    documented = {int(x) for row in table.splitlines()[2:] for x in row.split("|")[1].split(",")}
    assert documented == DEFAULT_RESET_XIDS
    assert ",".join(map(str, sorted(DEFAULT_RESET_XIDS))) in (ROOT / "docs" / "configuration.md").read_text()


def test_the_drivers_recovery_action_holds_any_gpu_until_reset(stack, kubelet, checks):
    inventory, node, monitor = stack
    gpu = node.gpus[5]
    inventory.inject_xid(gpu.uuid, 119)  # GSP timeout: not reset-class by itself ...
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 0, timeout=1.0)
    inventory.set_reset_required(gpu.uuid, True)  # ... but this time the driver says "GPU Reset Required"
    skip_quiet_period(monitor, checks, 2)
    assert kubelet.resources()["example.com/gpu"].allocatable == 0 and monitor.state.snapshot().awaiting_reset == {
        gpu.uuid
    }
    inventory.set_reset_required(gpu.uuid, False)
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 1, timeout=2)


def test_contained_ecc_error_recovers_after_the_quiet_period(stack, kubelet):
    inventory, node, monitor = stack
    gpu = node.gpus[5]
    inventory.inject_xid(gpu.uuid, 94)  # NVIDIA: new work may start without a reset
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 0, timeout=1.0)
    assert monitor.state.snapshot().awaiting_reset == frozenset()
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 1, timeout=3)


def test_a_stop_waits_out_one_short_event_wait_not_the_check_interval(monkeypatch):
    """NVML's event wait cannot be woken: the monitor waits EVENT_WAIT at a time, so SIGTERM -> exit stays short."""
    inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml")
    waits: list[float] = []

    def blocking_wait(timeout: float) -> None:  # as NVML's: nothing ends it early
        waits.append(timeout)
        time.sleep(timeout)

    monkeypatch.setattr(inventory, "wait_for_event", blocking_wait)
    monitor = HealthMonitor(inventory, inventory.discover(), NodeState(), HealthSettings(check_interval=10.0))
    monitor.start()
    assert wait_until(lambda: bool(waits))
    started = time.monotonic()
    monitor.stop()
    assert time.monotonic() - started < 0.5 and not monitor.running
    assert set(waits) == {EVENT_WAIT}

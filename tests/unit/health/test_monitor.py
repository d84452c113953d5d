"""Health that cannot forget: a GPU that was lost and answers again rejoins the NVML event set (its XIDs are seen),
and a reset-class fault clears only on the driver's evidence of a reset (the recovery action), never because a GPU
whose queries failed answers again. On the simulated node and on NVML over the fake pynvml."""

from __future__ import annotations

import sys
import time

import pynvml as real
import pytest

from deviceplugin.discovery.nvml import NvmlInventory
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.health.monitor import HealthMonitor, HealthSettings
from deviceplugin.model.node import HealthEvent
from deviceplugin.state import NodeState
from tests.conftest import EXAMPLES
from tests.support.clock import ManualClock
from tests.support.fake_pynvml import FakeGpu, FakeNvml


def t4(i: int) -> FakeGpu:
    return FakeGpu(
        uuid=f"GPU-t4-{i}",
        name="Tesla T4",
        memory_mib=15360,
        bus_id=f"00000000:{0x3B + i:02X}:00.0",
        recovery_action=real.NVML_GPU_RECOVERY_ACTION_NONE,
    )


@pytest.fixture
def nvml_of(monkeypatch, tmp_path):
    """`nvml_of(gpus, **options)`: a fake driver with `gpus` T4s and an NvmlInventory over it (closed after the
    test)."""
    made: list[NvmlInventory] = []

    def make(gpus: int = 2, **options) -> tuple[FakeNvml, NvmlInventory]:
        fake = FakeNvml([t4(i) for i in range(gpus)])
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        made.append(NvmlInventory(sysfs_root=tmp_path, **options))
        made[-1].discover()
        return fake, made[-1]

    yield make
    for inventory in made:
        inventory.close()


@pytest.fixture
def nvml(nvml_of):
    return nvml_of(recheck_interval=0.0)  # lost GPUs asked again on every wait


def test_a_lost_gpu_that_answers_again_rejoins_the_event_set_and_its_xids_are_seen(nvml):
    fake, inventory = nvml
    assert inventory.wait_for_event(0.01) is None
    fake.gpus[0].lost = True
    fake.xid(1, 13)
    assert inventory.wait_for_event(1.0).gpu_uuid == "GPU-t4-1"  # GPU 0 left out, GPU 1 still watched
    assert set(fake.registered) == {1}
    fake.gpus[0].lost = False  # it answers again
    assert inventory.wait_for_event(0.01) is None
    assert set(fake.registered) == {0, 1}
    fake.xid(0, 48)
    event = inventory.wait_for_event(1.0)
    assert event is not None and (event.gpu_uuid, event.xid) == ("GPU-t4-0", 48)  # seen as at once as on GPU 1


def test_lost_gpus_are_asked_again_at_most_once_a_recheck_interval_however_short_the_waits(nvml_of):
    """The monitor waits in slices of 50 ms (a stop is quick); a fallen GPU's query can be slow, so it is not asked
    each slice."""
    fake, inventory = nvml_of()  # the default interval, 1 s
    assert inventory.wait_for_event(0.01) is None
    fake.gpus[0].lost = True
    fake.xid(1, 13)
    assert inventory.wait_for_event(1.0).gpu_uuid == "GPU-t4-1"  # the failed wait found GPU 0 lost
    fake.calls.clear()
    for _ in range(10):
        assert inventory.wait_for_event(0.01) is None
    assert fake.calls.count("nvmlDeviceGetHandleByUUID") <= 1, fake.calls


def test_a_second_lost_gpu_is_left_out_too_while_the_first_is_still_lost(nvml_of):
    """Asking whether lost GPUs answer again and finding which GPU made a wait fail each have their own allowance:
    with one GPU left out, a second loss must not stop every other GPU's events."""
    fake, inventory = nvml_of(3)  # the default interval, 1 s
    assert inventory.wait_for_event(0.01) is None
    fake.gpus[0].lost = True
    fake.xid(2, 13)
    assert inventory.wait_for_event(1.0).gpu_uuid == "GPU-t4-2"
    fake.gpus[1].lost = True
    fake.xid(2, 31)
    deadline = time.monotonic() + 4.0
    event = None
    while event is None and time.monotonic() < deadline:
        event = inventory.wait_for_event(0.05)  # the monitor's slices
    assert event is not None and (event.gpu_uuid, event.xid) == ("GPU-t4-2", 31)
    assert set(fake.registered) == {2}


def monitor_of(inventory) -> tuple[HealthMonitor, ManualClock]:
    clock = ManualClock()
    node = inventory.discover()
    return HealthMonitor(
        inventory, node, NodeState(), HealthSettings(recovery_period=300, check_interval=0.5), clock=clock
    ), clock


def fail_for(monitor: HealthMonitor, clock: ManualClock, seconds: float, fail, restore) -> None:
    """The GPU's queries fail for `seconds` (checked every half second), then answer."""
    fail()
    for _ in range(int(seconds / 0.5)):
        clock.now += 0.5
        monitor.check(clock.now)
    restore()
    for _ in range(4):
        clock.now += 0.5
        monitor.check(clock.now)


def test_reset_class_xid_then_a_transient_query_failure_is_not_taken_for_a_reset_nvml(nvml, caplog):
    fake, inventory = nvml
    monitor, clock = monitor_of(inventory)
    fake.xid(0, 48)
    monitor.handle(inventory.wait_for_event(1.0))
    fail_for(
        monitor,
        clock,
        2.5,
        lambda: fake.fail("nvmlDeviceGetMemoryInfo", 0, real.NVMLError_Unknown),
        lambda: fake.failures.clear(),
    )
    view = monitor.state.snapshot()
    assert view.awaiting_reset == {"GPU-t4-0"} and "GPU-t4-0" in view.unhealthy
    assert "Healthy again" not in caplog.text
    # The driver's evidence: the recovery action asks for a reset, then (after `nvidia-smi -r`) reads NONE again.
    fake.gpus[0].recovery_action = real.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    clock.now += 0.5
    monitor.check(clock.now)
    fake.gpus[0].recovery_action = real.NVML_GPU_RECOVERY_ACTION_NONE
    clock.now += 0.5
    monitor.check(clock.now)
    assert monitor.state.snapshot().awaiting_reset == frozenset() and "GPU-t4-0" not in monitor.state.snapshot().reasons


def test_reset_class_xid_then_a_transient_query_failure_is_not_taken_for_a_reset_simulated(caplog):
    inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml")
    monitor, clock = monitor_of(inventory)
    gpu = inventory.discover().gpus[0].uuid
    inventory.set_reset_required(gpu, False)  # a driver that reports the recovery action: none needed
    monitor.handle(HealthEvent(gpu_uuid=gpu, reason="XID 48", xid=48))
    fail_for(monitor, clock, 2.5, lambda: inventory.fail_queries(gpu), lambda: inventory.restore(gpu))
    assert monitor.state.snapshot().awaiting_reset == {gpu} and "Healthy again" not in caplog.text


def test_a_lost_gpu_that_answers_again_stays_unhealthy_until_the_driver_shows_a_reset():
    inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml")
    monitor, clock = monitor_of(inventory)
    gpu = inventory.discover().gpus[1].uuid
    inventory.lose_gpu(gpu)
    monitor.handle(inventory.wait_for_event(1.0))
    fail_for(monitor, clock, 1.0, lambda: None, lambda: inventory.restore(gpu))
    assert gpu in monitor.state.snapshot().unhealthy
    inventory.set_reset_required(gpu, True)
    clock.now += 0.5
    monitor.check(clock.now)
    inventory.set_reset_required(gpu, False)
    clock.now += 0.5
    monitor.check(clock.now)
    assert gpu not in monitor.state.snapshot().unhealthy

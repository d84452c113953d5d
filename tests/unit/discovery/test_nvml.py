"""The NVML backend against a fake pynvml module (real error classes, fake GPUs)."""

from __future__ import annotations

import sys
import time

import pynvml as real
import pytest

from deviceplugin.discovery.inventory import InventoryError
from deviceplugin.discovery.nvml import NvmlInventory, normalize_bus_id
from tests.support.fake_pynvml import FakeGpu, FakeMig, FakeNvml


def t4(i: int, **kw) -> FakeGpu:
    return FakeGpu(
        uuid=f"GPU-t4-{i}",
        name="Tesla T4",
        memory_mib=15360,
        bus_id=f"00000000:{0x3B + i:02X}:00.0",
        capability=(7, 5),
        **kw,
    )


def a100(i: int, **kw) -> FakeGpu:
    return FakeGpu(
        uuid=f"GPU-a100-{i}",
        name="NVIDIA A100-SXM4-80GB",
        memory_mib=81920,
        bus_id=f"00000000:{0x07 + i:02X}:00.0",
        **kw,
    )


@pytest.fixture
def install(monkeypatch, tmp_path):
    """install(FakeNvml) -> NvmlInventory using it, with a fake sysfs holding NUMA nodes."""
    opened = []

    def make(fake: FakeNvml, numa: dict[str, int] | None = None) -> NvmlInventory:
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        for bus, node in (numa or {}).items():
            path = tmp_path / "bus" / "pci" / "devices" / bus
            path.mkdir(parents=True)
            (path / "numa_node").write_text(f"{node}\n")
        inventory = NvmlInventory(sysfs_root=tmp_path)
        opened.append(inventory)
        return inventory

    yield make
    for inventory in opened:
        inventory.close()


def test_bus_id_normalisation():
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0000:af:00.0") == "0000:af:00.0"


def test_discovers_plain_gpus_numa_and_versions(install):
    fake = FakeNvml([t4(0), t4(1)], topology={(0, 1): real.NVML_TOPOLOGY_HOSTBRIDGE})
    node = install(fake, numa={"0000:3b:00.0": 0, "0000:3c:00.0": -1}).discover()
    assert [(g.index, g.uuid, g.model, g.memory_mib) for g in node.gpus] == [
        (0, "GPU-t4-0", "Tesla T4", 15360),
        (1, "GPU-t4-1", "Tesla T4", 15360),
    ]
    assert [g.numa_node for g in node.gpus] == [0, None]  # -1 in sysfs means none
    assert node.gpus[0].pci_bus_id == "0000:3b:00.0" and node.gpus[0].compute_capability == "7.5"
    assert (
        not node.gpus[0].mig_enabled and not node.gpus[0].mig_capable
    )  # MigMode raised NotSupported: a T4 cannot do MIG
    assert (node.driver_version, node.cuda_driver_version) == ("550.54.15", "12.4")
    assert node.link(node.gpus[0], node.gpus[1]).describe() == "host-bridge"
    assert fake.initialised == 1


def test_mig_instances_with_index_gaps(install):
    mig = {0: FakeMig("MIG-a", "3g.40gb", 40192, gi=1), 2: FakeMig("MIG-b", "1g.10gb+me", 9984, gi=9, ci=0)}
    node = install(FakeNvml([a100(0, mig=mig), a100(1, mig={})])).discover()
    gpu = node.gpus[0]
    assert gpu.mig_enabled and [
        (m.uuid, m.profile, m.memory_mib, m.gi_id, m.ci_id, m.index) for m in gpu.mig_devices
    ] == [
        ("MIG-a", "3g.40gb", 40192, 1, 0, 0),
        ("MIG-b", "1g.10gb+me", 9984, 9, 0, 2),
    ]
    assert (
        not node.gpus[1].mig_enabled and node.gpus[1].mig_devices == () and node.gpus[1].mig_capable
    )  # MIG supported, disabled


def test_nvlink_counts_stop_at_first_unsupported_link(install):
    gpus = [a100(0), a100(1), a100(2)]
    gpus[0].nvlinks = [gpus[1].bus_id] * 4 + [gpus[2].bus_id] * 2
    gpus[1].nvlinks = [gpus[0].bus_id] * 4
    gpus[2].nvlinks = [gpus[0].bus_id] * 2
    node = install(FakeNvml(gpus)).discover()
    g = node.gpus
    assert node.link(g[0], g[1]).nvlinks == 4 and node.link(g[1], g[0]).describe() == "NV4"
    assert node.link(g[0], g[2]).nvlinks == 2 and node.link(g[1], g[2]).nvlinks == 0


def test_nvswitch_links_connect_every_switch_attached_gpu(install):
    gpus = [a100(i, nvlinks=["00000000:C0:00.0"] * 12) for i in range(3)]  # every link ends at an NVSwitch
    node = install(FakeNvml(gpus)).discover()
    assert {link.nvlinks for link in node.links.values()} == {12}


def test_lost_gpu_is_skipped_with_the_rest_discovered(install, caplog):
    fake = FakeNvml([t4(0), t4(1, lost=True)])
    node = install(fake).discover()
    assert [g.uuid for g in node.gpus] == ["GPU-t4-0"]
    assert "GPU 1 is not usable and is not advertised" in caplog.text and "GPU is lost" in caplog.text


def test_a_gpu_failing_a_query_is_skipped_with_the_call_and_gpu_named_and_the_rest_discovered(install):
    fake = FakeNvml([t4(0), t4(1), t4(2)])
    fake.fail("nvmlDeviceGetMemoryInfo", 1, real.NVMLError_Unknown)
    node = install(fake).discover()
    assert [g.index for g in node.gpus] == [0, 2]
    assert node.skipped == ((1, "NVML nvmlDeviceGetMemoryInfo failed on GPU 1 (GPU-t4-1): Unknown Error"),)


def test_a_failing_node_wide_query_still_fails_discovery_with_the_call_named(install):
    fake = FakeNvml([t4(0)])
    fake.fail("nvmlSystemGetDriverVersion", None, real.NVMLError_Unknown)
    with pytest.raises(InventoryError) as err:
        install(fake).discover()
    assert str(err.value) == "NVML nvmlSystemGetDriverVersion failed: Unknown Error"


def test_no_driver_message(install):
    fake = FakeNvml([])
    fake.fail("nvmlInit", None, real.NVMLError_LibraryNotFound)
    with pytest.raises(InventoryError) as err:
        install(fake)
    message = str(err.value)
    assert message.startswith("NVML could not be loaded: nvmlInit failed: NVML Shared Library Not Found")
    assert "gpu-share demo --node examples/nodes/2xT4.yaml" in message


def test_xid_events_are_attributed_to_mig_instances(install):
    mig = {0: FakeMig("MIG-a", "3g.40gb", 40192, gi=1), 1: FakeMig("MIG-b", "3g.40gb", 40192, gi=2)}
    fake = FakeNvml([a100(0, mig=mig), t4(1)])
    inventory = install(fake)
    inventory.discover()
    fake.xid(0, 48, gi=2, ci=0)
    event = inventory.wait_for_event(1.0)
    assert (event.gpu_uuid, event.xid, event.mig_uuid, event.reason) == ("GPU-a100-0", 48, "MIG-b", "XID 48")
    fake.xid(1, 79)
    event = inventory.wait_for_event(1.0)
    assert (event.gpu_uuid, event.xid, event.mig_uuid) == ("GPU-t4-1", 79, None)
    assert inventory.wait_for_event(0.05) is None  # NVML timeout: nothing happened
    mask = real.nvmlEventTypeXidCriticalError | real.nvmlEventTypeDoubleBitEccError
    assert fake.registered == {0: mask, 1: mask}


def test_events_registered_only_for_supported_types(install):
    fake = FakeNvml([t4(0)])
    fake.supported_events = real.nvmlEventTypeXidCriticalError  # no ECC events on this GPU
    inventory = install(fake)
    inventory.discover()
    assert inventory.wait_for_event(0.01) is None
    assert fake.registered == {0: real.nvmlEventTypeXidCriticalError}


def test_failing_event_wait_does_not_spin(install):
    fake = FakeNvml([t4(0)])
    inventory = install(fake)
    inventory.discover()
    fake.wait_error = real.NVMLError_GpuIsLost
    started = time.monotonic()
    assert inventory.wait_for_event(0.1) is None and inventory.wait_for_event(0.1) is None
    assert time.monotonic() - started >= 0.2


def test_check_reports_lost_gpu_and_close_shuts_down_once(install):
    fake = FakeNvml([t4(0)])
    inventory = install(fake)
    assert inventory.check("GPU-t4-0") is None
    fake.gpus[0].lost = True
    assert inventory.check("GPU-t4-0") == "NVML query on GPU GPU-t4-0 failed: GPU is lost"
    inventory.close()
    inventory.close()
    assert fake.calls.count("nvmlShutdown") == 1 and fake.initialised == 0


def test_stats_and_processes(install):
    mig = {0: FakeMig("MIG-a", "3g.40gb", 40192, gi=1), 1: FakeMig("MIG-b", "3g.40gb", 40192, gi=2)}
    fake = FakeNvml([a100(0, mig=mig), t4(1)])
    fake.gpus[1].utilization = 37
    fake.gpus[1].processes = [(11, 512 * 1024 * 1024, 0xFFFFFFFF, 0xFFFFFFFF), (12, None, 0xFFFFFFFF, 0xFFFFFFFF)]
    fake.gpus[0].processes = [(21, 1024 * 1024 * 1024, 2, 0)]
    inventory = install(fake)
    inventory.discover()
    stats = inventory.stats("GPU-t4-1")
    assert (stats.utilization_percent, stats.temperature_celsius, stats.power_watts, stats.memory_used_mib) == (
        37.0,
        41.0,
        71.5,
        0,
    )
    # usedGpuMemory None counts as 0; the MPS call's NVMLLibraryMismatchError (a plain Exception) is tolerated.
    assert sorted((p.pid, p.used_mib) for p in inventory.processes("GPU-t4-1")) == [(11, 512), (12, 0)]
    (process,) = inventory.processes("GPU-a100-0")
    assert (process.pid, process.used_mib, process.mig_uuid) == (21, 1024, "MIG-b")
    fake.fail("nvmlDeviceGetComputeRunningProcesses", 1, real.NVMLError_Unknown)
    assert inventory.processes("GPU-t4-1") is None  # the list itself failed: unknown, not "no process"
    fake.gpus[1].lost = True
    assert inventory.stats("GPU-t4-1") == type(stats)() and inventory.processes("GPU-t4-1") is None  # unknown


def test_a_lost_gpu_never_delays_the_events_of_the_others(install):
    fake = FakeNvml([t4(0), t4(1)])
    inventory = install(fake)
    inventory.discover()
    assert inventory.wait_for_event(0.01) is None
    fake.gpus[0].lost = True
    fake.xid(1, 48)
    started = time.monotonic()
    event = inventory.wait_for_event(1.0)
    assert event is not None and (event.gpu_uuid, event.xid) == ("GPU-t4-1", 48)
    assert time.monotonic() - started < 0.2  # not the ~1 s of a wait that sleeps after GPU_IS_LOST
    assert fake.registered == {1: real.nvmlEventTypeXidCriticalError | real.nvmlEventTypeDoubleBitEccError}
    fake.xid(1, 79)
    assert inventory.wait_for_event(1.0).xid == 79  # no rebuild per wait: the set without GPU 0 is kept
    assert len(fake.event_sets) == 1


def test_reset_required_reads_the_gpu_recovery_action(install):
    fake = FakeNvml([t4(0)])
    inventory = install(fake)
    assert inventory.reset_required("GPU-t4-0") is None  # field not supported: cannot tell
    fake.gpus[0].recovery_action = real.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert inventory.reset_required("GPU-t4-0") is True
    fake.gpus[0].recovery_action = real.NVML_GPU_RECOVERY_ACTION_NONE
    assert inventory.reset_required("GPU-t4-0") is False
    fake.gpus[0].lost = True
    assert inventory.reset_required("GPU-t4-0") is None


def test_numa_from_nvml_affinity_where_sysfs_has_no_entry(install, tmp_path):
    fake = FakeNvml(
        [t4(0, memory_affinity=[1]), t4(1, cpu_affinity=list(range(16, 32))), t4(2), t4(3, memory_affinity=[0])]
    )
    for node_id, cpus in ((0, "0-15"), (1, "16-31")):
        path = tmp_path / "devices" / "system" / "node" / f"node{node_id}"
        path.mkdir(parents=True)
        (path / "cpulist").write_text(f"{cpus}\n")
    node = install(fake, numa={"0000:3e:00.0": -1}).discover()  # GPU 3: sysfs says "none", and that stands
    assert [g.numa_node for g in node.gpus] == [1, 1, None, None]

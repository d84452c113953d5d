"""Checks against the real driver. Marked `gpu`: skipped where NVML cannot be loaded (run them with
tests/gpu/run.sh)."""

from __future__ import annotations

import json
import subprocess

import pytest

from deviceplugin.config.types import default_config
from deviceplugin.discovery.inventory import InventoryError
from deviceplugin.plugin.manager import PluginManager
from deviceplugin.sim.kubelet import Container, Pod
from tests.support.resources import resources_of

from ..conftest import FAST, GPU_CLI, ROOT, registered

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvml():
    from deviceplugin.discovery.nvml import NvmlInventory

    try:
        inventory = NvmlInventory()
    except InventoryError as err:
        pytest.skip(f"no NVIDIA driver here: {err}")
    yield inventory
    inventory.close()


def test_discovers_every_gpu_the_driver_sees(nvml):
    import pynvml

    node = nvml.discover()
    assert len(node.gpus) == pynvml.nvmlDeviceGetCount() > 0
    for gpu in node.gpus:
        assert gpu.uuid.startswith("GPU-") and gpu.memory_mib > 1024 and gpu.model
        assert gpu.pci_bus_id.count(":") == 2 and gpu.pci_bus_id == gpu.pci_bus_id.lower()
        for mig in gpu.mig_devices:
            assert mig.uuid.startswith("MIG-") and mig.memory_mib < gpu.memory_mib
    assert node.driver_version and node.cuda_driver_version


def test_health_queries_and_events_work(nvml):
    node = nvml.discover()
    assert all(nvml.check(g.uuid) is None for g in node.gpus)
    event = nvml.wait_for_event(0.2)  # registers for events; a healthy idle GPU sends none
    assert event is None or event.gpu_uuid in {g.uuid for g in node.gpus}


def test_plugin_on_real_gpus_allocates_a_share(nvml, kubelet, plugin_dir):
    node = nvml.discover()
    manager = PluginManager(resources_of(default_config(), node), plugin_dir, FAST)
    manager.start()
    try:
        assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=10)
        expected = 10 * sum(len(g.mig_devices) or 1 for g in node.gpus)
        assert kubelet.resources()["example.com/gpu-share"].capacity == expected
        envs = kubelet.admit(Pod("p", [Container("c", {"example.com/gpu-share": 2})]))["c"][
            "example.com/gpu-share"
        ].envs
        assert envs["NVIDIA_VISIBLE_DEVICES"].split(",")[0] in {
            u for g in node.gpus for u in [g.uuid, *(m.uuid for m in g.mig_devices)]
        }
    finally:
        manager.stop()


def test_discover_command_on_real_gpus(nvml):
    proc = subprocess.run([*GPU_CLI, "discover", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [g["uuid"] for g in report["gpus"]] == [g.uuid for g in nvml.discover().gpus]


def test_discover_json_of_real_gpus_is_a_node_file(nvml, tmp_path):
    """The capture of a real node is accepted by --node and reads back the same (MIG layouts, links, health)."""
    capture = tmp_path / "node.json"
    capture.write_text(
        subprocess.run([*GPU_CLI, "discover", "--json"], capture_output=True, text=True, timeout=60, check=True).stdout
    )
    again = subprocess.run(
        [*GPU_CLI, "discover", "--node", str(capture), "--json"], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == json.loads(capture.read_text())
    check = subprocess.run(
        [*GPU_CLI, "config", "check", str(ROOT / "examples" / "config" / "default.yaml"), "--node", str(capture)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr

"""Start-up degrades per GPU, never per node, and grants nothing before health is known: a GPU failing an NVML query
is left out while the others serve; a typo in the profile label serves the default profile and is refused as a
reload refuses it; with deviceSpecs, devices whose nodes are missing are Unhealthy in the kubelet's first list."""

from __future__ import annotations

import sys

import grpc
import pynvml as real
import pytest
import yaml
from prometheus_client import generate_latest

from deviceplugin.agent.settings import AgentSettings
from deviceplugin.api import deviceplugin_pb2 as pb
from deviceplugin.discovery.nvml import NvmlInventory
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.health.monitor import HealthSettings
from deviceplugin.kube.client import NodeClient
from deviceplugin.runtime.daemon import PluginDaemon, build_daemon
from deviceplugin.runtime.options import DaemonOptions
from tests.support.clock import ManualClock

from .conftest import EXAMPLES, FAST, registered
from .support.fake_pynvml import FakeGpu, FakeNvml

SHARE, GPU = "example.com/gpu-share", "example.com/gpu"


def options(kubelet, config_file=None, **extra) -> DaemonOptions:
    return DaemonOptions(
        config_file=str(config_file) if config_file else None,
        plugin_dir=kubelet.plugin_dir,
        pod_resources_socket=kubelet.pod_resources_socket,
        metrics_port=0,
        timings=FAST,
        agent=AgentSettings(interval=3600),
        health=HealthSettings(check_interval=0.05),
        **extra,
    )


@pytest.fixture
def daemons():
    made: list[PluginDaemon] = []
    yield made
    for daemon in made:
        daemon.stop()


def test_one_gpu_failing_an_nvml_query_at_start_up_is_left_out_and_the_other_seven_serve(
    kubelet, monkeypatch, tmp_path, daemons, caplog
):
    fake = FakeNvml(
        [
            FakeGpu(uuid=f"GPU-t4-{i}", name="Tesla T4", memory_mib=15360, bus_id=f"00000000:{0x3B + i:02X}:00.0")
            for i in range(8)
        ]
    )
    fake.fail("nvmlDeviceGetMemoryInfo", 3, real.NVMLError_Unknown)  # at start-up only: the test clears it below
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    inventory = NvmlInventory(sysfs_root=tmp_path)
    daemon = build_daemon(inventory, options(kubelet))
    daemons.append(daemon)
    del fake.failures[("nvmlDeviceGetMemoryInfo", 3)]
    daemon.start()
    assert kubelet.wait_for(
        lambda st: SHARE in st and st[SHARE].registered and st[SHARE].allocatable == 70, timeout=10
    )  # 7 GPUs x 10 shares
    assert not any(d.startswith("GPU-t4-3") for d in kubelet.resources()[SHARE].healthy)
    assert [i for i, _ in daemon.node.skipped] == [3]
    assert (
        "GPU 3 is not usable and is not advertised (the other GPUs are): NVML nvmlDeviceGetMemoryInfo failed on GPU 3"
        in caplog.text
    )
    assert "gpushare_gpus_skipped 1.0" in generate_latest(daemon.registry).decode()


def test_a_typo_in_the_profile_label_at_start_up_serves_the_default_profile_and_is_refused_as_at_run_time(
    kubelet, fake_kube, tmp_path, daemons, caplog
):
    api, kubeconfig = fake_kube
    api.labels["example.com/gpu-share.config"] = "inferense"  # a typo of "inference"
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": "v1",
                "defaultProfile": "whole",
                "profiles": {
                    "whole": {"pools": [{"name": "w", "mode": "exclusive"}]},
                    "inference": {"pools": [{"name": "s", "mode": "shared", "replicas": 4}]},
                },
            }
        )
    )
    clock = ManualClock()  # the reloader's rounds are the test's (check()), the label's interval its clock's
    daemon = build_daemon(
        SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml"),
        options(kubelet, config, reload_interval=3600),
        NodeClient.connect(api.node_name, str(kubeconfig)),
        clock=clock,
    )
    daemons.append(daemon)
    daemon.start()
    assert kubelet.wait_for(registered(GPU), timeout=10) and SHARE not in kubelet.resources()
    assert (
        "the node label asks for profile inferense, which is refused: " in caplog.text
        and "serving the default profile whole" in caplog.text
    )
    # The reloader tries the label as it would any label, refuses it with the run-time message and counts it, once.
    assert not daemon.reloader.check() and not daemon.reloader.check()
    assert daemon.reloader.errors == 1
    assert (
        "config change rejected, still serving the last good config: " in caplog.text
        and "'inferense' is not in the config" in caplog.text
    )
    api.labels["example.com/gpu-share.config"] = "inference"  # fixed: served at the next label read
    assert not daemon.reloader.check()  # the label is not read again before its interval has passed
    clock.advance(daemon.options.profile_label_interval)
    assert daemon.reloader.check()
    assert kubelet.wait_for(registered(SHARE), timeout=10)
    assert daemon.reloader.errors == 1


def test_devices_whose_nodes_are_missing_are_unhealthy_in_the_first_list_and_never_granted(kubelet, tmp_path, daemons):
    root = tmp_path / "host"
    (root / "dev").mkdir(parents=True)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0"):  # no /dev/nvidia1
        (root / "dev" / name).touch()
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": "v1",
                "deviceSpecs": True,
                "deviceRoot": str(root),
                "pools": [{"name": "w", "mode": "exclusive"}],
            }
        )
    )
    daemon = build_daemon(SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml"), options(kubelet, config))
    daemons.append(daemon)
    gpu1 = daemon.node.gpus[1].uuid
    daemon.start()
    assert kubelet.wait_for(lambda st: GPU in st and st[GPU].messages >= 1, timeout=10)
    first = kubelet.resources()[GPU]
    assert first.messages == 1 and first.unhealthy == [gpu1] and first.allocatable == 1  # the very first list says so
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.stub(GPU).Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[gpu1])])
        )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_mig_instance_whose_capability_nodes_are_missing_is_unhealthy_in_the_first_list(kubelet, tmp_path, daemons):
    root = tmp_path / "host"
    (root / "dev" / "nvidia-caps").mkdir(parents=True)
    for name in (
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia2",
        "nvidia-caps/nvidia-cap21",
        "nvidia-caps/nvidia-cap22",
    ):
        (root / "dev" / name).touch()
    inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "8xA100-80GB-mig.yaml")
    first_mig, second_mig = inventory.discover().gpus[2].mig_devices
    caps = root / f"proc/driver/nvidia/capabilities/gpu2/mig/gi{first_mig.gi_id}"  # the second instance's are not there
    (caps / f"ci{first_mig.ci_id}").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 21\n")
    (caps / f"ci{first_mig.ci_id}" / "access").write_text("DeviceFileMinor: 22\n")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": "v1",
                "deviceSpecs": True,
                "deviceRoot": str(root),
                "pools": [{"name": "mig", "mode": "mig", "gpus": {"indexes": [2]}}],
            }
        )
    )
    daemon = build_daemon(inventory, options(kubelet, config))
    daemons.append(daemon)
    daemon.start()
    mig = f"example.com/mig-{first_mig.profile}"
    assert kubelet.wait_for(lambda st: mig in st and st[mig].messages >= 1, timeout=10)
    first = kubelet.resources()[mig]
    assert first.messages == 1 and first.unhealthy == [second_mig.uuid] and first.healthy == [first_mig.uuid]
    assert "cannot read MIG capability" in daemon.state.snapshot().reasons[second_mig.uuid]

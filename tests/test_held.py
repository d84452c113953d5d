"""A GPU is never handed out twice: a reload, a profile switch or a restart that would change the shape of a GPU
something holds is applied to the free GPUs only; the held GPU keeps its devices (Unhealthy for new containers)
until released, then switches. Every test asserts from the allocations the built-in kubelet records."""

from __future__ import annotations

import base64
import json
import random
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client import generate_latest

from deviceplugin.agent.settings import AgentSettings
from deviceplugin.api import deviceplugin_pb2 as pb
from deviceplugin.discovery.inventory import Inventory
from deviceplugin.discovery.nvml import NvmlInventory
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.plugin.server import Timings
from deviceplugin.runtime.daemon import PluginDaemon, build_daemon
from deviceplugin.runtime.options import DaemonOptions
from deviceplugin.sim.kubelet import AdmissionError, Container, KubeletSimulator, Pod

from .conftest import EXAMPLES, FAST, wait_until
from .support.fake_pynvml import FakeGpu, FakeNvml
from .support.grants import overcommitted

GPU, SHARE = "example.com/gpu", "example.com/gpu-share"
WHOLE_AND_SHARED = [
    {"name": "whole", "mode": "exclusive", "gpus": {"indexes": [0]}},
    {"name": "shared", "mode": "shared", "replicas": 4, "gpus": {"indexes": [1]}},
]
ALL_SHARED = [{"name": "shared", "mode": "shared", "replicas": 4}]
ALL_WHOLE = [{"name": "whole", "mode": "exclusive"}]
TIMINGS = Timings(**{**FAST.__dict__, "pending_interval": 0.05})


class Node:
    """The plugin (config file, pod-resources, the kubelet's checkpoint) beside the built-in kubelet, on 2xT4."""

    def __init__(self, tmp: Path, kubelet: KubeletSimulator, inventory: Inventory) -> None:
        self.tmp, self.kubelet = tmp, kubelet
        self.inventory = inventory
        self.node = self.inventory.discover()
        self.config = tmp / "config.yaml"
        self.daemon: PluginDaemon | None = None
        self.pods: list[Pod] = []
        self.refusal = ""  # the kubelet's message for the last pod it refused

    def write(self, pools: list[dict]) -> None:
        self.config.write_text(yaml.safe_dump({"version": "v1", "pools": pools}))

    def start(self, settle: bool = True) -> PluginDaemon:
        options = DaemonOptions(
            config_file=str(self.config),
            plugin_dir=self.kubelet.plugin_dir,
            pod_resources_socket=self.kubelet.pod_resources_socket,
            metrics_port=0,
            reload_interval=3600,
            timings=TIMINGS,
            agent=AgentSettings(interval=3600),
        )
        self.daemon = build_daemon(self.inventory, options, pod_directory=self.kubelet.pod_directory())
        self.daemon.start()
        if settle:
            self.settle()
        return self.daemon

    def settle(self) -> None:
        """Wait until the kubelet lists what the plugin serves (every resource registered with all its devices)."""
        assert self.daemon is not None
        manager = self.daemon.manager

        def listed(st: dict) -> bool:
            served = {
                s.resource.name: (len(s.resource.devices), s.socket_path.name if s.socket_path else "")
                for s in list(manager.servers)
            }
            return all(
                n in st and st[n].registered and (st[n].capacity, st[n].endpoint) == want for n, want in served.items()
            )

        assert self.kubelet.wait_for(listed, timeout=10), (
            self.kubelet.resources(),
            [(s.resource.name, s.socket_path) for s in manager.servers],
        )

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    def reload(self, pools: list[dict]) -> None:
        """Write the config and run the reloader's rounds until it is applied (it waits one round for the file to
        settle)."""
        assert self.daemon is not None
        before = self.config.read_text()
        self.write(pools)
        if self.config.read_text() == before:
            return
        reloads = self.daemon.reloader.reloads
        self.daemon.reloader.check()
        self.daemon.reloader.check()
        assert self.daemon.reloader.reloads == reloads + 1
        self.settle()

    def admit(self, resource: str, count: int) -> Pod | None:
        """A pod asking for `count` of `resource`; None when the kubelet refuses it."""
        pod = Pod(f"p{len(self.pods)}", [Container("c", {resource: count})])
        try:
            self.kubelet.admit(pod)
        except AdmissionError as err:
            self.refusal = str(err)
            return None
        self.pods.append(pod)
        return pod

    def release(self, pod: Pod) -> None:
        self.kubelet.delete_pod(pod.uid)
        self.pods.remove(pod)

    def gpu_of(self, pod: Pod) -> str:
        devices = next(iter(self.kubelet.allocated(pod)["c"].values()))
        return devices[0].split("::")[0]

    def pending(self) -> dict[str, str]:
        assert self.daemon is not None
        return dict(self.daemon.state.snapshot().pending_gpus)

    def fill(self, resource: str, count: int, tries: int) -> list[Pod]:
        return [p for p in (self.admit(resource, count) for _ in range(tries)) if p is not None]


@pytest.fixture(params=["simulated"])
def plugin(request, tmp_path, kubelet, monkeypatch):
    """The plugin on 2xT4: simulated, or (params=["nvml"]) NVML over the fake pynvml."""
    if request.param == "nvml":
        fake = FakeNvml(
            [
                FakeGpu(uuid=f"GPU-t4-{i}", name="Tesla T4", memory_mib=15360, bus_id=f"00000000:{0x3B + i:02X}:00.0")
                for i in range(2)
            ]
        )
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        inventory: Inventory = NvmlInventory(sysfs_root=tmp_path)
    else:
        inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml")
    made = Node(tmp_path, kubelet, inventory)
    made.write(WHOLE_AND_SHARED)
    made.start()
    assert kubelet.wait_for(
        lambda st: st.get(GPU) and st[GPU].allocatable == 1 and st.get(SHARE) and st[SHARE].allocatable == 4, timeout=10
    )
    yield made
    made.stop()


@pytest.mark.parametrize("plugin", ["simulated", "nvml"], indirect=True)
def test_repool_to_shared_never_puts_shares_on_the_gpu_held_whole_and_switches_once_released(plugin, kubelet):
    whole = plugin.admit(GPU, 1)
    plugin.admit(SHARE, 2)
    gpu0, gpu1 = (g.uuid for g in plugin.node.gpus)
    plugin.reload(ALL_SHARED)
    assert plugin.daemon is not None
    landed = plugin.fill(SHARE, 1, 4)
    assert overcommitted(kubelet, plugin.node) == []
    assert len(landed) == 2 and {plugin.gpu_of(p) for p in landed} == {gpu1}
    assert list(plugin.pending()) == [gpu0]
    # GPU 1 keeps its shares; GPU 0 keeps its whole device, Unhealthy: no share pod lands beside the tenant.
    assert kubelet.wait_for(
        lambda st: (
            st[SHARE].capacity == st[SHARE].allocatable == 4 and st[GPU].capacity == 1 and st[GPU].allocatable == 0
        ),
        timeout=5,
    )
    with pytest.raises(grpc.RpcError) as refused:  # a request straight to the plugin is refused, with why
        kubelet.stub(GPU).Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[gpu0])])
        )
    assert (
        refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "keep their previous configuration" in refused.value.details()
    )
    text = generate_latest(plugin.daemon.registry).decode()
    assert (
        "gpushare_config_pending_gpus 1.0" in text
        and f'gpushare_gpu_config_pending{{gpu="0",model="Tesla T4",uuid="{gpu0}"}} 1.0' in text
    )
    assert plugin.daemon.manager.shapes.deferred == 1
    plugin.release(whole)
    assert kubelet.wait_for(lambda st: st[SHARE].allocatable == 8 and not st[GPU].registered, timeout=10), (
        kubelet.resources(),
        plugin.pending(),
    )
    assert wait_until(lambda: plugin.pending() == {})
    assert len(plugin.fill(SHARE, 1, 5)) == 4
    assert overcommitted(kubelet, plugin.node) == []


def test_repool_to_whole_never_puts_a_whole_gpu_pod_beside_share_tenants(plugin, kubelet):
    plugin.fill(SHARE, 1, 4)
    gpu0, gpu1 = (g.uuid for g in plugin.node.gpus)
    plugin.reload(ALL_WHOLE)
    assert plugin.admit(GPU, 1) is not None, plugin.refusal  # GPU 0, which was already whole
    assert plugin.admit(GPU, 1) is None  # GPU 1 is held by four share tenants
    assert overcommitted(kubelet, plugin.node) == []
    assert list(plugin.pending()) == [gpu1]
    assert kubelet.wait_for(
        lambda st: st[GPU].allocatable == 1 and st[SHARE].capacity == 4 and st[SHARE].allocatable == 0, timeout=5
    )


def test_shrinking_replicas_while_high_shares_are_held_promises_no_more_than_the_gpu(plugin, kubelet):
    plugin.reload([{"name": "shared", "mode": "shared", "replicas": 4}])
    assert kubelet.wait_for(lambda st: st[SHARE].allocatable == 8, timeout=5)
    pods = plugin.fill(SHARE, 1, 4)  # binpack: all four shares of one GPU
    held_gpu = plugin.gpu_of(pods[0])
    for pod in pods[:2]:
        plugin.release(pod)  # shares 2 and 3 stay held (or any two of them)
    plugin.reload([{"name": "shared", "mode": "shared", "replicas": 2}])
    plugin.fill(SHARE, 1, 4)
    assert (
        overcommitted(kubelet, plugin.node) == []
    )  # 2 of 4 held + nothing new on that GPU, not 2 x 3,840 + 2 x 7,680 MiB
    assert list(plugin.pending()) == [held_gpu]


def test_profile_switch_with_held_devices_waits_like_a_reload(plugin, kubelet):
    plugin.write([])
    plugin.config.write_text(
        yaml.safe_dump(
            {
                "version": "v1",
                "defaultProfile": "mixed",
                "profiles": {"mixed": {"pools": WHOLE_AND_SHARED}, "shared": {"pools": ALL_SHARED}},
            }
        )
    )
    daemon = plugin.daemon
    assert daemon is not None
    daemon.reloader.check()
    daemon.reloader.check()
    whole = plugin.admit(GPU, 1)
    assert whole is not None
    daemon.reloader.profiles.flag = "shared"  # as a new node label would
    assert daemon.reloader.check()
    plugin.settle()
    plugin.fill(SHARE, 1, 8)
    assert overcommitted(kubelet, plugin.node) == []
    assert list(plugin.pending()) == [plugin.node.gpus[0].uuid]


def test_a_restart_after_a_crash_keeps_held_gpus_in_the_shape_they_were_granted(plugin, kubelet):
    plugin.admit(GPU, 1)
    plugin.fill(SHARE, 1, 2)
    plugin.stop()  # the plugin is gone; the kubelet keeps its allocations (and its checkpoint)
    plugin.write([{"name": "shared", "mode": "shared", "replicas": 8}])
    plugin.start()
    plugin.fill(SHARE, 1, 16)
    plugin.fill(GPU, 1, 2)
    assert overcommitted(kubelet, plugin.node) == []
    assert len(plugin.pending()) == 2  # GPU 0 held whole, GPU 1 held in shares of 4


def test_a_restart_with_the_kubelet_down_reads_the_checkpoint(plugin, kubelet):
    plugin.admit(GPU, 1)
    plugin.stop()
    kubelet.stop()  # pod-resources is gone too: the checkpoint alone says what is held
    plugin.write(ALL_SHARED)
    plugin.start(settle=False)
    kubelet.start()
    plugin.settle()
    plugin.fill(SHARE, 1, 8)
    assert overcommitted(kubelet, plugin.node) == []
    assert list(plugin.pending()) == [plugin.node.gpus[0].uuid]


def test_random_sequences_of_reloads_restarts_and_pods_never_overcommit(plugin, kubelet):
    """The randomised sequence test (docs/operations.md): reloads across pool layouts and replica counts, plugin
    restarts with a changed config, kubelet restarts, pods admitted and deleted; after every step the kubelet's
    allocations hand no GPU out twice."""
    rng = random.Random(21)
    layouts = [
        WHOLE_AND_SHARED,
        ALL_SHARED,
        ALL_WHOLE,
        [{"name": "shared", "mode": "shared", "replicas": 2}],
        [
            {"name": "shared", "mode": "shared", "replicas": 3, "gpus": {"indexes": [0]}},
            {"name": "whole", "mode": "exclusive", "gpus": {"indexes": [1]}},
        ],
    ]
    for step in range(40):
        action = rng.choice(["reload", "reload", "admit", "admit", "admit", "delete", "restart", "kubelet"])
        if action == "reload":
            plugin.reload(rng.choice(layouts))
        elif action == "admit":
            plugin.fill(rng.choice([GPU, SHARE]), rng.choice([1, 1, 2]), 3)
        elif action == "delete" and plugin.pods:
            plugin.release(rng.choice(plugin.pods))
        elif action == "restart":
            plugin.stop()
            plugin.write(rng.choice(layouts))
            plugin.start()
        elif action == "kubelet":
            kubelet.restart()
        assert overcommitted(kubelet, plugin.node) == [], f"step {step}: {action}"


def test_a_grant_the_kubelet_has_not_recorded_yet_still_pins_its_gpu(plugin, kubelet):
    """The moment between Allocate's answer and the kubelet's record of it: a grant counts as a hold for
    grant_window (1 s) — here an Allocate the kubelet never records, so after that the GPU switches."""
    gpu0 = plugin.node.gpus[0].uuid
    kubelet.stub(GPU).Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[gpu0])]))
    plugin.reload(ALL_SHARED)
    pending = plugin.pending()
    assert list(pending) == [gpu0] and "a container granted just now" in pending[gpu0]
    assert wait_until(lambda: plugin.pending() == {}, timeout=5)
    assert kubelet.wait_for(lambda st: st[SHARE].allocatable == 8, timeout=5)


def test_allocate_answers_are_remembered_for_the_grant_window_not_by_count(plugin, kubelet):
    """Only the last grant_window of Allocate answers is ever read, so only that is kept: an older answer is dropped
    by the next Allocate."""
    gpu0 = plugin.node.gpus[0].uuid
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[gpu0])])
    kubelet.stub(GPU).Allocate(request)
    assert plugin.daemon is not None
    server = next(s for s in plugin.daemon.manager.servers if s.resource.name == GPU)
    first = server.recent_grants[0][0]
    assert wait_until(lambda: time.monotonic() > first + server.timings.grant_window, timeout=5)
    kubelet.stub(GPU).Allocate(request)
    assert len(server.recent_grants) == 1 and server.recent_grants[0][0] > first


def test_random_sequences_of_profile_label_switches_and_profile_edits_never_overcommit(plugin, kubelet):
    """The randomised sequence test over profiles: the node label (here the profile source) switching between
    layouts, the ConfigMap's profiles edited under it, plugin and kubelet restarts, pods admitted and deleted."""
    rng = random.Random(7)
    layouts = [WHOLE_AND_SHARED, ALL_SHARED, ALL_WHOLE, [{"name": "shared", "mode": "shared", "replicas": 2}]]
    daemon = plugin.daemon
    assert daemon is not None

    def write_profiles() -> None:
        order = rng.sample(range(len(layouts)), len(layouts))
        plugin.config.write_text(
            yaml.safe_dump(
                {
                    "version": "v1",
                    "defaultProfile": "p0",
                    "profiles": {f"p{i}": {"pools": layouts[j]} for i, j in enumerate(order)},
                }
            )
        )

    write_profiles()
    daemon.reloader.check()
    daemon.reloader.check()
    for step in range(30):
        action = rng.choice(["label", "label", "edit", "admit", "admit", "admit", "delete", "restart", "kubelet"])
        daemon = plugin.daemon
        assert daemon is not None
        if action == "label":
            daemon.reloader.profiles.flag = rng.choice(["p0", "p1", "p2", "p3"])
            daemon.reloader.check()
        elif action == "edit":
            write_profiles()
            daemon.reloader.check()
            daemon.reloader.check()
        elif action == "admit":
            plugin.fill(rng.choice([GPU, SHARE]), rng.choice([1, 1, 2]), 3)
        elif action == "delete" and plugin.pods:
            plugin.release(rng.choice(plugin.pods))
        elif action == "restart":
            flag = daemon.reloader.profiles.flag
            plugin.stop()
            write_profiles()
            plugin.start()
            assert plugin.daemon is not None
            plugin.daemon.reloader.profiles.flag = flag
            plugin.daemon.reloader.check()
        elif action == "kubelet":
            kubelet.restart()
        plugin.settle()
        assert overcommitted(kubelet, plugin.node) == [], f"step {step}: {action}"


def test_an_init_container_that_pod_resources_omits_still_pins_its_gpu(plugin, kubelet):
    """Ordinary init containers are in the kubelet's checkpoint, never in pod-resources: the checkpoint's holders
    count."""
    pod = Pod("with-init", [Container("c", {})], init_containers=[Container("setup", {GPU: 1})])
    kubelet.admit(pod)
    assert not any(p.name == "with-init" and p.containers[0].devices for p in kubelet.pod_resources())
    plugin.reload(ALL_SHARED)
    plugin.fill(SHARE, 1, 8)
    assert overcommitted(kubelet, plugin.node) == []
    assert list(plugin.pending()) == [plugin.node.gpus[0].uuid]


def _rewrite_checkpoint(kubelet: KubeletSimulator, change) -> None:
    path = kubelet.plugin_dir / "kubelet_internal_checkpoint"
    path.write_text(change(path.read_text()))


def test_a_share_count_that_does_not_parse_keeps_its_gpu_across_a_restart(plugin, kubelet):
    """`GPU_SHARE_TOTAL="²"` passes isdigit() and fails int(): once that made start-up serve the whole new plan."""
    plugin.fill(SHARE, 1, 2)
    plugin.stop()
    entries = None

    def superscript(text: str) -> str:
        nonlocal entries
        data = json.loads(text)
        entries = data["Data"]["PodDeviceEntries"]
        for entry in entries:
            response = pb.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
            response.envs["GPU_SHARE_TOTAL"] = "²"
            entry["AllocResp"] = base64.b64encode(response.SerializeToString()).decode()
        return json.dumps(data)

    _rewrite_checkpoint(kubelet, superscript)
    assert entries
    plugin.write([{"name": "shared", "mode": "shared", "replicas": 8}])
    plugin.start()
    plugin.fill(SHARE, 1, 16)
    plugin.fill(GPU, 1, 2)
    assert overcommitted(kubelet, plugin.node) == []
    assert plugin.node.gpus[1].uuid in plugin.pending()  # held in shares of a count nobody can read: kept


def test_holds_that_cannot_be_read_serve_nothing_until_a_source_answers(plugin, kubelet):
    """pod-resources down and the checkpoint truncated: unknown, never empty; nothing is served until the kubelet is
    back."""
    plugin.admit(GPU, 1)
    plugin.stop()
    kubelet.stop()
    _rewrite_checkpoint(kubelet, lambda text: text[: len(text) // 2])
    plugin.write(ALL_SHARED)
    daemon = plugin.start(settle=False)
    assert daemon.manager.servers == [] and daemon.manager.shapes.unreadable_holds >= 1
    kubelet.start()  # its first checkpoint write is whole again, and pod-resources answers
    assert wait_until(lambda: daemon.manager.servers != [], timeout=10)
    plugin.settle()
    plugin.fill(SHARE, 1, 8)
    assert overcommitted(kubelet, plugin.node) == []
    assert list(plugin.pending()) == [plugin.node.gpus[0].uuid]

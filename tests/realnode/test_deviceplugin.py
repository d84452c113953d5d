"""The device plugin beside a real kubelet v1.36 and containerd: what reaches the container, the node agent's
metrics and memory watchdog, restarts. The GPUs are the project's fake NVML (tests/realnode/fake_nvml_run.py)."""

from __future__ import annotations

import json
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.realnode.fake_nvml_run import T4_MIB, UUIDS
from tests.support.realnode import RealNode, delete_pod, wait_for

RESOURCE = "example.com/gpu-share"
ROOT = Path(__file__).resolve().parents[2]


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


class Plugin:
    def __init__(self, node: RealNode, work: Path, config: dict[str, Any]) -> None:
        self.node, self.work = node, work
        self.processes = work / "processes.json"
        self.processes.write_text("{}")
        self.config = work / "config.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.port = 0
        self.proc: Any = None

    def start(self) -> None:
        from tests.conftest import free_port

        self.port = free_port()
        self.proc = self.node.nsexec(
            sys.executable,
            "-m",
            "tests.realnode.fake_nvml_run",
            str(self.processes),
            "run",
            "--config",
            str(self.config),
            "--kubeconfig",
            str(self.node.cp.admin_kubeconfig),
            "--metrics-port",
            str(self.port),
            "--metrics-bind-address",
            "127.0.0.1",
            "--pod-resources-interval",
            "0.2",
            "--health-interval",
            "0.2",
            "--reload-interval",
            "0.2",
            log=self.work / "plugin.log",
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.node.stop_process(self.proc)

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        try:
            return [(labels, value) for n, labels, value in scrape(self.port) if n == name]
        except OSError:
            return []

    def log(self) -> str:
        return (self.work / "plugin.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def core(realnode: RealNode) -> client.CoreV1Api:
    return client.CoreV1Api(realnode.cp.api_client())


@pytest.fixture(scope="module")
def namespace(core: client.CoreV1Api) -> str:
    name = f"rn-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})
    return name


def config(policy: str, replicas: int = 10) -> dict[str, Any]:
    return {
        "version": "v1",
        "memoryWatchdog": {"policy": policy},
        "pools": [{"name": "default", "mode": "shared", "resource": "gpu-share", "replicas": replicas}],
    }


@pytest.fixture(scope="module")
def plugin(realnode: RealNode, tmp_path_factory: pytest.TempPathFactory, core: client.CoreV1Api) -> Iterator[Plugin]:
    work = tmp_path_factory.mktemp("plugin")
    p = Plugin(realnode, work, config("report"))
    p.start()

    def allocatable() -> bool:
        return core.read_node(realnode.name).status.allocatable.get(RESOURCE) == "20"

    wait_for(allocatable, 60)
    yield p
    p.stop()


def pod_spec(name: str, shares: int, command: str = "env; sleep 3600", **extra: Any) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": "local/busybox:1.35",
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", command],
        "resources": {"limits": {RESOURCE: str(shares)}},
    }
    return {
        "metadata": {"name": name},
        "spec": {
            "containers": [container],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            **extra,
        },
    }


def run_pod(
    core: client.CoreV1Api, realnode: RealNode, namespace: str, name: str, shares: int, command: str = "env; sleep 3600"
) -> client.V1Pod:
    body = pod_spec(name, shares, command, nodeName=realnode.name)
    core.create_namespaced_pod(namespace, body)

    def running() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name, namespace)
        assert pod.status.phase not in ("Failed", "Succeeded"), pod.status
        return pod if pod.status.phase == "Running" else None

    return wait_for(running, 60)


def container_pid(realnode: RealNode, pod: client.V1Pod) -> int:
    """The PID of the pod's first container (not its sandbox's pause): its cgroup (cgroupfs, under the node's
    cgroupRoot) is named after the container ID."""
    root = (realnode.node_dir / "cgroup-root").read_text().strip()
    container_id = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    for procs in Path("/sys/fs/cgroup").glob(f"*{root}/kubepods/**/pod{pod.metadata.uid}/{container_id}/cgroup.procs"):
        pids = procs.read_text().split()
        if pids:
            return int(pids[0])
    raise AssertionError(f"no process in the cgroup of container {container_id}")


def env_of(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, str]:
    text = core.read_namespaced_pod_log(name, namespace)  # through the kubelet: the API server's client cert works
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_three_shares_reach_the_container_as_one_gpu(realnode, core, namespace, plugin):
    run_pod(core, realnode, namespace, "three", 3)
    env = wait_for(lambda: (e := env_of(core, namespace, "three")) and "GPU_SHARE_COUNT" in e and e, 30)
    assert env["GPU_SHARE_COUNT"] == "3"
    assert env["NVIDIA_VISIBLE_DEVICES"] in UUIDS
    delete_pod(core, namespace, "three")


def test_the_kubelets_checkpoint_has_the_shape_the_built_in_kubelet_writes_and_the_plugin_reads(
    realnode, core, namespace, plugin
):
    import base64

    from deviceplugin.agent.holds import CHECKPOINT, read_checkpoint
    from deviceplugin.api import deviceplugin_pb2 as pb

    pod = run_pod(core, realnode, namespace, "checkpointed", 3)
    path = realnode.node_dir / "kubelet" / "device-plugins" / CHECKPOINT
    data = json.loads(path.read_text())
    assert set(data) == {"Data", "Checksum"} and isinstance(data["Checksum"], int)
    assert set(data["Data"]) == {"PodDeviceEntries", "RegisteredDevices"}
    assert sorted(data["Data"]["RegisteredDevices"][RESOURCE]) == sorted(f"{u}::{k}" for u in UUIDS for k in range(10))
    (entry,) = [e for e in data["Data"]["PodDeviceEntries"] if e["PodUID"] == pod.metadata.uid]
    assert set(entry) == {"PodUID", "ContainerName", "ResourceName", "DeviceIDs", "AllocResp"}
    assert (entry["ContainerName"], entry["ResourceName"]) == ("main", RESOURCE)
    (ids,) = entry["DeviceIDs"].values()
    assert list(entry["DeviceIDs"]) == ["-1"] and len(ids) == 3  # no topology: NUMA node -1
    response = pb.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
    assert response.envs["GPU_SHARE_COUNT"] == "3"  # the plugin's own Allocate answer, kept by the kubelet
    holds = read_checkpoint(path, lambda unit: unit in UUIDS)  # the plugin's reader takes the real file
    assert sorted(device for (_, device), hold in holds.items() if hold.pod_uid == pod.metadata.uid) == sorted(ids)
    delete_pod(core, namespace, "checkpointed")


def test_a_container_of_three_shares_is_one_series_of_three_with_a_three_share_limit(realnode, core, namespace, plugin):
    pod = run_pod(core, realnode, namespace, "metered", 3)

    def mine(name: str) -> list[tuple[dict[str, str], float]]:
        return [(labels, value) for labels, value in plugin.series(name) if labels.get("pod") == "metered"]

    shares = wait_for(lambda: mine("gpushare_container_shares"), 30)
    assert [value for _, value in shares] == [3.0], shares
    limits = wait_for(lambda: mine("gpushare_container_memory_limit_bytes"), 30)
    assert [value for _, value in limits] == [3 * T4_MIB // 10 * 1024 * 1024], limits
    delete_pod(core, namespace, "metered")
    wait_for(lambda: not mine("gpushare_container_shares"), 30)
    assert pod.metadata.uid


def test_the_watchdog_leaves_a_container_under_its_limit_and_kills_one_over_it(realnode, core, namespace, plugin):
    under = run_pod(core, realnode, namespace, "under", 3, "sleep 3600")
    over = run_pod(core, realnode, namespace, "over", 1, "sleep 3600")
    table: dict[str, list[list[int]]] = {u: [] for u in UUIDS}

    def both() -> dict[str, str] | None:
        gpus = {
            labels["pod"]: labels["uuid"]
            for labels, _ in plugin.series("gpushare_container_shares")
            if labels["pod"] in ("under", "over")
        }
        return gpus if len(gpus) == 2 else None

    gpu_of = wait_for(both, 30)
    under_pid, over_pid = container_pid(realnode, under), container_pid(realnode, over)
    table[gpu_of["under"]].append([under_pid, 3000])  # 3000 MiB of its 3 x 1536
    table[gpu_of["over"]].append([over_pid, 3000])  # 3000 MiB of its 1 x 1536
    plugin.processes.write_text(json.dumps(table))

    def over_limit() -> dict[str, float]:
        return {
            labels["pod"]: value
            for labels, value in plugin.series("gpushare_container_over_limit")
            if labels["pod"] in ("under", "over")
        }

    wait_for(lambda: over_limit().get("over") == 1.0, 30)  # policy report: reported...
    assert over_limit().get("under", 0.0) == 0.0
    assert core.read_namespaced_pod("over", namespace).status.container_statuses[0].state.running  # ...not killed

    def over_terminated() -> client.V1ContainerStateTerminated | None:
        status = core.read_namespaced_pod("over", namespace).status
        return status.container_statuses and status.container_statuses[0].state.terminated

    plugin.config.write_text(yaml.safe_dump(config("kill")))  # applied by the hot reload
    terminated = wait_for(over_terminated, 60)
    assert terminated.exit_code == 137
    under_now = core.read_namespaced_pod("under", namespace).status
    assert under_now.phase == "Running" and under_now.container_statuses[0].restart_count == 0
    assert over_limit().get("under", 0.0) == 0.0
    assert not [line for line in plugin.log().splitlines() if "/under/" in line and "over the" in line]
    plugin.config.write_text(yaml.safe_dump(config("report")))
    plugin.processes.write_text("{}")
    delete_pod(core, namespace, "under")
    delete_pod(core, namespace, "over")


def test_a_kubelet_restart_keeps_the_running_pod_and_the_plugin_registers_again(realnode, core, namespace, plugin):
    pod = run_pod(core, realnode, namespace, "survivor", 2)
    old = realnode.kubelet_pid()
    realnode.script("restart.sh", "kubelet")
    assert realnode.kubelet_pid() != old
    sock = realnode.node_dir / "kubelet" / "device-plugins"
    wait_for(lambda: any(p.name != "kubelet.sock" and p.is_socket() for p in sock.iterdir()), 30)
    wait_for(lambda: core.read_node(realnode.name).status.allocatable.get(RESOURCE) == "20", 60)
    again = core.read_namespaced_pod("survivor", namespace)
    assert again.status.phase == "Running" and again.status.container_statuses[0].restart_count == 0
    assert again.metadata.uid == pod.metadata.uid
    delete_pod(core, namespace, "survivor")


def test_a_plugin_restart_keeps_the_running_pod_and_its_gpu(realnode, core, namespace, plugin):
    run_pod(core, realnode, namespace, "kept", 2)

    def gpu() -> str | None:
        return next(
            (labels["uuid"] for labels, _ in plugin.series("gpushare_container_shares") if labels["pod"] == "kept"),
            None,
        )

    before = wait_for(gpu, 30)
    plugin.stop()
    plugin.start()
    assert wait_for(gpu, 30) == before
    wait_for(lambda: core.read_node(realnode.name).status.allocatable.get(RESOURCE) == "20", 60)
    status = core.read_namespaced_pod("kept", namespace).status
    assert status.phase == "Running" and status.container_statuses[0].restart_count == 0
    delete_pod(core, namespace, "kept")


def test_a_reload_leaves_alone_the_gpu_an_init_container_holds(realnode, core, namespace, plugin):
    """The real kubelet leaves init containers out of pod-resources: the holders come from its checkpoint too."""
    body = pod_spec("initholder", 0, "sleep 3600", nodeName=realnode.name)
    main = body["spec"]["containers"][0]
    main.pop("resources")
    body["spec"]["initContainers"] = [{**main, "name": "init", "resources": {"limits": {RESOURCE: "2"}}}]
    core.create_namespaced_pod(namespace, body)

    def init_running() -> bool:
        statuses = core.read_namespaced_pod("initholder", namespace).status.init_container_statuses or []
        return bool(statuses and statuses[0].state.running)

    wait_for(init_running, 60)

    def pending() -> float | None:
        values = [value for _, value in plugin.series("gpushare_config_pending_gpus")]
        return values[0] if values else None

    # A restart forgets Allocate's recent grants (held for a second, before the kubelet records them): from here the
    # holders come only from what the kubelet says.
    plugin.stop()
    plugin.start()
    wait_for(lambda: pending() == 0.0, 30)
    plugin.config.write_text(yaml.safe_dump(config("report", replicas=4)))  # a new shape for both GPUs
    try:
        capacity = wait_for(
            lambda: (c := core.read_node(realnode.name).status.capacity.get(RESOURCE)) in ("8", "14") and c, 60
        )
        assert capacity == "14", (
            "the GPU the init container holds switched to 4 shares"
        )  # one switched, the held one waits
        assert pending() == 1.0
        assert init_running()
        delete_pod(core, namespace, "initholder")
        wait_for(
            lambda: pending() == 0.0 and core.read_node(realnode.name).status.allocatable.get(RESOURCE) == "8", 60
        )  # released: it switches
    finally:
        delete_pod(core, namespace, "initholder")
        plugin.config.write_text(yaml.safe_dump(config("report")))
        wait_for(lambda: core.read_node(realnode.name).status.allocatable.get(RESOURCE) == "20", 60)


def test_deleted_pods_free_their_shares(realnode, core, namespace, plugin):
    """Every test above deleted its pods: two pods of a whole GPU's 10 shares each both start."""
    run_pod(core, realnode, namespace, "full-a", 10)
    run_pod(core, realnode, namespace, "full-b", 10)
    gpus = {
        wait_for(lambda n=n: env_of(core, namespace, n).get("NVIDIA_VISIBLE_DEVICES"), 30) for n in ("full-a", "full-b")
    }
    assert gpus == set(UUIDS)
    delete_pod(core, namespace, "full-a")
    delete_pod(core, namespace, "full-b")

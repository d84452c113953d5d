"""What each kind of device-plugin resource hands a container on a real kubelet v1.36 + containerd + runc: a whole
GPU, a MIG instance and MPS shares (pipe and /dev/shm mounted), with `deviceSpecs` device nodes made by runc and
allowed by the devices cgroup. The GPUs are the project's fake NVML (`FAKE_NVML_NODE=kinds`: a T4, an A100 in MIG
mode with two 3g.40gb instances, a T4); the device nodes are character devices 1:3 (what /dev/null is) made under
the config's `deviceRoot`, so a write to one in the container succeeds only where the cgroup allows it."""

from __future__ import annotations

import os
import stat
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.realnode.fake_nvml_run import KINDS, MIGS, T4_MIB
from tests.support.realnode import RealNode, delete_pod, wait_for

ROOT = Path(__file__).resolve().parents[2]
NODES = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia0",
    "/dev/nvidia1",
    "/dev/nvidia2",
    "/dev/nvidia-caps/nvidia-cap21",
    "/dev/nvidia-caps/nvidia-cap22",
    "/dev/nvidia-caps/nvidia-cap30",
    "/dev/nvidia-caps/nvidia-cap31",
)
CAPS = {
    1: ("nvidia-cap21", "nvidia-cap22"),
    2: ("nvidia-cap30", "nvidia-cap31"),
}  # MIG GI -> (its GI node, its CI 0 node)
# For each node: rw where it is a character device the container may write, present where it exists but is not
# one (or the write is refused), absent where it does not exist at all.
PROBE = " ".join(
    f"""if [ -c {p} ] && echo x > {p}; then echo "NODE {p}=rw"; elif [ -e {p} ]; then echo "NODE {p}=present"; \
else echo "NODE {p}=absent"; fi;"""
    for p in NODES
)


def make_driver_root(root: Path) -> None:
    """/dev nodes and /proc/driver/nvidia/capabilities as the NVIDIA driver lays them out, for GPU minors 0-2 and
    the MIG instances (GI 1 and 2, CI 0) of GPU 1."""
    for path in NODES:
        node = root / path.lstrip("/")
        node.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    for gi, (gi_cap, ci_cap) in CAPS.items():
        base = root / "proc/driver/nvidia/capabilities/gpu1/mig" / f"gi{gi}"
        (base / "ci0").mkdir(parents=True)
        (base / "access").write_text(
            f"DeviceFileMinor: {gi_cap.removeprefix('nvidia-cap')}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
        )
        (base / "ci0" / "access").write_text(
            f"DeviceFileMinor: {ci_cap.removeprefix('nvidia-cap')}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
        )


class Node:
    """The plugin and the MPS supervisor (`gpu-share mps`, the simulated control daemon) on the fake NVML."""

    def __init__(self, node: RealNode, work: Path) -> None:
        self.node, self.work = node, work
        make_driver_root(work / "driver")
        (work / "processes.json").write_text("{}")
        self.mps_root = work / "mps"
        config = {
            "version": "v1",
            "deviceSpecs": True,
            "deviceRoot": str(work / "driver"),
            "mpsRoot": str(self.mps_root),
            "pools": [
                {"name": "whole", "mode": "exclusive", "gpus": {"indexes": [0]}},
                {"name": "mig", "mode": "mig", "gpus": {"indexes": [1]}},
                {
                    "name": "mps",
                    "mode": "shared",
                    "backend": "mps",
                    "mpsLimits": "proportional",
                    "replicas": 4,
                    "resource": "mps-share",
                    "gpus": {"indexes": [2]},
                },
            ],
        }
        (work / "config.yaml").write_text(yaml.safe_dump(config))
        control = work / "nvidia-cuda-mps-control"
        control.write_text(f"#!{sys.executable}\n" + (ROOT / "deviceplugin" / "sim" / "mps_control.py").read_text())
        control.chmod(0o755)
        wrapper = (sys.executable, "-m", "tests.realnode.fake_nvml_run", str(work / "processes.json"))
        env = {"FAKE_NVML_NODE": "kinds"}
        self.mps = node.nsexec(
            *wrapper,
            "mps",
            "--config",
            str(work / "config.yaml"),
            "--mps-control",
            str(control),
            "--kubeconfig",
            str(node.cp.admin_kubeconfig),
            log=work / "mps.log",
            env=env,
        )
        self.plugin = node.nsexec(
            *wrapper,
            "run",
            "--config",
            str(work / "config.yaml"),
            "--kubeconfig",
            str(node.cp.admin_kubeconfig),
            "--mps-control",
            str(control),
            "--metrics-port",
            "0",
            "--health-interval",
            "0.2",
            log=work / "plugin.log",
            env=env,
        )

    def stop(self) -> None:
        self.node.stop_process(self.plugin)
        self.node.stop_process(self.mps)

    def log(self) -> str:
        return "\n".join((self.work / f).read_text(errors="replace")[-4000:] for f in ("plugin.log", "mps.log"))


@pytest.fixture(scope="module")
def core(realnode: RealNode) -> client.CoreV1Api:
    return client.CoreV1Api(realnode.cp.api_client())


@pytest.fixture(scope="module")
def namespace(core: client.CoreV1Api) -> str:
    name = f"rn-kinds-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})
    return name


@pytest.fixture(scope="module")
def kinds(realnode: RealNode, core: client.CoreV1Api, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = Node(realnode, tmp_path_factory.mktemp("kinds"))
    wanted = {"example.com/gpu": "1", "example.com/mig-3g.40gb": "2", "example.com/mps-share": "4"}

    def advertised() -> bool:
        allocatable = core.read_node(realnode.name).status.allocatable
        return all(allocatable.get(k) == v for k, v in wanted.items())

    try:
        wait_for(advertised, 60)
    except TimeoutError:
        node.stop()
        raise AssertionError(
            f"not advertised: {core.read_node(realnode.name).status.allocatable}\n{node.log()}"
        ) from None
    yield node
    node.stop()


def run(
    core: client.CoreV1Api, realnode: RealNode, namespace: str, name: str, resource: str, count: int, command: str
) -> dict[str, str]:
    """Run a pod of `count` of `resource` that prints its env and `command`'s output; return what it printed (lines
    of KEY=VALUE, the `NODE <path>` probes included) once it has printed it."""
    container = {
        "name": "main",
        "image": "local/busybox:1.35",
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", f"env; {command} echo DONE=1; sleep 3600"],
        "resources": {"limits": {resource: str(count)}},
    }
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": name},
            "spec": {
                "nodeName": realnode.name,
                "containers": [container],
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": False,
            },
        },
    )

    def printed() -> dict[str, str] | None:
        pod = core.read_namespaced_pod(name, namespace)
        assert pod.status.phase not in ("Failed", "Succeeded"), pod.status
        if pod.status.phase != "Running":
            return None
        lines = core.read_namespaced_pod_log(name, namespace).splitlines()
        found = dict(line.removeprefix("NODE ").split("=", 1) for line in lines if "=" in line)
        return found if found.get("DONE") == "1" else None

    return wait_for(printed, 60)


def nodes(out: dict[str, str]) -> dict[str, str]:
    return {p: out[p] for p in NODES}


def test_a_whole_gpu_gets_its_uuid_and_only_its_device_nodes(realnode, core, namespace, kinds):
    out = run(core, realnode, namespace, "whole", "example.com/gpu", 1, PROBE)
    assert out["NVIDIA_VISIBLE_DEVICES"] == KINDS[0]
    assert nodes(out) == {
        **dict.fromkeys(NODES, "absent"),
        **dict.fromkeys(("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0"), "rw"),
    }
    delete_pod(core, namespace, "whole")


def test_a_mig_instance_gets_its_uuid_its_gpu_node_and_its_own_capability_nodes(realnode, core, namespace, kinds):
    out = run(core, realnode, namespace, "mig", "example.com/mig-3g.40gb", 1, PROBE)
    assert out["NVIDIA_VISIBLE_DEVICES"] in MIGS
    gi = MIGS.index(out["NVIDIA_VISIBLE_DEVICES"]) + 1
    granted = (
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia1",
        *(f"/dev/nvidia-caps/{c}" for c in CAPS[gi]),
    )
    assert nodes(out) == {**dict.fromkeys(NODES, "absent"), **dict.fromkeys(granted, "rw")}
    delete_pod(core, namespace, "mig")


def test_mps_shares_get_their_limits_the_daemon_pipe_and_the_pools_shm(realnode, core, namespace, kinds):
    probe = (
        'if [ -p "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then echo PIPE=fifo; else echo PIPE=none; fi; '
        "echo pod > /dev/shm/from-the-pod && echo SHM=written;"
    )
    out = run(core, realnode, namespace, "mps", "example.com/mps-share", 2, probe + PROBE)
    assert out["NVIDIA_VISIBLE_DEVICES"] == KINDS[2]
    assert out["CUDA_MPS_PIPE_DIRECTORY"] == str(kinds.mps_root / "mps" / "pipe")
    assert out["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"  # 2 of 4 shares
    assert out["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={2 * T4_MIB // 4}M"
    assert out["PIPE"] == "fifo", kinds.log()  # the supervised daemon's control FIFO, through the plugin's mount
    assert (
        out["SHM"] == "written" and (kinds.mps_root / "mps" / "shm" / "from-the-pod").read_text() == "pod\n"
    )  # the pool's /dev/shm
    assert out["/dev/nvidia2"] == "rw" and out["/dev/nvidia0"] == "absent"
    delete_pod(core, namespace, "mps")

"""The DRA driver (`gpu-share run --api dra`, a simulated node) beside a real kubelet v1.36 and containerd: claims
for shares, memory, a whole GPU, a MIG instance, MPS shares and a mapped extended resource, prepared by the real
kubelet, their CDI specs injected by containerd, unprepared on delete; a ResourceClaimTemplate through the real
kube-controller-manager; an MPS daemon's death in the pod's allocatedResourcesStatus; restarts."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.support.kubeobjects import request
from tests.support.realnode import RealNode, delete_pod, dra_cluster, wait_for

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER = "gpu-share-realnode"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
DRIVER = "gpu-share.example.com"
T4_MIB = 15360
UUID = "GPU-6d1e0f3a-4b2c-4e5d-9f60-00000000000{}"
MIGS = ("MIG-6d1e0f3a-0003-5b2a-8e4f-000000000001", "MIG-6d1e0f3a-0003-5b2a-8e4f-000000000002")


def t4(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": UUID.format(index),
        "model": "Tesla T4",
        "memoryMiB": T4_MIB,
        "numaNode": 0,
        "pciBusId": f"0000:{0x3B + index:02x}:00.0",
        "computeCapability": "7.5",
    }


# GPUs 0-1 in ten time-sliced shares, 2 whole, 3 an A100 of two 3g.40gb MIG instances, 4 in four MPS shares.
NODE = {
    "name": "realnode-dra",
    "driverVersion": "550.54.15",
    "cudaDriverVersion": "12.4",
    "gpus": [
        t4(0),
        t4(1),
        t4(2),
        {
            "index": 3,
            "uuid": UUID.format(3),
            "model": "NVIDIA A100-SXM4-80GB",
            "memoryMiB": 81920,
            "numaNode": 0,
            "pciBusId": "0000:3e:00.0",
            "computeCapability": "8.0",
            "mig": [
                {"uuid": u, "profile": "3g.40gb", "memoryMiB": 40192, "giId": gi, "ciId": 0}
                for gi, u in enumerate(MIGS, 1)
            ],
        },
        t4(4),
    ],
}
POOLS = [
    {"name": "default", "mode": "shared", "resource": "gpu-share", "replicas": 10, "gpus": {"indexes": [0, 1]}},
    {"name": "whole", "mode": "exclusive", "gpus": {"indexes": [2]}},
    {"name": "mig", "mode": "mig", "gpus": {"indexes": [3]}},
    {
        "name": "mps",
        "mode": "shared",
        "backend": "mps",
        "mpsLimits": "proportional",
        "replicas": 4,
        "resource": "mps-share",
        "gpus": {"indexes": [4]},
    },
]


class Driver:
    """The driver and the MPS supervisor (`gpu-share mps`) with the simulated control daemon, behind a wrapper that
    fails, as a daemon that cannot start does, while the file `broken` exists."""

    def __init__(self, node: RealNode, work: Path) -> None:
        self.node, self.work = node, work
        self.mps_root = work / "mps"
        self.config = work / "config.yaml"
        self.config.write_text(yaml.safe_dump({"version": "v1", "mpsRoot": str(self.mps_root), "pools": POOLS}))
        self.node_file = work / "node.yaml"
        self.node_file.write_text(yaml.safe_dump(NODE))
        self.broken = work / "broken"
        self.control = work / "nvidia-cuda-mps-control"
        self.control.write_text(
            f"#!/bin/sh\n[ -e {self.broken} ] && {{ echo 'cannot start (test)' >&2; exit 1; }}\n"
            f'PYTHONPATH={ROOT} exec {sys.executable} -m deviceplugin.sim.mps_control "$@"\n'
        )
        self.control.chmod(0o755)
        self.proc: Any = None
        self.mps = node.nsexec(
            sys.executable,
            "-m",
            "deviceplugin.cli",
            "mps",
            "--node",
            str(self.node_file),
            "--config",
            str(self.config),
            "--mps-control",
            str(self.control),
            "--kubeconfig",
            str(node.cp.admin_kubeconfig),
            "--backoff-max",
            "1",
            log=work / "mps.log",
        )

    def start(self) -> None:
        self.proc = self.node.nsexec(
            sys.executable,
            "-m",
            "deviceplugin.cli",
            "run",
            "--api",
            "dra",
            "--node",
            str(self.node_file),
            "--config",
            str(self.config),
            "--kubeconfig",
            str(self.node.cp.admin_kubeconfig),
            "--node-name",
            self.node.name,
            "--health-checks",
            "false",
            "--metrics-port",
            "0",
            "--pod-resources-interval",
            "0.2",
            "--mps-control",
            str(self.control),
            log=self.work / "driver.log",
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.node.stop_process(self.proc)
        self.node.stop_process(self.mps)

    def log(self) -> str:
        return "\n".join((self.work / f).read_text(errors="replace")[-4000:] for f in ("driver.log", "mps.log"))

    def registrations(self) -> int:
        """How many times a driver process of this test registered with the kubelet (its log, every start)."""
        return (self.work / "driver.log").read_text(errors="replace").count("registered with the kubelet as DRA driver")

    def mps_daemons(self) -> list[int]:
        """PIDs of the MPS pool's control daemon (`-f`, with its pipe directory in the environment)."""
        pipe = f"CUDA_MPS_PIPE_DIRECTORY={self.mps_root / 'mps' / 'pipe'}".encode()
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if (
                    proc.name.isdigit()
                    and b"-f" in (proc / "cmdline").read_bytes().split(b"\0")
                    and pipe in (proc / "environ").read_bytes().split(b"\0")
                ):
                    found.append(int(proc.name))
            except OSError:
                continue
        return found


@pytest.fixture(scope="module")
def api(realnode: RealNode) -> Any:
    return realnode.cp.api_client()


@pytest.fixture(scope="module")
def cluster(realnode: RealNode, api: Any) -> Iterator[str]:
    """The shipped DeviceClasses, a kube-scheduler of our own name, a namespace, and the real kube-controller-manager
    (its resourceclaim controller makes claims from templates, and releases a deleted claim's allocation: without
    it a deleted claim keeps its devices behind the scheduler's finalizer)."""
    with dra_cluster(realnode, SCHEDULER, "rn-dra") as ns:
        realnode.script("kcm.sh", "start")
        try:
            yield ns
        finally:  # never leave the controller manager running: later tests create what it would make
            realnode.script("kcm.sh", "stop")


@pytest.fixture(scope="module")
def driver(realnode: RealNode, api: Any, cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Driver]:
    d = Driver(realnode, tmp_path_factory.mktemp("dra"))
    d.start()

    def published() -> bool:
        found = request(
            api,
            "GET",
            "/apis/resource.k8s.io/v1/resourceslices",
            query=[("fieldSelector", f"spec.nodeName={realnode.name}")],
        )
        return {d["name"] for s in found["items"] for d in s["spec"].get("devices", [])} == {
            "gpu-0",
            "gpu-1",
            "gpu-2",
            "gpu-3-mig-1-0",
            "gpu-3-mig-2-0",
            "gpu-4",
        }

    try:
        wait_for(published, 60)
    except TimeoutError:
        d.stop()
        raise AssertionError(f"the driver did not publish the node's devices\n{d.log()}") from None
    yield d
    d.stop()


def shares(count: int | None = None, mode: str = "time-slicing", memory: str | None = None) -> dict[str, Any]:
    """A request for shares (or memory) of one GPU of the given mode."""
    requests = {k: v for k, v in (("shares", count and str(count)), ("memory", memory)) if v}
    return {
        "deviceClassName": "gpu-share-shares",
        "capacity": {"requests": requests},
        "selectors": [{"cel": {"expression": f"device.attributes[device.driver].mode == '{mode}'"}}],
    }


def claim_pod(
    api: Any,
    realnode: RealNode,
    ns: str,
    name: str,
    exactly: dict[str, Any] | None = None,
    template: str | None = None,
    limits: dict[str, str] | None = None,
    command: str = "env; sleep 3600",
) -> client.V1Pod:
    """A pod of one claim (`exactly`, made here; or from the ResourceClaimTemplate `template`) or of extended
    resources (`limits`), running."""
    claims: list[dict[str, str]] = []
    if exactly is not None:
        request(
            api,
            "POST",
            CLAIMS.format(ns=ns),
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
            },
        )
        claims = [{"name": "gpu", "resourceClaimName": name}]
    elif template is not None:
        claims = [{"name": "gpu", "resourceClaimTemplateName": template}]
    resources: dict[str, Any] = {"claims": [{"name": "gpu"}]} if claims else {"limits": limits}
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": name},
            "spec": {
                "schedulerName": SCHEDULER,
                "nodeSelector": {"kubernetes.io/hostname": realnode.name},
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": False,
                "resourceClaims": claims,
                "containers": [
                    {
                        "name": "main",
                        "image": "local/busybox:1.35",
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", command],
                        "resources": resources,
                    }
                ],
            },
        },
    )

    def running() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name, ns)
        assert pod.status.phase not in ("Failed", "Succeeded"), pod.status
        return pod if pod.status.phase == "Running" else None

    try:
        return wait_for(running, 90)
    except TimeoutError:
        events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
        raise AssertionError(
            f"pod {name} not running: {core.read_namespaced_pod(name, ns).status}\n"
            + "\n".join(f"{e.reason}: {e.message}" for e in events)
        ) from None


def claim_uid(api: Any, ns: str, pod: str) -> str:
    """The UID of the pod's claim: `gpu` (named in its status when it came from a template), or the one the
    scheduler made for its extended resources."""
    status = client.CoreV1Api(api).read_namespaced_pod(pod, ns).status
    extended = status.extended_resource_claim_status
    name = (
        extended.resource_claim_name
        if extended
        else next((s.resource_claim_name for s in status.resource_claim_statuses or [] if s.name == "gpu"), pod)
    )
    return request(api, "GET", CLAIMS.format(ns=ns) + f"/{name}")["metadata"]["uid"]


def cdi_spec(realnode: RealNode, uid: str) -> Path:
    return realnode.node_dir / "run" / "cdi" / f"{DRIVER}_{uid}.json"


def recorded(realnode: RealNode) -> set[str]:
    """The claim UIDs the driver's checkpoint holds records of (one file per claim under its plugin directory)."""
    return {p.stem for p in (realnode.node_dir / "kubelet" / "plugins" / DRIVER / "claims").glob("*.json")}


def env_of(api: Any, ns: str, name: str, key: str = "PATH") -> dict[str, str]:
    """What the pod's container printed as KEY=VALUE lines, once `key` is among them."""

    def printed() -> dict[str, str] | None:
        text = client.CoreV1Api(api).read_namespaced_pod_log(name, ns)
        found = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        return found if key in found else None

    return wait_for(printed, 30)


def delete(api: Any, ns: str, name: str) -> None:
    """Delete the pod and its claim, and wait until the claim is gone (its allocation released)."""
    delete_pod(client.CoreV1Api(api), ns, name)
    request(api, "DELETE", CLAIMS.format(ns=ns) + f"/{name}")
    wait_for(
        lambda: name not in {c["metadata"]["name"] for c in request(api, "GET", CLAIMS.format(ns=ns))["items"]}, 60
    )


def test_a_claim_of_three_shares_reaches_the_container_through_containerd_cdi(realnode, api, cluster, driver):
    claim_pod(api, realnode, cluster, "dra-three", shares(3))
    uid = claim_uid(api, cluster, "dra-three")
    assert cdi_spec(realnode, uid).is_file() and uid in recorded(realnode)
    env = env_of(api, cluster, "dra-three", "GPU_SHARE_COUNT")
    assert env["GPU_SHARE_COUNT"] == "3"
    assert env["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(3 * T4_MIB // 10)
    # What the real kubelet's prepare gave the claim, in its status (KEP-4817), as the container got it.
    devices = wait_for(
        lambda: request(api, "GET", CLAIMS.format(ns=cluster) + "/dra-three")["status"].get("devices"), 30
    )
    assert [(d["driver"], d["pool"], d["data"]["shares"], d["data"]["memoryLimitMiB"]) for d in devices] == [
        ("gpu-share.example.com", realnode.name, 3, 3 * T4_MIB // 10)
    ]
    delete(api, cluster, "dra-three")
    wait_for(
        lambda: not cdi_spec(realnode, uid).exists() and uid not in recorded(realnode), 30
    )  # unprepared when the pod went


def test_memory_whole_gpu_and_mig_claims_reach_the_container(realnode, api, cluster, driver):
    pods = {
        "dra-memory": shares(memory="3Gi"),
        "dra-whole": {"deviceClassName": "gpu-share-gpu"},
        "dra-mig": {"deviceClassName": "gpu-share-mig"},
    }
    for name, exactly in pods.items():
        claim_pod(api, realnode, cluster, name, exactly)
    uids = {name: claim_uid(api, cluster, name) for name in pods}
    memory = env_of(api, cluster, "dra-memory", "GPU_SHARE_COUNT")
    assert (memory["GPU_SHARE_COUNT"], memory["GPU_SHARE_MEMORY_LIMIT_MIB"]) == (
        "2",
        "3072",
    )  # 3Gi: two 1536 MiB shares
    assert memory["NVIDIA_VISIBLE_DEVICES"] in (UUID.format(0), UUID.format(1))
    assert env_of(api, cluster, "dra-whole", "NVIDIA_VISIBLE_DEVICES")["NVIDIA_VISIBLE_DEVICES"] == UUID.format(2)
    assert env_of(api, cluster, "dra-mig", "NVIDIA_VISIBLE_DEVICES")["NVIDIA_VISIBLE_DEVICES"] in MIGS
    assert set(uids.values()) <= recorded(realnode)
    for name in pods:
        delete(api, cluster, name)
    wait_for(
        lambda: (
            not any(cdi_spec(realnode, u).exists() for u in uids.values())
            and not set(uids.values()) & recorded(realnode)
        ),
        30,
    )


def test_a_mapped_extended_resource_gets_a_whole_gpu_through_dra(realnode, api, cluster, driver):
    """DRAExtendedResource: a class naming an extended resource this node's device plugins never advertised."""
    request(
        api,
        "POST",
        "/apis/resource.k8s.io/v1/deviceclasses",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "rn-mapped-gpu"},
            "spec": {
                "extendedResourceName": "example.com/rn-mapped-gpu",
                "selectors": [
                    {
                        "cel": {
                            "expression": (
                                f"device.driver == '{DRIVER}' && device.attributes[device.driver].mode == 'exclusive'"
                            )
                        }
                    }
                ],
            },
        },
    )
    try:
        claim_pod(api, realnode, cluster, "dra-mapped", limits={"example.com/rn-mapped-gpu": "1"})
        uid = claim_uid(api, cluster, "dra-mapped")
        assert env_of(api, cluster, "dra-mapped", "NVIDIA_VISIBLE_DEVICES")["NVIDIA_VISIBLE_DEVICES"] == UUID.format(2)
        delete_pod(client.CoreV1Api(api), cluster, "dra-mapped")
        wait_for(lambda: not cdi_spec(realnode, uid).exists() and uid not in recorded(realnode), 30)
    finally:
        delete_pod(client.CoreV1Api(api), cluster, "dra-mapped")
        request(api, "DELETE", "/apis/resource.k8s.io/v1/deviceclasses/rn-mapped-gpu")


def test_mps_limits_are_what_the_claim_paid_and_a_dead_daemon_shows_in_the_pod_status(realnode, api, cluster, driver):
    probe = 'if [ -p "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then echo PIPE=fifo; fi; env; sleep 3600'
    claim_pod(api, realnode, cluster, "dra-mps", shares(2, mode="mps"), command=probe)
    env = env_of(api, cluster, "dra-mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    assert env["NVIDIA_VISIBLE_DEVICES"] == UUID.format(4)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"  # 2 of 4 shares
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={2 * T4_MIB // 4}M"
    assert env["PIPE"] == "fifo" and env["CUDA_MPS_PIPE_DIRECTORY"] == str(driver.mps_root / "mps" / "pipe")
    core = client.CoreV1Api(api)

    def health() -> list[str]:
        statuses = core.read_namespaced_pod("dra-mps", cluster).status.container_statuses or []
        return [r.health for s in statuses for a in s.allocated_resources_status or [] for r in a.resources or []]

    assert wait_for(lambda: health() == ["Healthy"] and health(), 60)
    driver.broken.touch()  # the daemon cannot start again
    try:
        for pid in driver.mps_daemons():
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: health() == ["Unhealthy"], 60)
    finally:
        driver.broken.unlink()
    wait_for(lambda: health() == ["Healthy"], 60)  # restarted by the supervisor, ready again
    assert core.read_namespaced_pod("dra-mps", cluster).status.container_statuses[0].restart_count == 0
    delete(api, cluster, "dra-mps")


def test_a_claim_from_a_template_through_the_real_controller_manager(realnode, api, cluster, driver):
    request(
        api,
        "POST",
        f"/apis/resource.k8s.io/v1/namespaces/{cluster}/resourceclaimtemplates",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "two-shares"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": shares(2)}]}}},
        },
    )
    claim_pod(api, realnode, cluster, "dra-templated", template="two-shares")
    uid = claim_uid(api, cluster, "dra-templated")
    assert env_of(api, cluster, "dra-templated", "GPU_SHARE_COUNT")["GPU_SHARE_COUNT"] == "2"
    delete_pod(client.CoreV1Api(api), cluster, "dra-templated")
    # the controller deletes the claim it made; the kubelet unprepared it when the pod went
    wait_for(lambda: not cdi_spec(realnode, uid).exists() and uid not in recorded(realnode), 30)
    wait_for(
        lambda: not [c for c in request(api, "GET", CLAIMS.format(ns=cluster))["items"] if c["metadata"]["uid"] == uid],
        60,
    )


def test_a_kubelet_restart_and_a_driver_sigkill_keep_the_prepared_pod(realnode, api, cluster, driver):
    claim_pod(api, realnode, cluster, "dra-kept", shares(2))
    registered = driver.registrations()
    realnode.script("restart.sh", "kubelet")
    driver.proc.send_signal(signal.SIGKILL)
    driver.proc.wait(10)
    driver.start()
    # the new driver registered with the restarted kubelet, and its slices are there
    wait_for(lambda: driver.registrations() > registered, 60)

    def republished() -> bool:
        found = request(
            api,
            "GET",
            "/apis/resource.k8s.io/v1/resourceslices",
            query=[("fieldSelector", f"spec.nodeName={realnode.name}")],
        )
        return bool(found["items"])

    wait_for(republished, 60)
    status = client.CoreV1Api(api).read_namespaced_pod("dra-kept", cluster).status
    assert status.phase == "Running" and status.container_statuses[0].restart_count == 0
    delete(api, cluster, "dra-kept")
    claim_pod(
        api, realnode, cluster, "dra-after", shares(10)
    )  # its shares came back: a whole GPU's worth is prepared again
    delete(api, cluster, "dra-after")

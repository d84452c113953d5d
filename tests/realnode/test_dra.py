"""The DRA driver (`gpu-share run --api dra`, simulated 2xT4) beside a real kubelet v1.36 and containerd: claims
prepared by the real kubelet, their CDI specs injected by containerd, unprepared on delete, restarts."""

from __future__ import annotations

import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.support.kubeobjects import request
from tests.support.realnode import RealNode, delete_pod, wait_for

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER = "gpu-share-realnode"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
T4_MIB = 15360


class Driver:
    def __init__(self, node: RealNode, work: Path) -> None:
        self.node, self.work = node, work
        self.config = work / "config.yaml"
        self.config.write_text(yaml.safe_dump({"version": "v1", "pools": [{"name": "default", "mode": "shared", "resource": "gpu-share", "replicas": 10}]}))
        self.proc: Any = None

    def start(self) -> None:
        self.proc = self.node.nsexec(
            sys.executable, "-m", "deviceplugin.cli", "run", "--api", "dra", "--node", str(ROOT / "examples" / "nodes" / "2xT4.yaml"),
            "--config", str(self.config), "--kubeconfig", str(self.node.cp.admin_kubeconfig), "--node-name", self.node.name,
            "--health-checks", "false", "--metrics-port", "0", "--pod-resources-interval", "0.2",
            log=self.work / "driver.log",
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.node.stop_process(self.proc)

    def log(self) -> str:
        return (self.work / "driver.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def api(realnode: RealNode) -> Any:
    return realnode.cp.api_client()


@pytest.fixture(scope="module")
def cluster(realnode: RealNode, api: Any) -> Iterator[str]:
    """The shipped DeviceClasses, a kube-scheduler of our own name, a namespace."""
    created = []
    for document in yaml.safe_load_all((ROOT / "daemonset" / "dra" / "02-deviceclasses.yaml").read_text()):
        try:
            request(api, "POST", "/apis/resource.k8s.io/v1/deviceclasses", document)
            created.append(document["metadata"]["name"])
        except client.ApiException as err:
            assert err.status == 409, err
    realnode.cp.scheduler({"profiles": [{"schedulerName": SCHEDULER}]}, name="realnode")
    ns = f"rn-dra-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": ns}})
    core.create_namespaced_service_account(ns, {"metadata": {"name": "default"}})
    yield ns
    realnode.cp.stop_process("kube-scheduler#realnode")
    for name in created:  # the session API server is shared: the chart's tests install DeviceClasses of these names
        request(api, "DELETE", f"/apis/resource.k8s.io/v1/deviceclasses/{name}")


@pytest.fixture(scope="module")
def driver(realnode: RealNode, api: Any, cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Driver]:
    d = Driver(realnode, tmp_path_factory.mktemp("dra"))
    d.start()

    def published() -> bool:
        found = request(api, "GET", "/apis/resource.k8s.io/v1/resourceslices", query=[("fieldSelector", f"spec.nodeName={realnode.name}")])
        return bool(found["items"])

    wait_for(published, 60)
    yield d
    d.stop()


def claim_pod(api: Any, realnode: RealNode, ns: str, name: str, shares: str) -> client.V1Pod:
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share-shares", "capacity": {"requests": {"shares": shares}}}}]}}}
    request(api, "POST", CLAIMS.format(ns=ns), body)
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, {
        "metadata": {"name": name},
        "spec": {
            "schedulerName": SCHEDULER, "nodeSelector": {"kubernetes.io/hostname": realnode.name}, "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0, "automountServiceAccountToken": False,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [{"name": "main", "image": "local/busybox:1.35", "imagePullPolicy": "Never", "command": ["sh", "-c", "env; sleep 3600"],
                            "resources": {"claims": [{"name": "gpu"}]}}],
        },
    })

    def running() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name, ns)
        assert pod.status.phase not in ("Failed", "Succeeded"), pod.status
        return pod if pod.status.phase == "Running" else None

    return wait_for(running, 90)


def env_of(api: Any, ns: str, name: str) -> dict[str, str]:
    text = client.CoreV1Api(api).read_namespaced_pod_log(name, ns)
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def delete(api: Any, ns: str, name: str) -> None:
    delete_pod(client.CoreV1Api(api), ns, name)
    request(api, "DELETE", CLAIMS.format(ns=ns) + f"/{name}")


def test_a_claim_of_three_shares_reaches_the_container_through_containerd_cdi(realnode, api, cluster, driver):
    claim_pod(api, realnode, cluster, "dra-three", "3")
    uid = request(api, "GET", CLAIMS.format(ns=cluster) + "/dra-three")["metadata"]["uid"]
    spec = realnode.node_dir / "run" / "cdi" / f"gpu-share.example.com_{uid}.json"
    assert spec.is_file()
    env = wait_for(lambda: (e := env_of(api, cluster, "dra-three")) and "GPU_SHARE_COUNT" in e and e, 30)
    assert env["GPU_SHARE_COUNT"] == "3"
    assert env["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(3 * T4_MIB // 10)
    # What the real kubelet's prepare gave the claim, in its status (KEP-4817), as the container got it.
    devices = wait_for(lambda: request(api, "GET", CLAIMS.format(ns=cluster) + "/dra-three")["status"].get("devices"), 30)
    assert [(d["driver"], d["pool"], d["data"]["shares"], d["data"]["memoryLimitMiB"]) for d in devices] == [
        ("gpu-share.example.com", realnode.name, 3, 3 * T4_MIB // 10)
    ]
    delete(api, cluster, "dra-three")
    wait_for(lambda: not spec.exists(), 30)  # unprepared when the pod went


def test_a_kubelet_restart_and_a_driver_sigkill_keep_the_prepared_pod(realnode, api, cluster, driver):
    claim_pod(api, realnode, cluster, "dra-kept", "2")
    realnode.script("restart.sh", "kubelet")
    driver.proc.send_signal(signal.SIGKILL)
    driver.proc.wait(10)
    driver.start()

    def republished() -> bool:
        found = request(api, "GET", "/apis/resource.k8s.io/v1/resourceslices", query=[("fieldSelector", f"spec.nodeName={realnode.name}")])
        return bool(found["items"])

    wait_for(republished, 60)
    status = client.CoreV1Api(api).read_namespaced_pod("dra-kept", cluster).status
    assert status.phase == "Running" and status.container_statuses[0].restart_count == 0
    delete(api, cluster, "dra-kept")
    claim_pod(api, realnode, cluster, "dra-after", "10")  # its shares came back: a whole GPU's worth is prepared again
    delete(api, cluster, "dra-after")

"""A claim's SharingConfig under the real kubelet v1.36 and containerd: the DRA driver (simulated 2xT4, GPU 0 in an
MPS pool that also offers time slicing, GPU 1 time-sliced, the fake MPS control daemon serving the MPS pool) prepares
claims whose config lowers their MPS limits or leaves MPS, and the container's environment shows it; a config asking
more than the claim consumed fails the pod's prepare with the field named in its event."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from deviceplugin.dra.sharingconfig import api_version
from deviceplugin.kube.dranames import driver_name
from tests.support.kubeobjects import delete_claim, release_claim, request
from tests.support.realnode import RealNode, delete_pod, dra_cluster, wait_for

ROOT = Path(__file__).resolve().parents[2]
DRIVER = driver_name("example.com")
SCHEDULER = "gpu-share-realnode-sharing"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
T4_MIB = 15360
CONFIG = {
    "version": "v1",
    "pools": [
        {
            "name": "mps",
            "mode": "shared",
            "resource": "mps-share",
            "backend": "mps",
            "mpsLimits": "proportional",
            "replicas": 4,
            "sharingStrategies": ["mps", "timeSlicing"],
            "gpus": {"indexes": [0]},
        },
        {"name": "ts", "mode": "shared", "replicas": 4},
    ],
}


@pytest.fixture(scope="module")
def cluster(realnode: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, Path]]:
    """The shipped DeviceClasses, a kube-scheduler of our own name, a namespace, and in the node's mount namespace
    `gpu-share mps` (the fake control daemon) and the driver."""
    api = realnode.cp.api_client()
    processes = []
    stack = ExitStack()
    try:
        # Claims of this node's pool deleted before (other modules') but still allocated: released as the
        # resourceclaim controller would, or kube-scheduler counts their shares as taken on these devices.
        for left in request(api, "GET", "/apis/resource.k8s.io/v1/resourceclaims")["items"]:
            results = ((left.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])
            if left["metadata"].get("deletionTimestamp") and any(r.get("pool") == realnode.name for r in results):
                release_claim(api, left)
        ns = stack.enter_context(dra_cluster(realnode, SCHEDULER, "rn-share"))
        work = tmp_path_factory.mktemp("dra-sharing")
        (work / "config.yaml").write_text(yaml.safe_dump(CONFIG))
        binary = work / "nvidia-cuda-mps-control"
        binary.write_text(f"#!{sys.executable}\n" + (ROOT / "tests" / "support" / "fake_mps_control.py").read_text())
        binary.chmod(0o755)
        common = [
            "--node",
            str(ROOT / "examples" / "nodes" / "2xT4.yaml"),
            "--config",
            str(work / "config.yaml"),
            "--kubeconfig",
            str(realnode.cp.admin_kubeconfig),
            "--mps-control",
            str(binary),
        ]
        # `gpu-share mps` in the node's mount namespace, as its container runs: the pool's pipe under the node's /run
        processes.append(
            realnode.nsexec(sys.executable, "-m", "deviceplugin.cli", "mps", *common, log=work / "mps.log")
        )
        processes.append(
            realnode.nsexec(
                sys.executable,
                "-m",
                "deviceplugin.cli",
                "run",
                "--api",
                "dra",
                *common,
                "--node-name",
                realnode.name,
                "--health-checks",
                "false",
                "--metrics-port",
                "0",
                log=work / "driver.log",
            )
        )

        def published_untainted() -> bool:  # the MPS pool's device is tainted until its daemon answers
            query = [("fieldSelector", f"spec.nodeName={realnode.name}")]
            found = request(api, "GET", "/apis/resource.k8s.io/v1/resourceslices", query=query)
            devices = [d for s in found["items"] for d in s["spec"].get("devices", [])]
            modes = sorted(d["attributes"]["mode"]["string"] for d in devices)  # this config's, not a previous driver's
            return modes == ["mps", "time-slicing"] and not any(d.get("taints") for d in devices)

        wait_for(published_untainted, 60, 0.5)
        yield api, ns, work
    finally:
        for proc in reversed(processes):
            realnode.stop_process(proc)
        stack.close()


def sharing(**fields: Any) -> list[dict[str, Any]]:
    parameters = {"apiVersion": api_version(DRIVER), "kind": "SharingConfig", "sharing": fields}
    return [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}]


def claim_pod(
    realnode: RealNode, api: Any, ns: str, name: str, shares: str, mode: str, config: list[dict[str, Any]]
) -> None:
    exactly = {
        "deviceClassName": "gpu-share-shares",
        "capacity": {"requests": {"shares": shares}},
        "selectors": [{"cel": {"expression": f"device.attributes[device.driver].mode == '{mode}'"}}],
    }
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}], "config": config}},
    }
    request(api, "POST", CLAIMS.format(ns=ns), body)
    client.CoreV1Api(api).create_namespaced_pod(
        ns,
        {
            "metadata": {"name": name},
            "spec": {
                "schedulerName": SCHEDULER,
                "nodeSelector": {"kubernetes.io/hostname": realnode.name},
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": False,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                "containers": [
                    {
                        "name": "main",
                        "image": "local/busybox:1.35",
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "env; sleep 3600"],
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
            },
        },
    )


def env_of(api: Any, ns: str, name: str) -> dict[str, str] | None:
    """The container's environment once it has printed it."""
    core = client.CoreV1Api(api)
    pod = core.read_namespaced_pod(name, ns)
    assert pod.status.phase not in ("Failed", "Succeeded"), pod.status
    if pod.status.phase != "Running":
        return None
    env = dict(line.split("=", 1) for line in core.read_namespaced_pod_log(name, ns).splitlines() if "=" in line)
    return env if "GPU_SHARE_COUNT" in env else None


def waited(what: Any, api: Any, ns: str, pods: list[str], work: Path, timeout: float = 90) -> Any:
    """`wait_for(what)`; on a timeout the pods' phases and events and the driver's log, to tell why."""
    try:
        return wait_for(what, timeout, 0.5)
    except TimeoutError as err:
        core = client.CoreV1Api(api)

        def events(pod: str) -> list[str]:
            found = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={pod}").items
            return [e.message for e in found]

        seen = {p: (core.read_namespaced_pod(p, ns).status.phase, events(p)) for p in pods}
        found = request(api, "GET", "/apis/resource.k8s.io/v1/resourceslices")
        slices = [(x["metadata"]["name"], x["spec"]["pool"], x["spec"].get("devices")) for x in found["items"]]
        log = (work / "driver.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"{err}: {seen}\nslices: {slices}\n{log}") from None


def delete(api: Any, ns: str, name: str) -> None:
    delete_pod(client.CoreV1Api(api), ns, name)
    delete_claim(api, ns, name)


def test_a_claims_sharing_config_sets_its_containers_mps_limits_or_takes_it_out_of_mps(
    realnode: RealNode, cluster: tuple[Any, str, Path]
) -> None:
    api, ns, work = cluster
    low = sharing(
        strategy="mps", mpsConfig={"defaultActiveThreadPercentage": 20, "defaultPinnedDeviceMemoryLimit": "3Gi"}
    )
    claim_pod(realnode, api, ns, "capped", "2", "mps", low)
    claim_pod(realnode, api, ns, "sliced", "1", "mps", sharing(strategy="timeSlicing"))
    capped = waited(lambda: env_of(api, ns, "capped"), api, ns, ["capped", "sliced"], work)
    assert (
        capped["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20" and capped["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3072M"
    )
    assert capped["GPU_SHARE_COUNT"] == "2" and capped["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpu-share/mps/mps/pipe"
    # The same MPS GPU, outside MPS: no pipe, no limits.
    sliced = waited(lambda: env_of(api, ns, "sliced"), api, ns, ["capped", "sliced"], work)
    assert sliced["GPU_SHARE_COUNT"] == "1" and not any(k.startswith("CUDA_MPS_") for k in sliced)
    assert sliced["NVIDIA_VISIBLE_DEVICES"] == capped["NVIDIA_VISIBLE_DEVICES"]
    delete(api, ns, "capped")
    delete(api, ns, "sliced")


def test_a_config_over_what_the_claim_consumed_fails_the_pods_prepare_naming_the_field(
    realnode: RealNode, cluster: tuple[Any, str, Path]
) -> None:
    api, ns, work = cluster
    claim_pod(realnode, api, ns, "greedy", "1", "mps", sharing(mpsConfig={"defaultActiveThreadPercentage": 80}))
    claim_pod(realnode, api, ns, "no-daemon", "1", "time-slicing", sharing(strategy="mps"))
    core = client.CoreV1Api(api)

    def failed(pod: str) -> str | None:
        """The driver's refusal. The real kubelet may first fail to read the claim itself ("fetch ResourceClaim ...
        forbidden ... no relationship found between node": the node authorizer's graph lags the pod's binding),
        and retries; that event is not the driver's answer."""
        events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={pod}").items
        return next(
            (
                e.message
                for e in events
                if e.reason == "FailedPrepareDynamicResources" and "fetch ResourceClaim" not in (e.message or "")
            ),
            None,
        )

    greedy = waited(lambda: failed("greedy"), api, ns, ["greedy", "no-daemon"], work)
    assert "sharing.mpsConfig.defaultActiveThreadPercentage: 80 is more than the 25 % the claim consumed" in greedy, (
        greedy
    )
    no_daemon = waited(lambda: failed("no-daemon"), api, ns, ["greedy", "no-daemon"], work)
    assert "sharing.strategy: mps is not offered on device gpu-1: pool ts is backend timeSlicing" in no_daemon, (
        no_daemon
    )
    assert core.read_namespaced_pod("greedy", ns).status.phase == "Pending"
    delete(api, ns, "greedy")
    delete(api, ns, "no-daemon")

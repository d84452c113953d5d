"""Dynamic MIG beside a real kubelet v1.36 and containerd: `gpu-share run --api dra` on a simulated H100 (MIG mode
on, no instance) makes the MIG instance the scheduler allocated when the kubelet prepares the claim, and the
container, through containerd's CDI injection, sees the MIG UUID made for it."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.realnode.test_dra import CLAIMS, env_of
from tests.support.kubeobjects import delete_claim, request
from tests.support.realnode import RealNode, delete_pod, dra_cluster, wait_for

SCHEDULER = "gpu-share-realnode-mig"
DRIVER = "gpu-share.example.com"
NODE = {
    "name": "1xH100-mig",
    "gpus": [
        {
            "index": 0,
            "uuid": "GPU-c41e9d27-55a0-4b1f-9e3d-0000000000e0",
            "model": "NVIDIA H100 80GB HBM3",
            "memoryMiB": 81559,
            "computeCapability": "9.0",
            "mig": [],
        }
    ],
}  # MIG mode on, no instance


@pytest.fixture(scope="module")
def mig_driver(realnode: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    """The DeviceClasses, a scheduler of our own name, a namespace, and the driver serving one dynamic MIG pool."""
    api = realnode.cp.api_client()
    work = tmp_path_factory.mktemp("dra-mig")
    with dra_cluster(realnode, SCHEDULER, "rn-mig") as ns:
        (work / "node.yaml").write_text(yaml.safe_dump(NODE))
        (work / "config.yaml").write_text(
            yaml.safe_dump({"version": "v1", "pools": [{"name": "mig", "mode": "mig", "strategy": "dynamic"}]})
        )
        proc = realnode.nsexec(
            sys.executable,
            "-m",
            "deviceplugin.cli",
            "run",
            "--api",
            "dra",
            "--node",
            str(work / "node.yaml"),
            "--config",
            str(work / "config.yaml"),
            "--kubeconfig",
            str(realnode.cp.admin_kubeconfig),
            "--node-name",
            realnode.name,
            "--health-checks",
            "false",
            "--metrics-port",
            "0",
            log=work / "driver.log",
        )

        def published() -> bool:
            found = request(
                api,
                "GET",
                "/apis/resource.k8s.io/v1/resourceslices",
                query=[("fieldSelector", f"spec.nodeName={realnode.name}")],
            )
            return any(s["spec"].get("sharedCounters") for s in found["items"])

        try:
            wait_for(published, 60)
            yield api, ns
        finally:
            realnode.stop_process(proc)


def test_the_container_sees_the_mig_instance_made_for_its_claim(
    realnode: RealNode, mig_driver: tuple[Any, str]
) -> None:
    api, ns = mig_driver
    name = "mig-3g"
    selector = "device.attributes[device.driver].migProfile == '3g.40gb'"
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "mig",
                        "exactly": {
                            "deviceClassName": "gpu-share-mig",
                            "selectors": [{"cel": {"expression": selector}}],
                        },
                    }
                ]
            }
        },
    }
    request(api, "POST", CLAIMS.format(ns=ns), body)
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
                "resourceClaims": [{"name": "mig", "resourceClaimName": name}],
                "containers": [
                    {
                        "name": "main",
                        "image": "local/busybox:1.35",
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "env; sleep 3600"],
                        "resources": {"claims": [{"name": "mig"}]},
                    }
                ],
            },
        },
    )
    wait_for(lambda: core.read_namespaced_pod(name, ns).status.phase == "Running", 90)
    claim = request(api, "GET", CLAIMS.format(ns=ns) + f"/{name}")
    record_path = realnode.node_dir / "kubelet" / "plugins" / DRIVER / "claims" / f"{claim['metadata']['uid']}.json"
    record = json.loads(record_path.read_text())["claim"]
    (device,) = record["devices"]
    made = device["mig"]["uuid"]
    assert (
        made.startswith("MIG-")
        and device["mig"]["start"] in (0, 4)
        and device["device"].startswith("gpu-0-mig-3g-40gb-")
    )
    env = env_of(api, ns, name, "NVIDIA_VISIBLE_DEVICES")
    assert env["NVIDIA_VISIBLE_DEVICES"] == made  # the instance the driver made for this claim, through the CDI spec
    devices = wait_for(lambda: request(api, "GET", CLAIMS.format(ns=ns) + f"/{name}")["status"].get("devices"), 30)
    assert [d["data"]["uuid"] for d in devices] == [made]  # the claim's status names the instance too
    delete_pod(core, ns, name)
    delete_claim(api, ns, name)  # no kube-controller-manager runs here: released as it would release it
    wait_for(lambda: not Path(record_path).exists(), 30)  # unprepared (its instance destroyed first) when the pod went

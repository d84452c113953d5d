"""What the 1.36 API server and kube-scheduler allow for a device that is both multi-allocatable (consumable
capacity) and consumes counters (the building block for shares on top of a dynamic MIG instance): raw slices, no
driver. The API server accepts such a device; two claims of shares land on it within its capacity; its counters are
charged once however many claims share it; a claim that no longer fits is refused by the scheduler."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_until
from tests.support.kubeobjects import namespace, ready_node, request

DRIVER = "gpu-share.counters-check.example.com"
SCHEDULER = "gpu-share-counters-check"
CLASS = "gpu-share-counters-check"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"


def _shares(n: int) -> dict[str, Any]:
    return {"value": str(n), "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": str(n), "step": "1"}}}


def _device(name: str, slices: list[int], compute: int, shared: bool) -> dict[str, Any]:
    counters = {f"memory-slice-{i}": {"value": "1"} for i in slices} | {"compute-slices": {"value": str(compute)}}
    device: dict[str, Any] = {
        "name": name,
        "attributes": {"kind": {"string": name}},
        "consumesCounters": [{"counterSet": "gpu-0-mig", "counters": counters}],
    }
    if shared:
        device |= {"allowMultipleAllocations": True, "capacity": {"shares": _shares(2)}}
    return device


@pytest.fixture
def node(controlplane: Any) -> Iterator[tuple[Any, str, str]]:
    api = controlplane.api_client()
    name = ready_node(api, "counters-check")["metadata"]["name"]
    ns = namespace(api, "counters-check")
    request(
        api,
        "POST",
        "/apis/resource.k8s.io/v1/deviceclasses",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": CLASS},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
        },
    )
    pool = {"name": name, "generation": 1, "resourceSliceCount": 2}
    counters = {f"memory-slice-{i}": {"value": "1"} for i in range(2)} | {"compute-slices": {"value": "2"}}
    specs = [
        {"sharedCounters": [{"name": "gpu-0-mig", "counters": counters}]},
        {"devices": [_device("one-a", [0], 1, True), _device("one-b", [1], 1, True), _device("two", [0, 1], 2, False)]},
    ]
    for i, spec in enumerate(specs):
        request(
            api,
            "POST",
            "/apis/resource.k8s.io/v1/resourceslices",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": f"{name}-{i}"},
                "spec": {"driver": DRIVER, "nodeName": name, "pool": pool, **spec},
            },
        )
    controlplane.scheduler({"profiles": [{"schedulerName": SCHEDULER}]}, name="counters-check")
    yield api, name, ns
    controlplane.stop_process("kube-scheduler#counters-check")
    for i in range(len(specs)):
        request(api, "DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{name}-{i}")
    request(api, "DELETE", f"/apis/resource.k8s.io/v1/deviceclasses/{CLASS}")


def _ask(api: Any, node: str, ns: str, name: str, kind: str, shares: str | None) -> None:
    exactly: dict[str, Any] = {
        "deviceClassName": CLASS,
        "selectors": [{"cel": {"expression": f"device.attributes['{DRIVER}'].kind == '{kind}'"}}],
    }
    if shares:
        exactly["capacity"] = {"requests": {"shares": shares}}
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
    spec = {
        "schedulerName": SCHEDULER,
        "nodeSelector": {"kubernetes.io/hostname": node},
        "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
        "containers": [{"name": "app", "image": "registry.invalid/app:1", "resources": {"claims": [{"name": "gpu"}]}}],
    }
    client.CoreV1Api(api).create_namespaced_pod(ns, {"metadata": {"name": name}, "spec": spec})


def _bound(api: Any, ns: str, pod: str) -> bool:
    return wait_until(lambda: bool(client.CoreV1Api(api).read_namespaced_pod(pod, ns).spec.node_name), timeout=20)


def _refused(api: Any, ns: str, pod: str) -> bool:
    def refused() -> bool:
        found = client.CoreV1Api(api).read_namespaced_pod(pod, ns)
        return not found.spec.node_name and any(
            c.type == "PodScheduled" and c.reason == "Unschedulable" for c in found.status.conditions or []
        )

    return wait_until(refused, timeout=20)


def _results(api: Any, ns: str, name: str) -> list[dict[str, Any]]:
    found = request(api, "GET", CLAIMS.format(ns=ns) + f"/{name}")
    return (found.get("status", {}).get("allocation") or {}).get("devices", {}).get("results", [])


def test_a_shared_device_consuming_counters_is_charged_once_and_holds_its_capacity(node: Any) -> None:
    api, name, ns = node
    _ask(api, name, ns, "s1", "one-a", "1")
    _ask(api, name, ns, "s2", "one-a", "1")
    assert _bound(api, ns, "s1") and _bound(api, ns, "s2")
    r1, r2 = _results(api, ns, "s1"), _results(api, ns, "s2")
    assert [r["device"] for r in r1 + r2] == ["one-a", "one-a"] and r1[0]["shareID"] != r2[0]["shareID"]
    _ask(api, name, ns, "s3", "one-a", "1")  # capacity 2 is full: refused by the scheduler
    assert _refused(api, ns, "s3")
    # Charged once: one-a's compute slice 1 of 2 and memory slice 0; one-b (slice 1, compute 1) still fits. Charged per
    # claim, compute-slices would be 2 of 2 and one-b would be refused.
    _ask(api, name, ns, "b", "one-b", "1")
    assert _bound(api, ns, "b")
    _ask(api, name, ns, "whole", "two", None)  # its memory slices are taken by one-a and one-b: refused
    assert _refused(api, ns, "whole")

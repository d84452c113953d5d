"""The DRA driver end to end: `gpu-share run --api dra` as a real subprocess on a simulated node, a real API server
(and kube-scheduler), and the fake kubelet (tests/support/dra_kubelet.py) preparing claims over real gRPC."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.api import dra_health_v1alpha1_pb2 as health_pb
from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.dra.devices import ClaimError
from deviceplugin.kube.annotation import ANNOTATION
from deviceplugin.kube.dranames import driver_name
from deviceplugin.mps.control import MpsDaemon
from deviceplugin.sim.kubelet import Container, KubeletSimulator, Pod
from tests.conftest import EXAMPLES, GPU_CLI, ROOT, free_port, get, node, wait_until
from tests.support.dra_kubelet import FakeDraKubelet, PrepareError
from tests.support.kubeobjects import namespace, ready_node, request, slices
from tests.support.resources import resources_of

DRIVER = driver_name("example.com")
T4_MIB = 15360
POOL = {
    "name": "mps",
    "mode": "shared",
    "replicas": 4,
    "backend": "mps",
    "mpsLimits": "proportional",
}  # claims of several shares (strict allows one)
_names = itertools.count()


def fresh(prefix: str) -> str:
    return f"{prefix}-{next(_names)}-{uuid.uuid4().hex[:6]}"


class Driver:
    """One `gpu-share run --api dra` subprocess, the fake kubelet watching its registration directory, the simulated
    kubelet's pod-resources (which containers use which claim, for the node agent), and the MPS pool's control
    daemon (the fake nvidia-cuda-mps-control, supervised here as `gpu-share mps` would)."""

    def __init__(self, controlplane: Any, node_name: str, metrics_port: int = 0) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gs-e2e-", dir="/tmp"))
        (self.root / "plugins_registry").mkdir()
        config = {"version": "v1", "mpsRoot": str(self.root / "mps"), "pools": [POOL]}
        (self.root / "config.yaml").write_text(yaml.safe_dump(config))
        binary = self.root / "nvidia-cuda-mps-control"
        binary.write_text(f"#!{sys.executable}\n" + (ROOT / "tests" / "support" / "fake_mps_control.py").read_text())
        binary.chmod(0o755)
        resource = resources_of(config, node("2xT4"))[0]
        self.mps = MpsDaemon(
            resource, str(self.root / "mps"), binary=str(binary), backoff_initial=0.05, backoff_max=0.2
        )
        self.mps.start()
        self.node_name = node_name
        self.cdi = self.root / "cdi"
        self.args = [
            *GPU_CLI,
            "run",
            "--api",
            "dra",
            "--node",
            str(EXAMPLES / "nodes" / "2xT4.yaml"),
            "--config",
            str(self.root / "config.yaml"),
            "--kubeconfig",
            str(controlplane.admin_kubeconfig),
            "--node-name",
            node_name,
            "--kubelet-root",
            str(self.root),
            "--cdi-root",
            str(self.cdi),
            "--metrics-port",
            str(metrics_port),
            "--metrics-bind-address",
            "127.0.0.1",
            "--health-checks",
            "false",
            "--mps-control",
            str(binary),
        ]
        self.kubelet = FakeDraKubelet(self.root / "plugins_registry").start()
        self.pods = KubeletSimulator(
            self.root / "device-plugins", pod_resources_socket=self.root / "pod-resources" / "kubelet.sock"
        )
        self.pods.start()
        self.args += ["--pod-resources-socket", str(self.pods.pod_resources_socket), "--pod-resources-interval", "0.1"]
        self.proc: subprocess.Popen[str] | None = None
        self.logs: list[str] = []

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Both devices Healthy in the health stream (the MPS pool's daemon answers)."""
        self.kubelet.wait_health(
            DRIVER, lambda h: len(h) == 2 and all(v[0] == health_pb.HEALTHY for v in h.values()), timeout
        )

    def start(self) -> None:
        log = open(self.root / f"run-{len(self.logs)}.log", "w")
        self.logs.append(log.name)
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, text=True)
        log.close()

    def log(self) -> str:
        return "\n".join(Path(p).read_text()[-3000:] for p in self.logs)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(30)

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.kubelet.stop()
        self.pods.stop()
        self.mps.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def dra(controlplane: Any) -> Iterator[Any]:
    drivers: list[Driver] = []

    def start(node_name: str, metrics_port: int = 0) -> Driver:
        driver = Driver(controlplane, node_name, metrics_port)
        drivers.append(driver)
        driver.start()
        return driver

    yield start
    for driver in drivers:
        driver.close()


def _claim(api: Any, ns: str, name: str, device_class: str, shares: int | None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if shares is not None:
        exactly["capacity"] = {"requests": {"shares": str(shares)}}
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }
    return request(api, "POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims", body)


def _allocate(api: Any, claim: dict[str, Any], node_name: str, device: str, shares: int) -> dict[str, Any]:
    """Write status.allocation as the scheduler would (as admin)."""
    result = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": node_name,
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"shares": str(shares), "memory": f"{shares * T4_MIB // 4}Mi"},
    }
    claim["status"] = {"allocation": {"devices": {"results": [result]}}}
    meta = claim["metadata"]
    return request(
        api,
        "PUT",
        f"/apis/resource.k8s.io/v1/namespaces/{meta['namespace']}/resourceclaims/{meta['name']}/status",
        claim,
    )


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _ref(claim: dict[str, Any]) -> tuple[str, str, str]:
    meta = claim["metadata"]
    return (meta["namespace"], meta["name"], meta["uid"])


def _env(path: Path) -> dict[str, str]:
    spec = json.loads(path.read_text())
    return dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])


def test_claims_allocated_by_kube_scheduler_are_prepared_into_cdi_specs_with_the_consumed_capacity(
    controlplane: Any, dra: Any
) -> None:
    api = controlplane.api_client()
    node_name = fresh("dra-e2e")
    ready_node(api, node_name)
    ns = namespace(api, fresh("dra-e2e"))
    device_class = fresh("gpu-share")
    request(
        api,
        "POST",
        "/apis/resource.k8s.io/v1/deviceclasses",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": device_class},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
        },
    )
    port = free_port()
    driver = dra(node_name, port)
    kubelet_driver = driver.kubelet.wait_registered(DRIVER, timeout=30)
    assert kubelet_driver.service == "v1.DRAPlugin", driver.log()
    driver.wait_healthy()
    assert wait_until(lambda: len(slices(api, node_name)) == 1, 30), driver.log()
    assert {d["name"] for d in slices(api, node_name)[0]["spec"]["devices"]} == {"gpu-0", "gpu-1"}
    controlplane.scheduler({}, name=fresh("dra-node"))

    claims: dict[int, tuple[int, dict[str, Any]]] = {}
    templates: dict[int, dict[str, Any]] = {}
    for i, shares in enumerate(
        (1, 2, 4, 1)
    ):  # 8 shares in all, the node's 2 x 4: first fit places them whatever the order
        # A template per size; its spec copied into a claim, as the ResourceClaim controller would.
        template = templates.get(shares) or request(
            api,
            "POST",
            f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": f"shares-{shares}"},
                "spec": {
                    "spec": {
                        "devices": {
                            "requests": [
                                {
                                    "name": "gpu",
                                    "exactly": {
                                        "deviceClassName": device_class,
                                        "capacity": {"requests": {"shares": str(shares)}},
                                    },
                                }
                            ]
                        }
                    }
                },
            },
        )
        templates[shares] = template
        claim = request(
            api,
            "POST",
            f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": f"pod-{i}-gpu"},
                "spec": template["spec"]["spec"],
            },
        )
        claims[i] = (shares, claim)
        request(
            api,
            "POST",
            f"/api/v1/namespaces/{ns}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"pod-{i}"},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node_name},  # other tests' nodes may still have devices
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": f"pod-{i}-gpu"}],
                    "containers": [
                        {
                            "name": "app",
                            "image": "registry.k8s.io/pause:3.10",
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                },
            },
        )

    def allocated() -> bool:
        return all(
            request(api, "GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/pod-{k}-gpu")
            .get("status", {})
            .get("allocation")
            for k in claims
        )

    assert wait_until(allocated, 60), controlplane.log_tail(
        next(n for n in controlplane.procs if n.startswith("kube-scheduler#dra-node"))
    )
    held: dict[str, int] = {}
    results: dict[int, dict[str, Any]] = {}
    for i, (shares, claim) in claims.items():
        stored = request(
            api, "GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{claim['metadata']['name']}"
        )
        (result,) = stored["status"]["allocation"]["devices"]["results"]
        results[i] = result
        assert (
            result["driver"] == DRIVER
            and result["pool"] == node_name
            and result["consumedCapacity"]["shares"] == str(shares)
        )
        held[result["device"]] = held.get(result["device"], 0) + shares
        pod = request(api, "GET", f"/api/v1/namespaces/{ns}/pods/pod-{i}")
        assert pod["spec"].get("nodeName") == node_name
        (device,) = driver.kubelet.prepare(DRIVER, [_ref(claim)])[claim["metadata"]["uid"]]
        assert (
            device.device_name == result["device"]
            and device.share_id == result["shareID"]
            and list(device.request_names) == ["gpu"]
        )
        (cdi,) = device.cdi_device_ids
        assert cdi == f"k8s.{DRIVER}/claim={claim['metadata']['uid']}-0"
        env = _env(driver.cdi / f"{DRIVER}_{claim['metadata']['uid']}.json")
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(25 * shares)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={shares * T4_MIB // 4}M"
        assert env["GPU_SHARE_COUNT"] == str(shares)
    assert held == {"gpu-0": 4, "gpu-1": 4}, held  # the scheduler never gives a device more than its 4 shares
    assert get(f"http://127.0.0.1:{port}/readyz")[0] == 200
    samples = _scrape(port)
    assert samples[("gpushare_dra_prepared_claims", (("node", node_name),))] == 4
    assert {labels: v for (name, labels), v in samples.items() if name == "gpushare_dra_shares_prepared"} == {
        (
            ("device", "gpu-0"),
            ("gpu", "0"),
            ("node", node_name),
            ("uuid", "GPU-8a2f4c1d-3b5e-4f60-a7c8-000000000000"),
        ): 4,
        (
            ("device", "gpu-1"),
            ("gpu", "1"),
            ("node", node_name),
            ("uuid", "GPU-8a2f4c1d-3b5e-4f60-a7c8-000000000001"),
        ): 4,
    }
    assert (
        samples[("gpushare_dra_claims_total", (("node", node_name), ("operation", "prepare"), ("result", "ok")))] == 4
    )
    exported = {
        re.sub(r"_(bucket|count|sum)$", "", name)
        for name, _ in samples
        if name.startswith("gpushare_dra_") and not name.endswith("_created")
    }
    documented = set(
        re.findall(
            r"^\| `(gpushare_dra_[a-z_]+)",
            (ROOT / "docs" / "metrics.md").read_text() + (ROOT / "docs" / "dra.md").read_text(),
            flags=re.M,
        )
    )
    assert exported == documented, (sorted(exported - documented), sorted(documented - exported))
    # The node agent: pod-resources lists pod-1's claim for its container, the metrics show its shares and meter it.
    shares, claim = claims[1]
    uses = pr.DynamicResource(
        claim_name=claim["metadata"]["name"],
        claim_namespace=ns,
        claim_resources=[
            pr.ClaimResource(
                driver_name=DRIVER,
                pool_name=node_name,
                device_name=results[1]["device"],
                share_id=results[1]["shareID"],
            )
        ],
    )
    driver.pods.admit(Pod("pod-1", [Container("app", {}, claims=[uses])], namespace=ns))
    pod_1 = (
        ("container", "app"),
        ("namespace", ns),
        ("node", node_name),
        ("pod", "pod-1"),
        ("resource", "example.com/gpu-share"),
    )
    metered = (("namespace", ns), ("node", node_name), ("pod", "pod-1"), ("resource", "example.com/gpu-share"))

    def gpu_seconds() -> float:
        return _scrape(port).get(("gpushare_gpu_seconds_total", metered), 0.0)

    assert wait_until(lambda: gpu_seconds() > 0, 30), driver.log()
    first = gpu_seconds()
    assert wait_until(lambda: gpu_seconds() > first, 30), driver.log()
    samples = _scrape(port)
    unit = next(
        dict(labels)["uuid"]
        for name, labels in samples
        if name == "gpushare_container_shares" and set(pod_1) <= set(labels)
    )
    assert samples[("gpushare_container_shares", tuple(sorted((*pod_1, ("uuid", unit)))))] == shares
    assert (
        samples[("gpushare_container_memory_limit_bytes", tuple(sorted((*pod_1, ("uuid", unit)))))]
        == shares * T4_MIB // 4 * 1024 * 1024
    )
    assert samples[("gpushare_share_seconds_total", metered)] == pytest.approx(
        samples[("gpushare_gpu_seconds_total", metered)] * 4
    )  # a share is 1/4 GPU
    assert [labels for name, labels in samples if name == "gpushare_container_shares"] == [
        tuple(sorted((*pod_1, ("uuid", unit))))
    ]  # prepared, not in pod-resources: not held
    driver.kubelet.unprepare(DRIVER, [_ref(c) for _, c in claims.values()])
    assert not list(driver.cdi.glob("*.json"))
    assert driver.stop() == 0
    assert not (driver.root / "plugins_registry" / f"{DRIVER}-reg.sock").exists()
    assert not (driver.root / "plugins" / DRIVER / "dra.sock").exists()


def test_a_killed_driver_restarts_and_unprepares_a_claim_already_gone_from_the_api(controlplane: Any, dra: Any) -> None:
    api = controlplane.api_client()
    node_name = fresh("dra-kill")
    ready_node(api, node_name)
    ns = namespace(api, fresh("dra-kill"))
    driver = dra(node_name)
    driver.kubelet.wait_registered(DRIVER, timeout=30)
    driver.wait_healthy()
    claim = _allocate(api, _claim(api, ns, "c", "any", 3), node_name, "gpu-1", 3)
    ref = _ref(claim)
    (device,) = driver.kubelet.prepare(DRIVER, [ref])[ref[2]]
    spec = driver.cdi / f"{DRIVER}_{ref[2]}.json"
    assert spec.exists() and _env(spec)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "75"
    replaced = (ref[0], ref[1], str(uuid.uuid4()))
    assert "got replaced" in driver.kubelet.prepare_errors(DRIVER, [replaced])[replaced[2]]

    registrations = driver.kubelet.registrations
    assert driver.stop(signal.SIGKILL) == -signal.SIGKILL
    driver.start()  # the kubelet sees the registration socket recreated and registers the new process
    assert driver.kubelet.wait_registrations(registrations + 1, 30), driver.log()
    driver.wait_healthy()
    again = driver.kubelet.prepare(DRIVER, [ref])[ref[2]]  # nothing prepared twice: the same answer from the checkpoint
    assert [list(d.cdi_device_ids) for d in again] == [list(device.cdi_device_ids)]
    other = _allocate(api, _claim(api, ns, "d", "any", 2), node_name, "gpu-1", 2)
    errors = driver.kubelet.prepare_errors(DRIVER, [_ref(other)])
    assert "gpu-1 has 4 shares; prepared claims hold 3 and this claim needs 2" in errors[other["metadata"]["uid"]]

    request(api, "DELETE", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/c")
    driver.kubelet.unprepare(DRIVER, [ref])
    assert not spec.exists()
    assert [p.name for p in (driver.root / "plugins" / DRIVER / "claims").iterdir()] == [".generation"]  # no record
    with pytest.raises(PrepareError, match="not found"):
        driver.kubelet.prepare(DRIVER, [ref])
    assert driver.stop() == 0
    assert "watch failed" not in Path(driver.logs[-1]).read_text()  # a clean SIGTERM warns about no watch


def test_registration_means_the_driver_can_prepare(controlplane: Any, dra: Any) -> None:
    """The start order docs/dra.md promises: everything prepare needs is built before the kubelet plugin registers
    (the slice publisher after), so the first NodePrepareResources right at registration is answered, not refused."""
    api = controlplane.api_client()
    node_name = fresh("dra-order")
    ready_node(api, node_name)
    ns = namespace(api, fresh("dra-order"))
    claim = _allocate(api, _claim(api, ns, "early", "any", 2), node_name, "gpu-0", 2)  # allocated before it starts
    ref = _ref(claim)
    driver = dra(node_name)
    driver.kubelet.wait_registered(DRIVER, timeout=30)
    (device,) = driver.kubelet.prepare(DRIVER, [ref])[ref[2]]  # no wait for health, slices or the claim watch
    assert list(device.cdi_device_ids), driver.log()
    assert _env(driver.cdi / f"{DRIVER}_{ref[2]}.json")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    driver.kubelet.unprepare(DRIVER, [ref])
    assert driver.stop() == 0


def test_a_prepared_claim_gets_its_status_devices_and_the_node_its_labels_and_inventory(
    controlplane: Any, dra: Any
) -> None:
    """`gpu-share run --api dra` writes status.devices[].data of a claim it prepared (KEP-4817: the GPU UUID, the
    shares and the memory limit) and, from the node core as the device plugin does, the Node's GFD-style labels and
    its inventory annotation."""
    api = controlplane.api_client()
    node_name = fresh("dra-status")
    ready_node(api, node_name)
    ns = namespace(api, fresh("dra-status"))
    driver = dra(node_name)
    driver.kubelet.wait_registered(DRIVER, timeout=30)
    driver.wait_healthy()
    claim = _allocate(api, _claim(api, ns, "c", "any", 3), node_name, "gpu-1", 3)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    driver.kubelet.prepare(DRIVER, [_ref(claim)])

    def devices() -> list[dict[str, Any]]:
        return (
            request(api, "GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/c")
            .get("status", {})
            .get("devices")
            or []
        )

    assert wait_until(devices, 30), driver.log()
    assert [{k: v for k, v in entry.items() if v is not None} for entry in devices()] == [
        {  # the API serves `conditions: null`
            "driver": DRIVER,
            "pool": node_name,
            "device": "gpu-1",
            "shareID": result["shareID"],
            "data": {
                "version": 1,
                "uuid": node("2xT4").gpus[1].uuid,
                "gpu": 1,
                "shares": 3,
                "totalShares": 4,
                "memoryLimitMiB": 3 * T4_MIB // 4,
            },
        }
    ]

    def metadata() -> Any:
        return request(api, "GET", f"/api/v1/nodes/{node_name}")["metadata"]

    assert wait_until(lambda: f"example.com/{ANNOTATION}" in metadata().get("annotations", {}), 30), driver.log()
    labels = metadata()["labels"]
    assert (
        labels["example.com/gpu.count"] == "2"
        and labels["example.com/gpu.sharing-strategy"] == "mps"
        and labels["example.com/gpu.replicas"] == "4"
    )
    inventory = json.loads(metadata()["annotations"][f"example.com/{ANNOTATION}"])
    assert [u["uuid"] for u in inventory["resources"]["example.com/gpu-share"]["units"]] == [
        g.uuid for g in node("2xT4").gpus
    ]
    assert driver.stop() == 0


def test_the_claim_cache_serves_claims_allocated_here_and_gets_the_others(controlplane: Any) -> None:
    from deviceplugin.dra.claims import ApiClaims
    from deviceplugin.dra.prepare import GONE, ClaimRef

    api = controlplane.api_client()
    node_name = fresh("dra-cache")
    ns = namespace(api, fresh("dra-cache"))
    claims = ApiClaims(controlplane.rest_client(), DRIVER, node_name, timeout=5.0)
    claims.start()
    try:
        assert wait_until(lambda: claims.synced, 10)
        ours = _allocate(api, _claim(api, ns, "ours", "any", 1), node_name, "gpu-0", 1)
        elsewhere = _allocate(api, _claim(api, ns, "elsewhere", "any", 1), "other-node", "gpu-0", 1)
        pending = _claim(api, ns, "pending", "any", 1)
        assert wait_until(lambda: claims.size() == 1, 10)
        cached = claims.cached(ClaimRef(*_ref(ours)))
        assert cached is not None and cached["metadata"]["uid"] == ours["metadata"]["uid"] and claims.current
        assert claims.find(ours["metadata"]["uid"]) == cached and claims.find(elsewhere["metadata"]["uid"]) == GONE
        assert claims.cached(ClaimRef(*_ref(elsewhere))) is None and claims.cached(ClaimRef(*_ref(pending))) is None
        assert claims.get(ClaimRef(*_ref(elsewhere)), 5.0)["status"]["allocation"]
        assert not claims.get(ClaimRef(*_ref(pending)), 5.0).get("status", {}).get("allocation")
        request(api, "DELETE", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/ours")
        assert wait_until(lambda: claims.size() == 0, 10)
        with pytest.raises(ClaimError, match="not found in the API"):
            claims.get(ClaimRef(*_ref(ours)), 5.0)
    finally:
        claims.stop()


def test_a_silent_claim_watch_is_not_trusted_and_a_re_allocated_claim_is_prepared_from_the_api(
    controlplane: Any, tmp_path: Path
) -> None:
    """A watch that delivers nothing (no event, no bookmark) for its silence bound is not used: cached() answers
    None, the watch ends itself and lists again. A claim deallocated and re-allocated (same UID, gpu-0 -> gpu-1)
    after its prepare is prepared again from the API's allocation, its record replaced."""
    import asyncio

    from deviceplugin.dra.claims import ApiClaims
    from deviceplugin.dra.prepare import ClaimRef, prepare_claims
    from tests.support.dra import make_driver

    api = controlplane.api_client()
    node_name = fresh("dra-silent")
    ns = namespace(api, fresh("dra-silent"))
    driver = make_driver(tmp_path)
    driver.pool = node_name  # the example node's devices, in this node's pool
    claims = ApiClaims(controlplane.rest_client(), DRIVER, node_name, timeout=5.0, silence=1.0)
    claims.start()
    try:
        assert wait_until(lambda: claims.synced, 10)
        body = _allocate(api, _claim(api, ns, "c", "any", 2), node_name, "gpu-0", 2)
        ref = ClaimRef(*_ref(body))
        outcome = asyncio.run(prepare_claims(driver, claims, [ref]))[ref.uid]
        assert outcome.claim is not None and outcome.claim.devices[0].device == "gpu-0"
        assert wait_until(lambda: not claims.current, 10)  # the quiet watch outlived its bound
        assert claims.cached(ref) is None
        assert wait_until(lambda: claims.current, 10)  # it listed again
        body["status"] = {}
        body = request(api, "PUT", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/c/status", body)
        body = _allocate(api, body, node_name, "gpu-1", 2)
        assert body["metadata"]["uid"] == ref.uid
        outcome = asyncio.run(prepare_claims(driver, claims, [ref]))[ref.uid]
        assert (
            outcome.error == "" and outcome.claim is not None and [d.device for d in outcome.claim.devices] == ["gpu-1"]
        )
        assert driver.ledger() == {"gpu-1": 2} and driver.reallocated == 1
    finally:
        claims.stop()

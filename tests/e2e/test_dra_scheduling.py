"""The published slices as a real kube-scheduler allocates them: claims asking shares or memory land on one GPU
each and never over its capacity, a tainted GPU gets no new claim, MIG and whole-GPU claims, the extended-resource
mapping of `<domain>/gpu`, the shipped example claims, class and claim SharingConfigs, and scheduling again after the
kubelet's wipe.

There is no kube-controller-manager: the tests create the ResourceClaims themselves and pods name them
(`resourceClaimName`); each pod is pinned to the test's node, since other tests' nodes publish slices too.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import yaml
from kubernetes import client

from deviceplugin.alloc.plan import build_resources
from deviceplugin.config.parse import parse_config, parse_config_text
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.dra.cdi import CdiWriter
from deviceplugin.dra.checkpoint import Checkpoint
from deviceplugin.dra.devices import ClaimError
from deviceplugin.dra.lock import SerialLock
from deviceplugin.dra.migdynamic import MigInstances
from deviceplugin.dra.prepare import ClaimRef, Driver
from deviceplugin.dra.slices import SlicePublisher
from deviceplugin.kube.dranames import driver_name
from deviceplugin.model.node import Gpu, NodeInfo
from deviceplugin.model.quantity import parse_quantity
from deviceplugin.state import NodeState
from tests.conftest import EXAMPLES, ROOT, node, wait_until
from tests.support.dra import claim, make_driver
from tests.support.kubeobjects import namespace, ready_node, request, slices

DRIVER = driver_name("example.com")
SCHEDULER = "gpu-share-dra-e2e"
DRA = ROOT / "daemonset" / "dra"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
_ids = itertools.count()


@pytest.fixture(scope="module")
def cluster(controlplane: Any) -> Iterator[Any]:
    """The shipped DeviceClasses and a kube-scheduler of our own name (other tests may run the default one)."""
    api = controlplane.api_client()
    created = []
    for document in yaml.safe_load_all((DRA / "02-deviceclasses.yaml").read_text()):
        try:
            request(api, "POST", "/apis/resource.k8s.io/v1/deviceclasses", document)
            created.append(document["metadata"]["name"])
        except client.ApiException as err:
            assert err.status == 409, err
    controlplane.scheduler({"profiles": [{"schedulerName": SCHEDULER}]}, name="dra-e2e")
    yield controlplane
    controlplane.stop_process("kube-scheduler#dra-e2e")
    for name in created:  # the session API server is shared: the chart's tests install DeviceClasses of these names
        request(api, "DELETE", f"/apis/resource.k8s.io/v1/deviceclasses/{name}")


class Node:
    """A simulated node with the publisher running for it, and a namespace for its pods."""

    def __init__(self, cluster: Any, node_file: str, config: Any, info: NodeInfo | None = None) -> None:
        """`info`: the node's GPUs when not an example node file (`node_file` then only names it)."""
        self.api = cluster.api_client()
        self.rest = cluster.rest_client()
        n = next(_ids)
        self.name = ready_node(self.api, f"sched-{n}-{node_file.lower()}")["metadata"]["name"]
        self.ns = namespace(self.api, f"dra-{n}")
        self.info = info or node(node_file)
        self.state = NodeState()
        self.publisher = SlicePublisher(
            self.rest, self.name, DRIVER, self.info, self.state, backoff_initial=0.02, backoff_max=0.2
        )
        self.resources = build_resources(config, self.info, dynamic_mig=True)  # what the DRA driver serves
        self.publisher.on_config(config, self.resources)
        self.publisher.start()
        assert self.publisher.wait_published(10)

    def claim(
        self,
        name: str,
        cls: str = "gpu-share-shares",
        requests: dict[str, str] | None = None,
        selector: str | None = None,
    ) -> None:
        exactly: dict[str, Any] = {"deviceClassName": cls}
        if requests:
            exactly["capacity"] = {"requests": requests}
        if selector:
            exactly["selectors"] = [{"cel": {"expression": selector}}]
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        }
        request(self.api, "POST", CLAIMS.format(ns=self.ns), body)

    def pod(self, name: str, claim: str | None = None, limits: dict[str, str] | None = None) -> None:
        container: dict[str, Any] = {"name": "app", "image": "registry.invalid/app:1"}
        spec: dict[str, Any] = {
            "schedulerName": SCHEDULER,
            "nodeSelector": {"kubernetes.io/hostname": self.name},
            "containers": [container],
        }
        if claim:
            spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
            container["resources"] = {"claims": [{"name": "gpu"}]}
        if limits:
            container["resources"] = {"limits": limits}
        client.CoreV1Api(self.api).create_namespaced_pod(self.ns, {"metadata": {"name": name}, "spec": spec})

    def bound(self, pod: str, timeout: float = 20) -> bool:
        """The scheduler bound the pod to the node (a pod found unschedulable first is tried again on slice changes)."""
        core = client.CoreV1Api(self.api)
        return wait_until(lambda: core.read_namespaced_pod(pod, self.ns).spec.node_name == self.name, timeout=timeout)

    def unschedulable(self, pod: str, timeout: float = 20) -> bool:
        """The scheduler found no room for the pod (and did not bind it)."""
        core = client.CoreV1Api(self.api)

        def refused() -> bool:
            found = core.read_namespaced_pod(pod, self.ns)
            return not found.spec.node_name and any(
                c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
                for c in found.status.conditions or []
            )

        return wait_until(refused, timeout=timeout)

    def allocation(self, claim: str) -> list[dict[str, Any]]:
        found = request(self.api, "GET", CLAIMS.format(ns=self.ns) + f"/{claim}")
        return (found.get("status", {}).get("allocation") or {}).get("devices", {}).get("results", [])

    def stop(self) -> None:
        self.publisher.stop()


@pytest.fixture
def make_node(cluster: Any) -> Iterator[Any]:
    nodes: list[Node] = []

    def make(node_file: str, config: Any, info: NodeInfo | None = None) -> Node:
        nodes.append(Node(cluster, node_file, config, info))
        return nodes[-1]

    yield make
    for n in nodes:
        n.stop()


def _shared(replicas: int) -> Any:
    return parse_config({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": replicas}]})


def _capacity(n: Node) -> dict[str, dict[str, Decimal]]:
    return {
        d["name"]: {k: parse_quantity(v["value"]) for k, v in d.get("capacity", {}).items()}
        for s in slices(n.api, n.name)
        for d in s["spec"].get("devices", [])
    }


def test_share_and_memory_claims_land_on_one_gpu_each_and_never_over_capacity(make_node: Any) -> None:
    n = make_node("2xT4", _shared(4))  # T4: 4 shares of 3840 MiB each
    asks = [
        ("a", {"shares": "3"}),
        ("b", {"shares": "3"}),
        ("c", {"memory": "3840Mi"}),
        ("d", {"shares": "1"}),
        ("e", {"shares": "1"}),
        ("f", {"memory": "7680Mi"}),
    ]
    # First fit: a and b take 3 shares of a GPU each, c and d fill them, nothing is left for e and f. One pod at a
    # time: a pod tried before the scheduler's cache holds its claim is retried after a backoff, by then behind the
    # next pod (seen in CI: e took d's share).
    placed = {name: name in "abcd" for name, _ in asks}
    for name, requests in asks:
        n.claim(name, requests=requests)
        n.pod(name, claim=name)
        assert n.bound(name) if placed[name] else n.unschedulable(name), name
    used: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    for name, requests in asks:
        results = n.allocation(name)
        if not placed[name]:
            assert results == []
            continue
        assert len(results) == 1, results  # one GPU per claim
        result = results[0]
        assert result["driver"] == DRIVER and result["pool"] == n.name and result["shareID"]
        for capacity, quantity in result["consumedCapacity"].items():
            used[result["device"]][capacity] += parse_quantity(quantity)
        wanted = {k: parse_quantity(v) for k, v in requests.items()}
        assert all(parse_quantity(result["consumedCapacity"][k]) == v for k, v in wanted.items())
    capacity = _capacity(n)
    assert set(used) == {"gpu-0", "gpu-1"}
    for device, consumed in used.items():
        assert all(consumed[k] <= capacity[device][k] for k in consumed), (device, dict(consumed))
        assert consumed["shares"] == capacity[device]["shares"]  # full: e and f found no room


def test_mixing_capacities_fits_the_schedulers_sums_and_not_the_drivers_ledger(make_node: Any, tmp_path: Any) -> None:
    """Why claims name one capacity (docs/dra.md#capacity-one-convention-per-cluster, the capacity policy): on a T4
    shared in 4 (shares of 3840 MiB), `shares: 3` and `memory: 11520Mi` (three shares' worth) both fit kube-scheduler's
    sums and are allocated on one GPU, and the driver's ledger refuses the second at prepare; with both naming shares,
    the second does not fit the sums and is never allocated there."""
    n = make_node("2xT4", _shared(4))
    for name, requests in (("a", {"shares": "3"}), ("b", {"memory": "11520Mi"})):
        n.claim(name, requests=requests)
        n.pod(name, claim=name)
        assert n.bound(name), name
    (a,), (b,) = n.allocation("a"), n.allocation("b")
    assert (
        a["device"] == b["device"] == "gpu-0"
    )  # first fit: the scheduler's sums are 4 of 4 shares, 15360 of 15360 MiB
    assert (parse_quantity(a["consumedCapacity"]["memory"]), parse_quantity(b["consumedCapacity"]["shares"])) == (
        3840 * 2**20,
        1,
    )
    driver = make_driver(
        tmp_path, pools=[{"name": "s", "mode": "shared", "replicas": 4}]
    )  # the node's driver, its ledger
    on_node = [{**r, "pool": "2xT4"} for r in (a, b)]  # make_driver serves the node file's pool name
    assert driver.prepare(*claim([on_node[0]], name="a")).devices[0].shares == 3
    with pytest.raises(ClaimError, match="device gpu-0 has 4 shares; prepared claims hold 3 and this claim needs 3"):
        driver.prepare(*claim([on_node[1]], name="b"))  # the kubelet would retry this for as long as a holds the GPU
    n.claim("c", requests={"shares": "3"})  # b under the convention: naming shares, the sums send it to gpu-1
    n.pod("c", claim="c")
    assert n.bound("c") and [r["device"] for r in n.allocation("c")] == ["gpu-1"]


def test_a_tainted_gpu_gets_no_new_claim_and_gets_them_again_once_healthy(make_node: Any) -> None:
    n = make_node("2xT4", _shared(2))
    n.state.set_health({n.info.gpus[0].uuid: "XID 79"}, frozenset({n.info.gpus[0].uuid}))
    assert n.publisher.wait_published(1)
    for name in ("a", "b", "c"):
        n.claim(name, requests={"shares": "1"})
        n.pod(name, claim=name)
        if name == "c":
            assert n.unschedulable(name)
        else:
            assert n.bound(name) and [r["device"] for r in n.allocation(name)] == ["gpu-1"]
    n.state.set_health({})  # recovered: the waiting pod gets the GPU
    assert n.publisher.wait_published(1)
    assert n.bound("c") and [r["device"] for r in n.allocation("c")] == ["gpu-0"]


def test_mig_and_whole_gpu_claims_and_the_extended_resource_mapping(make_node: Any) -> None:
    mig = make_node(
        "8xA100-80GB-mig", parse_config_text((EXAMPLES / "config" / "mig-mixed.yaml").read_text(), "mig-mixed")
    )
    mig.claim("m", cls="gpu-share-mig", selector="device.attributes[device.driver].migProfile == '3g.40gb'")
    mig.pod("m", claim="m")
    assert mig.bound("m")
    [result] = mig.allocation("m")
    assert result["device"].startswith("gpu-1-mig-") and "shareID" not in result
    whole = make_node("2xT4", parse_config({"version": "v1", "pools": [{"name": "w", "mode": "exclusive"}]}))
    whole.claim("g", cls="gpu-share-gpu")
    whole.pod("g", claim="g")
    assert whole.bound("g") and [r["device"] for r in whole.allocation("g")] == ["gpu-0"]
    whole.pod("legacy", limits={"example.com/gpu": "1"})  # an unchanged device-plugin pod
    assert whole.bound("legacy")
    status = client.CoreV1Api(whole.api).read_namespaced_pod("legacy", whole.ns).status.extended_resource_claim_status
    assert status and status.request_mappings[0].resource_name == "example.com/gpu"
    assert [r["device"] for r in whole.allocation(status.resource_claim_name)] == ["gpu-1"]
    whole.pod("too-many", limits={"example.com/gpu": "1"})
    assert whole.unschedulable("too-many")


def test_the_shipped_example_claims_schedule(make_node: Any) -> None:
    shares = make_node(
        "8xA100-80GB-mig", parse_config_text((EXAMPLES / "config" / "mig-mixed.yaml").read_text(), "mig-mixed")
    )
    for example in ("claim-shares", "claim-shares-ampere", "claim-mig"):
        for document in yaml.safe_load_all((DRA / "examples" / f"{example}.yaml").read_text()):
            if document["kind"] == "ResourceClaim":
                request(shares.api, "POST", CLAIMS.format(ns=shares.ns), document)
            else:
                document["spec"] |= {
                    "schedulerName": SCHEDULER,
                    "nodeSelector": {"kubernetes.io/hostname": shares.name},
                }
                client.CoreV1Api(shares.api).create_namespaced_pod(shares.ns, document)
        pod = next(
            d for d in yaml.safe_load_all((DRA / "examples" / f"{example}.yaml").read_text()) if d["kind"] == "Pod"
        )
        assert shares.bound(pod["metadata"]["name"]), example
    for name, shares_asked in (("three-shares", 3), ("ampere-shares", 2)):  # the convention: claims name shares
        [result] = shares.allocation(name)
        device = next(
            d for s in slices(shares.api, shares.name) for d in s["spec"]["devices"] if d["name"] == result["device"]
        )
        step = parse_quantity(device["capacity"]["memory"]["requestPolicy"]["validRange"]["step"])  # one share's memory
        assert parse_quantity(result["consumedCapacity"]["shares"]) == shares_asked, name
        assert parse_quantity(result["consumedCapacity"]["memory"]) == step, name  # memory at its default: one share


def test_claims_schedule_again_after_the_kubelets_wipe(make_node: Any) -> None:
    n = make_node("2xT4", _shared(2))
    request(
        n.api, "DELETE", "/apis/resource.k8s.io/v1/resourceslices", query=[("fieldSelector", f"spec.nodeName={n.name}")]
    )
    n.claim("after", requests={"shares": "2"})
    n.pod("after", claim="after")
    assert n.bound("after")
    assert len(n.allocation("after")) == 1


# --- dynamic MIG: kube-scheduler allocates through the counters, the driver makes what it allocated -----------------

DYNAMIC = parse_config({"version": "v1", "pools": [{"name": "dyn", "mode": "mig", "strategy": "dynamic"}]})


class MigNode:
    """One simulated H100 with MIG mode on and no instance, published as dynamic MIG, with the driver that prepares
    the claims the scheduler allocates on it (transport-free: `dra.prepare.Driver` over the simulated NVML)."""

    def __init__(self, make_node: Any, tmp_path: Any, config: Any = DYNAMIC) -> None:
        gpu = Gpu(
            index=0,
            uuid="GPU-c41e9d27-55a0-4b1f-9e3d-0000000000d0",
            model="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            mig_capable=True,
            mig_enabled=True,
            compute_capability="9.0",
        )
        self.inventory = SimulatedInventory(NodeInfo(gpus=(gpu,), name="h100"))
        self.gpu = gpu.uuid
        self.n: Node = make_node("1xh100-mig", config, self.inventory.discover())
        self.driver = Driver(
            DRIVER,
            self.n.name,
            Checkpoint(tmp_path / "claims"),
            CdiWriter(tmp_path / "cdi", DRIVER),
            NodeState(),
            SerialLock(tmp_path / "serialize.lock"),
            MigInstances(self.inventory, self.inventory.processes),
        )
        self.driver.on_config(config, self.n.resources)

    def ask(self, name: str, profile: str, shares: str | None = None, start: int | None = None) -> None:
        """A claim for a profile (at one placement: `start`); with `shares`, that many shares of a shared one."""
        selector = f"device.attributes[device.driver].migProfile == '{profile}'"
        if start is not None:
            selector += f" && device.attributes[device.driver].migPlacementStart == {start}"
        cls, requests = ("gpu-share-shares", {"shares": shares}) if shares else ("gpu-share-mig", None)
        self.n.claim(name, cls=cls, requests=requests, selector=selector)
        self.n.pod(name, claim=name)

    def prepare(self, name: str) -> str:
        """What the kubelet's NodePrepareResources does for the pod's claim: the MIG UUID its container gets."""
        found = request(self.n.api, "GET", CLAIMS.format(ns=self.n.ns) + f"/{name}")
        ref = ClaimRef(self.n.ns, name, found["metadata"]["uid"])
        (device,) = self.driver.prepare(ref, found).devices
        assert device.mig is not None and device.mig.uuid
        return device.mig.uuid

    def release(self, name: str) -> None:
        """Unprepare, delete the pod, and free the claim as kube-controller-manager would (no KCM runs here)."""
        found = request(self.n.api, "GET", CLAIMS.format(ns=self.n.ns) + f"/{name}")
        self.driver.unprepare(ClaimRef(self.n.ns, name, found["metadata"]["uid"]))
        client.CoreV1Api(self.n.api).delete_namespaced_pod(name, self.n.ns, grace_period_seconds=0)
        path = CLAIMS.format(ns=self.n.ns) + f"/{name}"
        found["status"] = {}  # deallocated: no allocation, reserved for no pod
        found = request(self.n.api, "PUT", path + "/status", found)
        found["metadata"]["finalizers"] = []  # the scheduler's delete protection, which KCM lifts once deallocated
        request(self.n.api, "PUT", path, found)
        request(self.n.api, "DELETE", path)

    def consumed(self, names: list[str]) -> dict[str, int]:
        """The counters the allocated devices of these claims consume together."""
        devices = {d["name"]: d for s in slices(self.n.api, self.n.name) for d in s["spec"].get("devices", [])}
        used: dict[str, int] = defaultdict(int)
        for name in names:
            for result in self.n.allocation(name):
                for counters in devices[result["device"]]["consumesCounters"]:
                    for counter, value in counters["counters"].items():
                        used[counter] += int(parse_quantity(value["value"]))
        return dict(used)

    def totals(self) -> dict[str, int]:
        (counter_set,) = [c for s in slices(self.n.api, self.n.name) for c in s["spec"].get("sharedCounters", [])]
        return {k: int(parse_quantity(v["value"])) for k, v in counter_set["counters"].items()}


def test_dynamic_mig_claims_are_placed_by_the_scheduler_through_the_counters(make_node: Any, tmp_path: Any) -> None:
    m = MigNode(make_node, tmp_path)
    assert [("sharedCounters" in s["spec"], len(s["spec"].get("devices", []))) for s in slices(m.n.api, m.n.name)] == [
        (True, 0),
        (False, 25),
    ]
    for name, profile in (("one", "1g.10gb"), ("two", "2g.20gb"), ("three", "3g.40gb")):
        m.ask(name, profile)
        assert m.n.bound(name), name
    used, totals = m.consumed(["one", "two", "three"]), m.totals()
    assert all(used[k] <= totals[k] for k in used) and used["compute-slices"] == 6
    assert all(used.get(f"memory-slice-{i}", 0) <= 1 for i in range(8))
    made = {m.prepare(name) for name in ("one", "two", "three")}  # NVML makes every placement the scheduler chose
    assert {i.uuid for i in m.inventory.mig_instances(m.gpu)} == made and len(made) == 3
    for name, profile in (
        ("seven", "7g.80gb"),
        ("another", "1g.10gb"),
    ):  # no room left: refused by the scheduler, not at prepare
        m.ask(name, profile)
        assert m.n.unschedulable(name), name
        assert m.n.allocation(name) == []
    for name in ("another", "one", "two", "three"):  # the pending 1g first, or it takes the first slice freed
        m.release(name)
    assert m.inventory.mig_instances(m.gpu) == ()
    assert m.n.bound("seven")  # the freed counters take another mix: the whole GPU
    whole = m.prepare("seven")
    assert [(i.uuid, i.size) for i in m.inventory.mig_instances(m.gpu)] == [(whole, 8)]
    m.release("seven")
    for name, profile in (("four", "4g.40gb"), ("three-b", "3g.40gb")):  # then 4g + 3g, and nothing beside those
        m.ask(name, profile)
        assert m.n.bound(name), name
        m.prepare(name)
    assert (
        sorted(i.size for i in m.inventory.mig_instances(m.gpu)) == [4, 4]
        and m.consumed(["four", "three-b"])["compute-slices"] == 7
    )
    m.ask("last", "1g.10gb")
    assert m.n.unschedulable("last")
    # The API server kept the counter slice and the devices as sent (quantities aside): the publisher never rewrote
    # them.
    assert m.n.publisher.stats.writes == {"create": 2, "update": 0, "delete": 0} and m.n.publisher.stats.in_sync


def test_class_and_claim_sharing_configs_and_the_example_reach_the_claim(make_node: Any, tmp_path: Any) -> None:
    """kube-scheduler copies the DeviceClass's config (source FromClass, naming the class's requests) and then the
    claim's (FromClaim) into the allocation; the driver, reading the claim from the API, applies the claim's to the
    request it names and the class's to the other. The shipped example claim is accepted, allocated and applied."""
    import asyncio
    import json

    from deviceplugin.dra.claims import ApiClaims
    from deviceplugin.dra.prepare import ClaimRef, prepare_claims
    from deviceplugin.dra.sharingconfig import api_version
    from tests.support.dra import MPS_POOLS, make_driver

    def sharing(percent: int) -> dict[str, Any]:
        mps = {"strategy": "mps", "mpsConfig": {"defaultActiveThreadPercentage": percent}}
        parameters = {"apiVersion": api_version(DRIVER), "kind": "SharingConfig", "sharing": mps}
        return {"opaque": {"driver": DRIVER, "parameters": parameters}}

    def percents(uid: str) -> dict[str, str]:
        """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE per CDI device of the claim's spec."""
        spec = json.loads(driver.cdi.spec_path(uid).read_text())
        envs = {d["name"]: dict(e.split("=", 1) for e in d["containerEdits"]["env"]) for d in spec["devices"]}
        return {name: env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for name, env in envs.items()}

    n = make_node("2xT4", parse_config({"version": "v1", "pools": MPS_POOLS}))
    section = (ROOT / "docs" / "dra.md").read_text().split("## Sharing chosen per claim")[1].split("\n## ")[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    documents = [d for block in blocks for d in yaml.safe_load_all(block)]
    (documented,) = [d for d in documents if d.get("kind") == "DeviceClass"]  # the docs' class: 10 % for its claims
    device_class = documented["metadata"]["name"] = f"gpu-share-mps-capped-{next(_ids)}"
    request(n.api, "POST", "/apis/resource.k8s.io/v1/deviceclasses", documented)
    driver = make_driver(tmp_path)
    driver.pool = n.name  # the example node's devices, in this node's pool
    claims = ApiClaims(n.rest, DRIVER, n.name, timeout=5.0, cache=False)
    try:
        two = {"deviceClassName": device_class, "capacity": {"requests": {"shares": "2"}}}
        requests = [{"name": r, "exactly": two} for r in ("a", "b")]
        devices = {"requests": requests, "config": [{"requests": ["a"], **sharing(5)}]}
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "capped"},
            "spec": {"devices": devices},
        }
        request(n.api, "POST", CLAIMS.format(ns=n.ns), body)
        n.pod("capped", claim="capped")
        assert n.bound("capped")
        stored = request(n.api, "GET", CLAIMS.format(ns=n.ns) + "/capped")
        configs = [
            (c["source"], c.get("requests"), c["opaque"]["parameters"]["sharing"]["mpsConfig"])
            for c in stored["status"]["allocation"]["devices"]["config"]
        ]
        percent = "defaultActiveThreadPercentage"
        # The class's config first, naming the claim's requests of that class; then the claim's.
        assert configs == [("FromClass", ["a", "b"], {percent: 10}), ("FromClaim", ["a"], {percent: 5})]
        ref = ClaimRef(n.ns, "capped", stored["metadata"]["uid"])
        outcome = asyncio.run(prepare_claims(driver, claims, [ref]))[ref.uid]
        assert outcome.error == "" and outcome.claim is not None, outcome.error
        assert percents(ref.uid) == {f"{ref.uid}-0": "5", f"{ref.uid}-1": "10"}  # a: the claim's config; b: the class's
        # The shipped example: its config is accepted by the API server, allocated on the MPS pool and applied.
        for document in yaml.safe_load_all((DRA / "examples" / "claim-mps-limits.yaml").read_text()):
            if document["kind"] == "ResourceClaim":
                example = request(n.api, "POST", CLAIMS.format(ns=n.ns), document)
            else:
                document["spec"] |= {"schedulerName": SCHEDULER, "nodeSelector": {"kubernetes.io/hostname": n.name}}
                client.CoreV1Api(n.api).create_namespaced_pod(n.ns, document)
        assert n.bound("mps-capped")
        ref = ClaimRef(n.ns, "mps-capped", example["metadata"]["uid"])
        outcome = asyncio.run(prepare_claims(driver, claims, [ref]))[ref.uid]
        assert outcome.error == "" and outcome.claim is not None and outcome.claim.devices[0].shares == 4, outcome.error
        edits = json.loads(driver.cdi.spec_path(ref.uid).read_text())["devices"][0]["containerEdits"]
        env = dict(e.split("=", 1) for e in edits["env"])
        assert (env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == ("20", "0=4096M")
    finally:
        request(n.api, "DELETE", f"/apis/resource.k8s.io/v1/deviceclasses/{device_class}")  # the API server is shared


def test_a_claim_selecting_a_strategy_its_pool_lacks_is_refused_by_the_scheduler(make_node: Any) -> None:
    """The pool's sharing strategies as bool attributes (`sharingTimeSlicing`, `sharingMPS`): a claim whose
    SharingConfig asks for MPS selects `sharingMPS` and is refused at scheduling on a time-sliced pool, not at
    prepare."""
    mps = "device.attributes[device.driver].sharingMPS"
    sliced = make_node("2xT4", _shared(2))
    sliced.claim("wants-mps", requests={"shares": "1"}, selector=mps)
    sliced.pod("wants-mps", claim="wants-mps")
    assert sliced.unschedulable("wants-mps") and sliced.allocation("wants-mps") == []
    sliced.claim("sliced", requests={"shares": "1"}, selector="device.attributes[device.driver].sharingTimeSlicing")
    sliced.pod("sliced", claim="sliced")
    assert sliced.bound("sliced")
    from tests.support.dra import MPS_POOLS

    with_mps = make_node("2xT4", parse_config({"version": "v1", "pools": MPS_POOLS}))
    with_mps.claim("gets-mps", requests={"shares": "1"}, selector=mps)
    with_mps.pod("gets-mps", claim="gets-mps")
    assert with_mps.bound("gets-mps") and len(with_mps.allocation("gets-mps")) == 1


def test_an_instance_made_behind_the_drivers_back_withdraws_its_placements_until_gone(
    make_node: Any, tmp_path: Any
) -> None:
    m = MigNode(make_node, tmp_path)
    m.n.publisher.kept_mig = m.driver.mig.kept  # as the DRA daemon wires it
    one = next(p for p in m.inventory.mig_profiles(m.gpu) if p.name == "1g.10gb")
    behind = m.inventory.create_compute_instance(m.gpu, m.inventory.create_gpu_instance(m.gpu, one.id, 6))  # nvidia-smi
    assert m.driver.rescan_mig()
    m.n.publisher.republish()
    assert wait_until(lambda: m.totals()["memory-slice-6"] == 0, timeout=10)
    m.ask("seven", "7g.80gb")  # overlaps the instance: not offered, refused by the scheduler
    assert m.n.unschedulable("seven")
    m.inventory.destroy_compute_instance(m.gpu, behind.gi_id, behind.ci_id)
    m.inventory.destroy_gpu_instance(m.gpu, behind.gi_id)
    assert m.driver.rescan_mig()
    m.n.publisher.republish()
    assert m.n.bound("seven")
    m.prepare("seven")


def test_share_claims_land_on_one_dynamic_mig_device_whose_counters_are_charged_once(
    make_node: Any, tmp_path: Any
) -> None:
    """`replicas: 2` on the dynamic pool: each profile device has 2 shares. Two share claims land on one device and get
    one instance; a third is refused by the scheduler; the device's counters are charged once for both (4g + 2g + the
    shared 1g take all 7 compute slices only if the 1g counts once), and the instance goes with its last holder."""
    shared = parse_config(
        {"version": "v1", "pools": [{"name": "dyn", "mode": "mig", "strategy": "dynamic", "replicas": 2}]}
    )
    m = MigNode(make_node, tmp_path, shared)
    stored = {d["name"]: d for sl in slices(m.n.api, m.n.name) for d in sl["spec"].get("devices", [])}
    device = stored["gpu-0-mig-1g-10gb-6"]  # the API server kept both: consumable capacity and counters
    assert (
        device["allowMultipleAllocations"]
        and device["consumesCounters"]
        and "requestPolicy" in device["capacity"]["shares"]
    )
    for name in ("s1", "s2"):
        m.ask(name, "1g.10gb", shares="1", start=6)
        assert m.n.bound(name), name
    (r1,), (r2,) = m.n.allocation("s1"), m.n.allocation("s2")
    assert r1["device"] == r2["device"] == "gpu-0-mig-1g-10gb-6" and r1["shareID"] != r2["shareID"]
    assert r1["consumedCapacity"]["shares"] == r2["consumedCapacity"]["shares"] == "1"
    m.ask("s3", "1g.10gb", shares="1", start=6)  # its 2 shares are held: refused by the scheduler, not at prepare
    assert m.n.unschedulable("s3") and m.n.allocation("s3") == []
    for name, profile, start in (("four", "4g.40gb", 0), ("two", "2g.20gb", 4)):
        m.ask(name, profile, shares="1", start=start)
        assert m.n.bound(name), name  # 1 + 4 + 2 = 7 compute slices: charged per claim, the 1g would take 2
    totals = m.totals()
    per_device = m.consumed(["s1", "four", "two"])  # the shared device once
    assert per_device["compute-slices"] == totals["compute-slices"] == 7
    m.ask("more", "1g.10gb", shares="1")  # no compute slice is left, and the shared 1g's shares are held
    assert m.n.unschedulable("more")
    uuids = {name: m.prepare(name) for name in ("s1", "s2", "four", "two")}
    assert uuids["s1"] == uuids["s2"] and len(set(uuids.values())) == 3 and m.driver.mig.made == 3
    assert {i.uuid for i in m.inventory.mig_instances(m.gpu)} == set(uuids.values())
    m.release("s1")  # s2 still holds the instance
    assert uuids["s2"] in {i.uuid for i in m.inventory.mig_instances(m.gpu)}
    m.release("s2")
    assert uuids["s2"] not in {i.uuid for i in m.inventory.mig_instances(m.gpu)}
    assert m.n.bound("s3")  # the device's shares are free again: the pending claim lands on it
    assert m.n.publisher.stats.writes == {"create": 2, "update": 0, "delete": 0}  # kept as sent, never rewritten

"""daemonset/dra/ on the real API server: every object is accepted as rendered by kustomize, and the admission
policies hold: the driver's ServiceAccount, with a token bound to its pod on one node, may write only that node's
slices, and no DeviceClass may back `<domain>/gpu-share`."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import uuid
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.conftest import ROOT, wait_until
from tests.support.kubeobjects import apply, delete, namespace, ready_node, request

KUBECTL = shutil.which("kubectl")
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
_ids = itertools.count()

pytestmark = pytest.mark.skipif(not KUBECTL, reason="kubectl is not installed (kustomize renders the manifests)")


def _rendered() -> list[dict[str, Any]]:
    proc = subprocess.run(
        [str(KUBECTL), "kustomize", str(ROOT / "daemonset" / "dra")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def installed(controlplane: Any) -> Any:
    api = controlplane.api_client()
    try:
        client.CoreV1Api(api).create_namespace({"metadata": {"name": "gpu-share"}})
    except client.ApiException as err:
        assert err.status == 409
    objects = _rendered()
    for obj in objects:
        apply(api, obj)
    yield controlplane
    for obj in objects:  # the session API server is shared: the chart's tests install objects of these names
        if obj["kind"] != "Namespace":
            delete(api, obj)
    # The capacity policy refuses memory claims for gpu-share-shares cluster-wide until the API server drops it:
    # wait for that, so later modules (tests/e2e/test_dra_scheduling.py mixes both on purpose) are not refused.
    memory = _claim("ResourceClaim", "after", "gpu-share-shares", {"memory": "1Gi"})
    assert wait_until(lambda: _create_refusal(api, "gpu-share", memory) == "", timeout=30)


def _driver_client(cp: Any, node: str) -> Any:
    """A kubernetes ApiClient with the token of a gpu-share-dra pod bound to `node`."""
    configuration = client.Configuration()
    configuration.host = cp.server
    configuration.verify_ssl = False
    configuration.api_key = {"BearerToken": _driver_token(cp, node)}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    return client.ApiClient(configuration)


def _driver_rest(cp: Any, node: str) -> Any:
    """A `kube.rest` client (what the driver runs with) with the token of a gpu-share-dra pod bound to `node`."""
    from deviceplugin.kube.rest import Connection, RestClient

    return RestClient(Connection(cp.server, verify=False, token=_driver_token(cp, node)))


def _driver_token(cp: Any, node: str) -> str:
    """The token of a gpu-share-dra pod bound to `node` (TokenRequest, bound to the pod)."""
    admin = cp.api_client()
    pod = client.CoreV1Api(admin).create_namespaced_pod(
        "gpu-share",
        {
            "metadata": {"generateName": "gpu-share-dra-"},
            "spec": {
                "serviceAccountName": "gpu-share-dra",
                "nodeName": node,
                "containers": [{"name": "driver", "image": "registry.invalid/gpu-share:1"}],
            },
        },
    )
    token = request(
        admin,
        "POST",
        "/api/v1/namespaces/gpu-share/serviceaccounts/gpu-share-dra/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": ["https://kubernetes.default.svc"],
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": pod.metadata.name,
                    "uid": pod.metadata.uid,
                },
            },
        },
    )["status"]["token"]
    return str(token)


def _slice(node: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpu-share.example.com-{next(_ids):04d}"},
        "spec": {
            "driver": "gpu-share.example.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            **spec,
        },
    }


def _refusal(api: Any, method: str, path: str, body: Any = None, query: list | None = None) -> str:
    """The Forbidden message of a refused request; "" if it was allowed."""
    try:
        request(api, method, path, body, query)
    except client.ApiException as err:
        assert err.status == 403, err
        return str(err.body)
    return ""


def test_every_object_is_accepted_by_the_api_server(installed: Any) -> None:
    api = installed.api_client()
    kinds = {obj["kind"] for obj in _rendered()}
    assert kinds == {
        "ConfigMap",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DeviceClass",
        "DaemonSet",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    daemonset = request(api, "GET", "/apis/apps/v1/namespaces/gpu-share/daemonsets/gpu-share-dra")
    mounts = {m["mountPath"] for m in daemonset["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins/gpu-share.example.com",
        "/var/run/cdi",
    } <= mounts


def test_the_driver_may_write_only_slices_of_its_own_node(installed: Any) -> None:
    admin = installed.api_client()
    mine, other = f"vap-{next(_ids)}", f"vap-{next(_ids)}"
    ready_node(admin, mine)
    ready_node(admin, other)
    driver = _driver_client(installed, mine)
    foreign = _slice(other)
    # The policy takes effect a moment after it is created: probe with dry runs until it refuses.
    assert wait_until(lambda: _refusal(driver, "POST", SLICES, foreign, [("dryRun", "All")]) != "", timeout=10)
    assert f"only ResourceSlices of the node its pod runs on ({mine})" in _refusal(driver, "POST", SLICES, foreign)
    own = request(driver, "POST", SLICES, _slice(mine))  # its own node: allowed (RBAC and the policy)
    own["spec"]["devices"] = [{"name": "gpu-0"}]
    request(driver, "PUT", f"{SLICES}/{own['metadata']['name']}", own)
    theirs = request(admin, "POST", SLICES, _slice(other))
    assert _refusal(driver, "DELETE", f"{SLICES}/{theirs['metadata']['name']}")
    assert _refusal(
        driver, "POST", SLICES, {**_slice(mine), "spec": {**_slice(mine)["spec"], "driver": "other.example.com"}}
    )
    every = _slice(mine)
    del every["spec"]["nodeName"]
    every["spec"]["allNodes"] = True
    assert _refusal(driver, "POST", SLICES, every)
    request(driver, "DELETE", f"{SLICES}/{own['metadata']['name']}")
    assert _refusal(admin, "POST", SLICES, _slice(other)) == ""  # the admin is not limited


def test_no_device_class_may_back_the_share_resource(installed: Any) -> None:
    api = installed.api_client()
    cls = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": f"shares-{next(_ids)}"},
        "spec": {
            "extendedResourceName": "example.com/gpu-share",
            "selectors": [{"cel": {"expression": "device.driver == 'gpu-share.example.com'"}}],
        },
    }
    refused: list[str] = []

    def refuses() -> bool:
        try:
            apply(api, cls, dry_run=True)
        except client.ApiException as err:
            assert err.status == 422, err
            refused.append(str(err.body))
            return True
        return False

    assert wait_until(refuses, timeout=10)
    assert "k distinct GPUs with one share each" in refused[-1] and "capacity: {requests: {shares: k}}" in refused[-1]
    cls["spec"]["extendedResourceName"] = "example.com/gpu-shared-elsewhere"
    apply(api, cls, dry_run=True)  # any other name is fine


def test_the_dra_only_component_refuses_share_pods_with_the_claim_to_write(installed: Any, tmp_path: Any) -> None:
    copy = tmp_path / "dra"
    shutil.copytree(ROOT / "daemonset" / "dra", copy)
    text = (
        (copy / "kustomization.yaml")
        .read_text()
        .replace("# components:\n#   - optional/dra-only", "components:\n  - optional/dra-only")
    )
    (copy / "kustomization.yaml").write_text(text)
    proc = subprocess.run([str(KUBECTL), "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rendered = [
        d for d in yaml.safe_load_all(proc.stdout) if d and d["metadata"]["name"] == "gpu-share-dra-only-share-requests"
    ]
    assert sorted(d["kind"] for d in rendered) == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    api = installed.api_client()
    ns = f"dra-only-{next(_ids)}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": ns, "labels": {"gpu-share-test": ns}}})
    client.CoreV1Api(api).create_namespaced_service_account(ns, {"metadata": {"name": "default"}})
    for obj in rendered:
        if obj["kind"] == "ValidatingAdmissionPolicyBinding":  # this namespace only: other tests share the API server
            obj["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {"gpu-share-test": ns}}}
        apply(api, obj)

    def pod(limits: dict[str, str]) -> dict[str, Any]:
        return {
            "metadata": {"generateName": "p-"},
            "spec": {
                "containers": [{"name": "app", "image": "registry.invalid/app:1", "resources": {"limits": limits}}]
            },
        }

    refused: list[str] = []

    def refuses() -> bool:
        try:
            client.CoreV1Api(api).create_namespaced_pod(ns, pod({"example.com/gpu-share": "3"}), dry_run="All")
        except client.ApiException as err:
            assert err.status == 422, err
            refused.append(str(err.body))
            return True
        return False

    assert wait_until(refuses, timeout=10)
    assert (
        "container app asks for example.com/gpu-share, which no node serves" in refused[-1]
        and "capacity: {requests: {shares:" in refused[-1]
    )
    client.CoreV1Api(api).create_namespaced_pod(
        ns, pod({"example.com/gpu": "1"}), dry_run="All"
    )  # whole GPUs are mapped: allowed


def _claim(
    kind: str, name: str, cls: str, requests: dict[str, str] | None, first_available: bool = False
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls, **({"capacity": {"requests": requests}} if requests else {})}
    request_ = (
        {
            "name": "gpu",
            "firstAvailable": [{"name": "big", "deviceClassName": "gpu-share-gpu"}, {"name": "part", **exactly}],
        }
        if first_available
        else {"name": "gpu", "exactly": exactly}
    )
    spec = {"devices": {"requests": [request_]}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": {"spec": spec} if kind == "ResourceClaimTemplate" else spec,
    }


def _create_refusal(api: Any, ns: str, body: dict[str, Any]) -> str:
    """The Invalid message of a refused dry-run create; "" if it was admitted."""
    plural = "resourceclaimtemplates" if body["kind"] == "ResourceClaimTemplate" else "resourceclaims"
    try:
        request(api, "POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/{plural}", body, [("dryRun", "All")])
    except client.ApiException as err:
        assert err.status == 422, err
        return str(json.loads(err.body)["message"])
    return ""


def test_claims_for_the_shares_class_name_the_clusters_capacity(installed: Any) -> None:
    """The shipped convention (shares): a claim or template naming `memory` for gpu-share-shares is refused, saying to
    name shares and how many that is under each of the config's shared pools; shares, neither, or memory of another
    class are admitted."""
    api = installed.api_client()
    ns = namespace(api, f"capacity-{next(_ids)}")
    memory = _claim("ResourceClaim", "twenty-gib", "gpu-share-shares", {"memory": "20Gi"})
    assert wait_until(lambda: _create_refusal(api, ns, memory) != "", timeout=10)
    said = _create_refusal(api, ns, memory)
    assert (
        "ResourceClaim twenty-gib: request gpu names capacity memory: 20Gi of DeviceClass gpu-share-shares, "
        "but claims in this cluster name shares" in said
    ), said
    assert 'Write capacity: {requests: {shares: "K"}} instead, K = 20Gi / one share\'s memory, rounded up' in said, said
    assert (
        "inference/shares: floor(GPU memory / 4096 MiB) shares per GPU of at least 4096 MiB each, so at most 5 shares"
        in said
    ), said
    assert "mps/mps: 4 shares per GPU of 1/4 of its memory each" in said and "mig/shares: 8 shares per GPU" in said, (
        said
    )
    template = _claim("ResourceClaimTemplate", "per-pod", "gpu-share-shares", {"memory": "6Gi", "shares": "2"})
    assert "ResourceClaimTemplate per-pod: request gpu names capacity memory: 6Gi" in _create_refusal(api, ns, template)
    fallback = _claim("ResourceClaim", "fallback", "gpu-share-shares", {"memory": "4Gi"}, first_available=True)
    assert "request gpu/part names capacity memory: 4Gi" in _create_refusal(api, ns, fallback)
    for admitted in (
        _claim("ResourceClaim", "three", "gpu-share-shares", {"shares": "3"}),
        _claim("ResourceClaim", "one", "gpu-share-shares", None),
        _claim("ResourceClaimTemplate", "per-pod", "gpu-share-shares", {"shares": "2"}),
        _claim("ResourceClaim", "fallback", "gpu-share-shares", {"shares": "1"}, first_available=True),
        _claim("ResourceClaim", "other-class", "someone-elses", {"memory": "20Gi"}),
    ):
        assert _create_refusal(api, ns, admitted) == "", admitted


def test_a_memory_convention_refuses_shares_naming_the_memory_to_ask(installed: Any) -> None:
    """With capacity=memory (the kustomization's literal, the chart's dra.capacity) the policy refuses `shares`. Run
    under names and a DeviceClass of this test's own (the shipped policy stays in place), deleted afterwards."""
    api = installed.api_client()
    run = next(_ids)
    ns = namespace(api, f"capacity-{run}")
    cls = f"gpu-share-shares-{run}"
    objects = [d for d in _rendered() if d["metadata"]["name"] == "gpu-share-dra-capacity-convention"]
    for obj in objects:
        obj["metadata"]["name"] = f"capacity-memory-{run}"
        if obj["kind"] == "ValidatingAdmissionPolicy":
            variables = {v["name"]: v for v in obj["spec"]["variables"]}
            variables["capacity"]["expression"] = "'memory'"
            variables["shareClass"]["expression"] = f"'{cls}'"
        else:
            obj["spec"]["policyName"] = f"capacity-memory-{run}"
    try:
        for obj in objects:
            apply(api, obj)
        shares = _claim("ResourceClaim", "three", cls, {"shares": "3"})
        assert wait_until(lambda: _create_refusal(api, ns, shares) != "", timeout=10)
        said = _create_refusal(api, ns, shares)
        assert (
            f"request gpu names capacity shares: 3 of DeviceClass {cls}, but claims in this cluster name memory" in said
        ), said
        assert "Write capacity: {requests: {memory: M}} instead, M = 3 x one share's memory" in said, said
        assert (
            "inference/shares: floor(GPU memory / 4096 MiB) shares per GPU of at least 4096 MiB each, "
            "so 3 shares are at least 12288Mi" in said
        ), said
        assert "mps/mps: 4 shares per GPU of 1/4 of its memory each, so 3/4 of the GPU's memory" in said, said
        assert _create_refusal(api, ns, _claim("ResourceClaim", "twenty", cls, {"memory": "20Gi"})) == ""
    finally:
        for obj in objects:  # cluster-scoped: the session API server is shared
            delete(api, obj)


def _allocated_claim(admin: Any, ns: str, name: str, node: str) -> dict[str, Any]:
    """A claim allocated on `node` to the driver's gpu-0, 2 of its shares, as kube-scheduler writes it (as admin)."""
    claim = request(
        admin,
        "POST",
        f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share-shares"}}]}},
        },
    )
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": "gpu-share.example.com",
                        "pool": node,
                        "device": "gpu-0",
                        "shareID": str(uuid.uuid4()),
                        "consumedCapacity": {"shares": "2"},
                    }
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
            },
        }
    }
    return request(admin, "PUT", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}/status", claim)


def test_the_driver_labels_only_its_own_node_and_writes_status_devices_only_of_claims_on_it(
    installed: Any, tmp_path: Any
) -> None:
    """The DRA RBAC and 07-node-patch-policy.yaml with a token bound to a driver pod on one node: it patches that
    Node's labels and annotations (not its spec, not another Node), posts Events, and writes status.devices (the
    driver's own writer, dra.claimstatus) of a claim allocated on its node, never of one allocated elsewhere."""
    from deviceplugin.dra.checkpoint import PreparedClaim, PreparedDevice
    from deviceplugin.dra.claimstatus import ClaimStatusWriter
    from deviceplugin.kube.client import NodeClient
    from deviceplugin.kube.rest import ApiError
    from tests.support.dra import make_driver

    admin = installed.api_client()
    mine, other = f"own-{next(_ids)}", f"own-{next(_ids)}"
    ready_node(admin, mine)
    ready_node(admin, other)
    driver = _driver_rest(installed, mine)
    own, theirs = NodeClient(driver, mine), NodeClient(driver, other)

    def refused_elsewhere() -> bool:
        try:
            theirs.patch_metadata({"example.com/gpu.count": "2"}, {})
        except ApiError as err:
            assert err.status == 403, err
            return "gpu-share-dra may patch only the node its pod runs on" in err.message
        return False

    assert wait_until(refused_elsewhere, timeout=10)  # the policy takes effect a moment after it is created
    own.patch_metadata({"example.com/gpu.count": "2"}, {"example.com/gpu-share.inventory": "{}"})
    assert own.labels()["example.com/gpu.count"] == "2"
    with pytest.raises(ApiError, match="only the labels and annotations"):
        driver.patch(f"/api/v1/nodes/{mine}", {"spec": {"unschedulable": True}}, "strategic")
    own.pod_event("default", "some-pod", None, "GPUMemoryOverLimit", "a test Event")

    ns = f"status-{next(_ids)}"
    client.CoreV1Api(admin).create_namespace({"metadata": {"name": ns}})
    writer = ClaimStatusWriter(driver, make_driver(tmp_path))
    statuses = {}
    for name, node in (("here", mine), ("elsewhere", other)):
        claim = _allocated_claim(admin, ns, name, node)
        result = claim["status"]["allocation"]["devices"]["results"][0]
        prepared = PreparedClaim(
            claim["metadata"]["uid"],
            ns,
            name,
            (PreparedDevice("gpu", node, "gpu-0", (), result["shareID"], 2, 7680),),
            "",
        )
        statuses[name] = writer._apply(prepared)
    assert statuses["here"][0] == 200, statuses
    # another node's claim: refused as a field the driver may not write (it holds associated-node:patch only)
    assert statuses["elsewhere"][0] == 422 and "arbitrary-node:patch" in statuses["elsewhere"][1], statuses
    stored = request(admin, "GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/here")
    (entry,) = stored["status"]["devices"]
    assert {k: entry[k] for k in ("driver", "pool", "device")} == {
        "driver": "gpu-share.example.com",
        "pool": mine,
        "device": "gpu-0",
    }
    assert entry["data"] == {
        "version": 1,
        "uuid": "GPU-8a2f4c1d-3b5e-4f60-a7c8-000000000000",
        "gpu": 0,
        "shares": 2,
        "totalShares": 4,
        "memoryLimitMiB": 7680,
    }
    assert not request(admin, "GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/elsewhere")[
        "status"
    ].get("devices")
    client.CoreV1Api(admin).delete_namespace(ns)

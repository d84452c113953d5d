"""Objects the end-to-end tests need on the real API server that a cluster's controllers would make: a Ready,
schedulable Node (no node lifecycle controller removes the not-ready taint), a namespace with its `default`
ServiceAccount (no ServiceAccount controller), a deleted ResourceClaim's release (no resourceclaim controller); and
a raw JSON request for kinds the typed client does not know."""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client


def ready_node(api: Any, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Create a Node, mark it Ready with room for pods, and remove the not-ready taint; returns it as JSON."""
    core = client.CoreV1Api(api)
    core.create_node({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}})
    status = {
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test"}],
        "capacity": {"cpu": "64", "memory": "256Gi", "pods": "110"},
        "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "110"},
    }
    core.patch_node_status(name, {"status": status})
    core.patch_node(name, {"spec": {"taints": None}})
    return request(api, "GET", f"/api/v1/nodes/{name}")


def namespace(api: Any, name: str) -> str:
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name}})
    core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})
    return name


def request(
    api: Any,
    method: str,
    path: str,
    body: Any = None,
    query: list[tuple[str, Any]] | None = None,
    content_type: str = "application/json",
) -> Any:
    """A JSON request with `api`'s credentials; raises ApiException on an error status."""
    if body is not None and content_type != "application/json":
        body = json.dumps(body)
    params = api.param_serialize(
        method,
        path,
        query_params=query or [],
        body=body,
        auth_settings=["BearerToken"],
        header_params={"Accept": "application/json", "Content-Type": content_type},
    )
    response = api.call_api(*params, _request_timeout=30)
    data = response.read()
    if not 200 <= response.status <= 299:
        raise client.ApiException(status=response.status, reason=response.reason, body=data.decode(errors="replace"))
    return json.loads(data) if data else None


CLAIM_PATH = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}"


def delete_claim(api: Any, namespace: str, name: str) -> None:
    """Delete a ResourceClaim no pod uses any more and finish its deletion (`release_claim`)."""
    path = CLAIM_PATH.format(ns=namespace, name=name)
    try:
        request(api, "DELETE", path)
        release_claim(api, request(api, "GET", path))
    except client.ApiException as err:
        if err.status != 404:
            raise


def release_claim(api: Any, claim: dict[str, Any]) -> None:
    """What kube-controller-manager's resourceclaim controller does for a deleted claim whose pods are gone (tests
    run none): drop its reservations and allocation, then its delete-protection finalizer. Until then kube-scheduler
    counts the claim's devices (and consumed capacity) as taken."""
    meta = claim["metadata"]
    path = CLAIM_PATH.format(ns=meta["namespace"], name=meta["name"])
    if claim.get("status"):
        claim = request(api, "PUT", path + "/status", {**claim, "status": {}})
    if claim["metadata"].get("finalizers"):
        request(api, "PUT", path, {**claim, "metadata": {**claim["metadata"], "finalizers": []}})


def slices(api: Any, node: str) -> list[dict[str, Any]]:
    found = request(
        api, "GET", "/apis/resource.k8s.io/v1/resourceslices", query=[("fieldSelector", f"spec.nodeName={node}")]
    )
    return sorted(found["items"], key=lambda s: s["metadata"]["name"])


# Where each kind the manifests hold lives: (API path prefix, plural, namespaced).
_KINDS = {
    "ConfigMap": ("/api/v1", "configmaps", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "DaemonSet": ("/apis/apps/v1", "daemonsets", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "DeviceClass": ("/apis/resource.k8s.io/v1", "deviceclasses", False),
    "ValidatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies", False),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}


def apply(api: Any, obj: dict[str, Any], dry_run: bool = False) -> Any:
    """Server-side apply of one manifest object (created or updated; the API server validates it fully)."""
    prefix, plural, namespaced = _KINDS[obj["kind"]]
    where = f"/namespaces/{obj['metadata']['namespace']}" if namespaced else ""
    query: list[tuple[str, Any]] = [("fieldManager", "gpu-share-tests"), ("force", "true")] + (
        [("dryRun", "All")] if dry_run else []
    )
    return request(
        api, "PATCH", f"{prefix}{where}/{plural}/{obj['metadata']['name']}", obj, query, "application/apply-patch+yaml"
    )


def delete(api: Any, obj: dict[str, Any]) -> None:
    """Delete one manifest object; one already gone is fine."""
    prefix, plural, namespaced = _KINDS[obj["kind"]]
    where = f"/namespaces/{obj['metadata']['namespace']}" if namespaced else ""
    try:
        request(api, "DELETE", f"{prefix}{where}/{plural}/{obj['metadata']['name']}")
    except client.ApiException as err:
        if err.status != 404:
            raise

"""The Kubernetes API as the node needs it: its own Node's labels and annotations (read, patched), the pods on
the node (the pod directory) and Warning Events on pods, over `kube.rest` (plain JSON, no `kubernetes` package)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from ..errors import FlagError
from ..model.pods import PodRef, bare_container_id
from .rest import ApiAccessError, RestClient
from .rest import connect as rest_connect

log = logging.getLogger(__name__)

PROFILE_LABEL = "gpu-share.config"  # full key: <domain>/gpu-share.config


class NodeClient:
    """Reads and patches one Node. Built by connect(), which returns None without API access."""

    def __init__(self, api: RestClient, node_name: str, timeout: float = 5.0) -> None:
        self.api = api
        self.node_name = node_name
        self.timeout = timeout

    @classmethod
    def connect(cls, node_name: str | None = None, kubeconfig: str | None = None) -> NodeClient | None:
        """In-cluster config, else the kubeconfig file; None (said once, clearly) when neither works.
        A kubeconfig given explicitly that does not load is fatal (FlagError)."""
        node_name = node_name or os.environ.get("NODE_NAME")
        if not node_name:
            log.warning("NODE_NAME is not set: node labels, the profile label and node annotations are off")
            return None
        try:
            api = rest_connect(kubeconfig)
        except ApiAccessError as err:
            if kubeconfig:
                raise FlagError("--kubeconfig", kubeconfig, f"cannot be used: {err}") from None
            log.warning(
                "no Kubernetes API access (%s): node labels, the profile label and node annotations are off", err
            )
            return None
        return cls(api, node_name)

    def labels(self) -> dict[str, str]:
        return self.metadata()[0]

    def metadata(self) -> tuple[dict[str, str], dict[str, str]]:
        """The Node's labels and annotations."""
        meta = self.api.get(f"/api/v1/nodes/{self.node_name}", timeout=self.timeout).get("metadata") or {}
        return dict(meta.get("labels") or {}), dict(meta.get("annotations") or {})

    def patch_metadata(self, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]) -> None:
        """Merge-patch labels and annotations (None removes a key)."""
        body = {"metadata": {k: v for k, v in (("labels", labels), ("annotations", annotations)) if v}}
        self.api.patch(f"/api/v1/nodes/{self.node_name}", body, "merge", timeout=self.timeout)

    def pods(self) -> list[PodRef]:
        """Pods on this node with their containers' runtime IDs (the pod directory for process mapping).

        One LIST filtered to the node and served from the API server's watch cache (`resourceVersion=0`), never a
        quorum read from etcd: at 1,000 nodes polling every 10 s that is 100 cheap reads/s instead of 100 etcd reads/s.
        """
        found = self.api.list(
            "/api/v1/pods", field_selector=f"spec.nodeName={self.node_name}", resource_version="0", timeout=self.timeout
        )
        return [pod_ref(pod) for pod in found.get("items") or () if isinstance(pod, dict)]

    def pod_event(self, namespace: str, pod: str, uid: str | None, reason: str, message: str) -> None:
        """A Warning Event on a pod, as `kubectl describe pod` shows it."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{pod}.", "namespace": namespace},
            "involvedObject": {"kind": "Pod", "name": pod, "namespace": namespace, **({"uid": uid} if uid else {})},
            "reason": reason,
            "message": message,
            "type": "Warning",
            "source": {"component": "gpu-share", "host": self.node_name},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.api.create(f"/api/v1/namespaces/{namespace}/events", event, timeout=self.timeout)


FINISHED_PHASES = ("Succeeded", "Failed")


def pod_ref(pod: dict[str, Any]) -> PodRef:
    """A Pod (its JSON) as the pod directory needs it: current and ended container IDs, finished or not."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    statuses = (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or [])
    current, ended = {}, set()
    for entry in statuses:
        if not isinstance(entry, dict):
            continue
        container_id = entry.get("containerID")
        if container_id:
            current[bare_container_id(container_id)] = str(entry.get("name"))
            if (entry.get("state") or {}).get("terminated"):
                ended.add(bare_container_id(container_id))
        previous = (entry.get("lastState") or {}).get("terminated") or {}
        if previous.get("containerID"):
            ended.add(bare_container_id(previous["containerID"]))
    return PodRef(
        uid=str(meta.get("uid")),
        namespace=str(meta.get("namespace")),
        name=str(meta.get("name")),
        containers=current,
        ended=frozenset(ended),
        finished=status.get("phase") in FINISHED_PHASES,
    )


def profile_label(domain: str) -> str:
    return f"{domain}/{PROFILE_LABEL}"

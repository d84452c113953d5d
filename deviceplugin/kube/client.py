"""The Kubernetes API as the node needs it: its own Node's labels and annotations (read, patched), the pods on
the node (the pod directory) and Warning Events on pods."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime

from ..errors import FlagError
from ..model.pods import PodRef, bare_container_id

log = logging.getLogger(__name__)

PROFILE_LABEL = "gpu-share.config"  # full key: <domain>/gpu-share.config


class ApiAccessError(RuntimeError):
    """No usable Kubernetes client configuration; str() is the reason."""


def core_api(kubeconfig: str | None = None):
    """A CoreV1Api from `kubeconfig` when given, else the in-cluster config, else ~/.kube/config.

    The `kubernetes` package (~20 MiB and most of a second to import) loads only here, when it will be used.
    """
    from kubernetes import client, config

    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
    except (config.ConfigException, OSError, TypeError, ValueError) as err:
        raise ApiAccessError(str(err)) from None
    return client.CoreV1Api()


class NodeClient:
    """Reads and patches one Node. Built by connect(), which returns None without API access."""

    def __init__(self, api, node_name: str, timeout: float = 5.0) -> None:
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
            api = core_api(kubeconfig)
        except ApiAccessError as err:
            if kubeconfig:
                raise FlagError("--kubeconfig", kubeconfig, f"cannot be used: {err}") from None
            log.warning("no Kubernetes API access (%s): node labels, the profile label and node annotations are off", err)
            return None
        return cls(api, node_name)

    def labels(self) -> dict[str, str]:
        return self.metadata()[0]

    def metadata(self) -> tuple[dict[str, str], dict[str, str]]:
        """The Node's labels and annotations."""
        node = self.api.read_node(self.node_name, _request_timeout=self.timeout)
        return dict(node.metadata.labels or {}), dict(node.metadata.annotations or {})

    def patch_metadata(self, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]) -> None:
        """Merge-patch labels and annotations (None removes a key)."""
        body = {"metadata": {k: v for k, v in (("labels", labels), ("annotations", annotations)) if v}}
        self.api.patch_node(self.node_name, body, _request_timeout=self.timeout)

    def pods(self) -> list[PodRef]:
        """Pods on this node with their containers' runtime IDs (the pod directory for process mapping).

        One LIST filtered to the node and served from the API server's watch cache (`resourceVersion=0`), never a
        quorum read from etcd: at 1,000 nodes polling every 10 s that is 100 cheap reads/s instead of 100 etcd reads/s.
        """
        found = self.api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node_name}", resource_version="0", _request_timeout=self.timeout
        )
        return [pod_ref(pod) for pod in found.items]

    def pod_event(self, namespace: str, pod: str, uid: str | None, reason: str, message: str) -> None:
        """A Warning Event on a pod, as `kubectl describe pod` shows it."""
        from kubernetes import client

        now = datetime.now(UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{pod}.", namespace=namespace),
            involved_object=client.V1ObjectReference(kind="Pod", name=pod, namespace=namespace, uid=uid),
            reason=reason,
            message=message,
            type="Warning",
            source=client.V1EventSource(component="gpu-share", host=self.node_name),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        self.api.create_namespaced_event(namespace, event, _request_timeout=self.timeout)


FINISHED_PHASES = ("Succeeded", "Failed")


def pod_ref(pod) -> PodRef:
    """A V1Pod as the pod directory needs it: current and ended container IDs, finished or not."""
    statuses = (pod.status.container_statuses or []) + (pod.status.init_container_statuses or [])
    current, ended = {}, set()
    for status in statuses:
        if status.container_id:
            current[bare_container_id(status.container_id)] = status.name
            if status.state and status.state.terminated:
                ended.add(bare_container_id(status.container_id))
        previous = status.last_state.terminated if status.last_state else None
        if previous and previous.container_id:
            ended.add(bare_container_id(previous.container_id))
    return PodRef(
        uid=pod.metadata.uid,
        namespace=pod.metadata.namespace,
        name=pod.metadata.name,
        containers=current,
        ended=frozenset(ended),
        finished=pod.status.phase in FINISHED_PHASES,
    )


def profile_label(domain: str) -> str:
    return f"{domain}/{PROFILE_LABEL}"

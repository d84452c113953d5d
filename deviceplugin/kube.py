"""The node's own Node object through the Kubernetes API: labels to read (profile) and, later, to publish."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

PROFILE_LABEL = "gpu-share.config"  # full key: <domain>/gpu-share.config


class NodeClient:
    """Reads and patches one Node. Built by connect(), which returns None without API access."""

    def __init__(self, api, node_name: str, timeout: float = 5.0) -> None:
        self.api = api
        self.node_name = node_name
        self.timeout = timeout

    @classmethod
    def connect(cls, node_name: str | None = None, kubeconfig: str | None = None) -> "NodeClient | None":
        """In-cluster config, else the kubeconfig file; None (said once, clearly) when neither works."""
        from kubernetes import client, config

        node_name = node_name or os.environ.get("NODE_NAME")
        if not node_name:
            log.warning("NODE_NAME is not set: node labels, the profile label and node annotations are off")
            return None
        try:
            if kubeconfig:
                config.load_kube_config(config_file=kubeconfig)
            else:
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config()
        except (config.ConfigException, OSError, TypeError) as err:
            log.warning("no Kubernetes API access (%s): node labels, the profile label and node annotations are off", err)
            return None
        return cls(client.CoreV1Api(), node_name)

    def labels(self) -> dict[str, str]:
        node = self.api.read_node(self.node_name, _request_timeout=self.timeout)
        return dict(node.metadata.labels or {})


def profile_label(domain: str) -> str:
    return f"{domain}/{PROFILE_LABEL}"

"""Node labels and the inventory annotation, published through the Kubernetes API.

Labels follow GPU feature discovery's style under the configured domain; the annotation
`<domain>/gpu-share.inventory` holds, per GPU, its pool, shares total and used, and health (JSON), for
schedulers and humans. Patches are debounced (at most one per `min_interval`) and carry only what changed.
"""

from __future__ import annotations

import json
import logging
import re
import time

from .inventory import NodeInfo
from .kube import NodeClient
from .podresources import Usage
from .resources import Resource

log = logging.getLogger(__name__)

ANNOTATION = "gpu-share.inventory"
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]+")


def label_value(text: str) -> str:
    """A valid label value: [A-Za-z0-9_.-], at most 63 characters, alphanumeric at both ends."""
    return _LABEL_VALUE.sub("-", text)[:63].strip("-_.")


def node_labels(domain: str, node: NodeInfo, resources: list[Resource]) -> dict[str, str]:
    labels = {f"{domain}/gpu.count": str(len(node.gpus))}
    if node.gpus:
        first = node.gpus[0]
        labels[f"{domain}/gpu.product"] = label_value(first.model)
        labels[f"{domain}/gpu.memory"] = str(first.memory_mib)
    if node.driver_version:
        labels[f"{domain}/gpu.driver-version"] = label_value(node.driver_version)
    if node.cuda_driver_version:
        labels[f"{domain}/cuda.driver-version"] = label_value(node.cuda_driver_version)
    labels[f"{domain}/mig.capable"] = str(any(g.mig_enabled for g in node.gpus)).lower()
    mig_pools = {r.pool.name: r.pool.mig_strategy for r in resources if r.pool.mode == "mig"}
    labels[f"{domain}/mig.strategy"] = ",".join(sorted(set(mig_pools.values()))) if mig_pools else "none"
    for resource in resources:
        pool = resource.pool
        strategy = {"exclusive": "none", "mig": "mig"}.get(pool.mode) or ("mps" if pool.mps else "time-slicing")
        labels[f"{domain}/{pool.name}.sharing-strategy"] = strategy
        if pool.shared:
            labels[f"{domain}/{pool.name}.replicas"] = str(max(u.replicas for u in resource.units))
    return labels


def inventory(node: NodeInfo, resources: list[Resource], usage: Usage, unhealthy: frozenset[str]) -> list[dict]:
    used: dict[str, int] = {}
    for share in usage.shares:
        used[share.gpu_uuid] = used.get(share.gpu_uuid, 0) + share.shares
    pool_of: dict[str, tuple[str, int]] = {}
    for resource in resources:
        for unit in resource.units:
            name, total = pool_of.get(unit.gpu.uuid, (resource.pool.name, 0))
            pool_of[unit.gpu.uuid] = (name, total + unit.replicas)
    return [
        {
            "uuid": gpu.uuid,
            "index": gpu.index,
            "model": gpu.model,
            "memoryMiB": gpu.memory_mib,
            "pool": pool_of.get(gpu.uuid, ("", 0))[0],
            "sharesTotal": pool_of.get(gpu.uuid, ("", 0))[1],
            "sharesUsed": used.get(gpu.uuid, 0),
            "health": "Unhealthy" if gpu.uuid in unhealthy else "Healthy",
        }
        for gpu in node.gpus
    ]


class NodePublisher:
    """Keeps the Node's labels and annotation in step; debounced, minimal patches."""

    def __init__(self, client: NodeClient, domain: str, min_interval: float = 5.0) -> None:
        self.client = client
        self.domain = domain
        self.min_interval = min_interval
        self._labels: dict[str, str] | None = None  # what we last published
        self._annotation: str | None = None
        self._last_patch = float("-inf")

    def publish(self, labels: dict[str, str], annotation: list[dict]) -> bool:
        """Patch what changed since the last patch; False when nothing changed or the debounce holds it back."""
        text = json.dumps(annotation, separators=(",", ":"), sort_keys=True)
        if self._labels is None:
            self._labels = self._own_labels()
        label_patch: dict[str, str | None] = {k: v for k, v in labels.items() if self._labels.get(k) != v}
        label_patch.update({k: None for k in self._labels if k not in labels})
        annotation_patch = {f"{self.domain}/{ANNOTATION}": text} if text != self._annotation else {}
        if not label_patch and not annotation_patch:
            return False
        if time.monotonic() - self._last_patch < self.min_interval:
            return False
        try:
            self.client.patch_metadata(label_patch, annotation_patch)
        except Exception as err:
            log.warning("cannot patch node %s labels/annotation: %s", self.client.node_name, err)
            return False
        self._last_patch = time.monotonic()
        self._labels = dict(labels)
        self._annotation = text
        return True

    def _own_labels(self) -> dict[str, str]:
        """Labels we published before a restart: ours are <domain>/gpu.*, cuda.*, mig.* and <pool>.*."""
        try:
            existing = self.client.labels()
        except Exception as err:
            log.warning("cannot read node %s labels: %s", self.client.node_name, err)
            return {}
        ours = re.compile(rf"^{re.escape(self.domain)}/(gpu\.|cuda\.|mig\.|[a-z0-9-]+\.(sharing-strategy|replicas)$)")
        return {k: v for k, v in existing.items() if ours.match(k)}

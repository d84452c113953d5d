"""Node labels and the inventory annotation, published through the Kubernetes API.

Labels use GPU feature discovery's names and meanings under the configured domain (docs/operations.md lists
them); the annotation `<domain>/gpu-share.inventory` (format: annotation.py) holds per GPU and per unit the shares
total, used and free and their health, for the scheduler extender and humans. Patches are debounced (at most one
per `min_interval`) and carry only what changed.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable

from .. import defaults
from ..alloc.modes import MIG, mode_of
from ..config.types import Config
from ..model.devices import Resource, Unit
from ..model.node import NodeInfo, gpu_family
from ..model.usage import Usage
from .annotation import ANNOTATION, HEALTHY, QUARANTINED, UNHEALTHY, VERSION, pod_digest
from .client import NodeClient

log = logging.getLogger(__name__)

OWNED_ANNOTATION = "gpu-share.labels"  # JSON list of the label keys the publisher wrote

_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]+")


def label_value(text: str) -> str:
    """A valid label value: [A-Za-z0-9_.-], at most 63 characters, alphanumeric at both ends."""
    return _LABEL_VALUE.sub("-", text)[:63].strip("-_.")


def node_labels(
    domain: str,
    node: NodeInfo,
    resources: list[Resource],
    shared_product_suffix: bool = False,
    deprecated_cuda_labels: bool = False,
) -> dict[str, str]:
    """GPU feature discovery's labels where the concept is the same (names and meanings), per-pool details as
    `<domain>/gpu-share.<pool>.*`. Every key is documented in docs/operations.md."""
    labels = {"gpu.count": str(len(node.gpus)), "gpu.present": str(bool(node.gpus)).lower()}
    shared = [r for r in resources if r.pool.shared]
    if node.gpus:
        first = node.gpus[0]  # GFD describes the node by its first GPU too
        labels["gpu.product"] = label_value(first.model + ("-SHARED" if shared and shared_product_suffix else ""))
        labels["gpu.memory"] = str(first.memory_mib)
        labels.update(_compute_labels(first.compute_capability))
    labels.update(_version_labels("cuda.driver-version", node.driver_version, ("major", "minor", "revision")))
    labels.update(_version_labels("cuda.runtime-version", node.cuda_driver_version, ("major", "minor")))
    if deprecated_cuda_labels:  # GFD's names before cuda.driver-version.*, for selectors not yet moved
        labels.update(_version_labels("cuda.driver", node.driver_version, ("major", "minor", "rev")))
        labels.update(_version_labels("cuda.runtime", node.cuda_driver_version, ("major", "minor")))
    # Node-wide sharing as GFD has it: the shared pool over the most GPUs decides.
    widest = max(shared, key=lambda r: len(r.gpus), default=None)
    labels["gpu.sharing-strategy"] = mode_of(widest.pool).strategy if widest else "none"
    labels["gpu.replicas"] = str(max(u.replicas for u in widest.units)) if widest else "1"
    labels["mig.capable"] = str(any(g.mig_capable for g in node.gpus)).lower()
    strategies = {r.pool.mig_strategy for r in resources if mode_of(r.pool) is MIG}
    labels["mig.strategy"] = "none" if not strategies else strategies.pop() if len(strategies) == 1 else "mixed"
    for gpu in node.gpus:
        for mig in gpu.mig_devices:
            key = f"mig-{mig.profile.replace('+', '.')}"
            labels[f"{key}.count"] = str(int(labels.get(f"{key}.count", "0")) + 1)
            labels[f"{key}.memory"] = str(mig.memory_mib)
    for resource in resources:
        labels[f"gpu-share.{resource.label}.sharing-strategy"] = mode_of(resource.pool).strategy
        labels[f"gpu-share.{resource.label}.replicas"] = str(max(u.replicas for u in resource.units))
        labels[f"gpu-share.{resource.label}.gpus"] = str(len(resource.gpus))
    return {
        f"{domain}/{key}": value for key, value in labels.items() if len(key) <= 63
    }  # the API's limit on a key's name


def _compute_labels(capability: str) -> dict[str, str]:
    """gpu.compute.major/minor and gpu.family from a compute capability such as "8.0" (GFD's family names)."""
    match = re.fullmatch(r"(\d+)\.(\d+)", capability)
    if not match:
        return {}
    major, minor = int(match.group(1)), int(match.group(2))
    return {"gpu.compute.major": str(major), "gpu.compute.minor": str(minor), "gpu.family": gpu_family(major, minor)}


def _version_labels(prefix: str, version: str, parts: tuple[str, ...]) -> dict[str, str]:
    """`550.54.15` -> <prefix>.major=550, .minor=54, .revision=15 (only the numeric parts present), and with the
    `-version` names GFD's `.full` (the whole version)."""
    numbers = version.split(".")
    labels = {f"{prefix}.{part}": number for part, number in zip(parts, numbers, strict=False) if number.isdigit()}
    if prefix.endswith("-version") and label_value(version):
        labels[f"{prefix}.full"] = label_value(version)
    return labels


def inventory(
    node: NodeInfo,
    resources: list[Resource],
    usage: Usage,
    unhealthy: frozenset[str],
    quarantined: frozenset[str] = frozenset(),
) -> dict:
    """The annotation's content (version 2, without the generation): per GPU, per resource and unit, the pods.

    `unhealthy` holds GPU or MIG UUIDs, `quarantined` GPU UUIDs whose free devices the residue guard holds back.
    """
    used: dict[tuple[str, str], int] = {}
    for share in usage.shares:
        used[(share.resource, share.unit_uuid)] = used.get((share.resource, share.unit_uuid), 0) + share.shares

    def gpu_health(gpu_uuid: str, unit_unhealthy: bool = False) -> str:
        if unit_unhealthy or gpu_uuid in unhealthy:
            return UNHEALTHY
        return QUARANTINED if gpu_uuid in quarantined else HEALTHY

    def unit_entry(resource: Resource, unit: Unit) -> dict:
        taken = used.get((resource.name, unit.uuid), 0)
        state = gpu_health(unit.gpu.uuid, unit.is_unhealthy(unhealthy))
        entry = {"uuid": unit.uuid, "gpu": unit.gpu.index}
        if unit.mig:
            entry["profile"] = unit.mig.profile
        free = max(unit.replicas - taken, 0) if state == HEALTHY else 0
        return entry | {"total": unit.replicas, "used": taken, "free": free, "health": state}

    return {
        "version": VERSION,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "model": g.model,
                "memoryMiB": g.memory_mib,
                "health": gpu_health(g.uuid),
            }
            for g in node.gpus
        ],
        "resources": {
            r.name: {
                "pool": r.pool.name,
                "allowSpanGPUs": r.pool.allow_span,
                "allocationPolicy": r.allocation_policy,
                "units": [unit_entry(r, u) for u in r.units],
            }
            for r in resources
        },
        "pods": sorted({pod_digest(s.namespace, s.pod) for s in usage.shares}),
    }


class InventoryAnnotation:
    """Builds the annotation and keeps its generation: +1 whenever the content changes.

    The counter starts from the clock in milliseconds, so it keeps increasing across plugin restarts
    (the content changes at most once per agent round, far slower than once per millisecond).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.generation = int(clock() * 1000)
        self._content: dict | None = None

    def build(
        self,
        node: NodeInfo,
        resources: list[Resource],
        usage: Usage,
        unhealthy: frozenset[str],
        quarantined: frozenset[str] = frozenset(),
    ) -> dict:
        content = inventory(node, resources, usage, unhealthy, quarantined)
        if content != self._content:
            if self._content is not None:
                self.generation += 1
            self._content = content
        return {"version": VERSION, "generation": self.generation} | {
            k: v for k, v in content.items() if k != "version"
        }


class NodePublisher:
    """Keeps the Node's labels and annotations in step; debounced, minimal patches.

    The publisher owns exactly the label keys it wrote, listed in the annotation `<domain>/gpu-share.labels`
    (so a restart knows them): it removes only those, and never writes a key someone else set first (GPU
    feature discovery with `domain: nvidia.com`, a person) — that key is left alone, said once in the log.

    A config reload (`on_config`) that changes the domain retires everything published under the old one: the
    next patch removes the old domain's owned labels and both of its annotations, and publishes under the new
    one, in one request (retried with the next round while it fails).
    """

    def __init__(
        self,
        client: NodeClient,
        domain: str,
        min_interval: float = defaults.LABEL_INTERVAL,
        shared_product_suffix: bool = False,
        deprecated_cuda_labels: bool = False,
    ) -> None:
        self.client = client
        self.domain = domain
        self.shared_product_suffix = shared_product_suffix  # gpu.product gets GFD's -SHARED when a pool shares GPUs
        self.deprecated_cuda_labels = deprecated_cuda_labels  # also GFD's deprecated cuda.driver.*, cuda.runtime.*
        self.min_interval = min_interval
        self._lock = threading.Lock()  # one publish at a time
        self._wanted_lock = threading.Lock()  # held only to hand over `_wanted`: a reload never waits on the API
        self._wanted = (
            domain,
            shared_product_suffix,
            deprecated_cuda_labels,
        )  # from the latest config; adopted by the next publish
        self._retired_labels: dict[str, None] = {}  # keys owned under earlier domains, to remove
        self._retired_annotations: dict[str, None] = {}
        self._labels: dict[str, str] | None = None  # ours, as last published
        self._foreign: frozenset[str] = frozenset()  # keys set by others when we started
        self._told: set[str] = set()
        self._owned_text: str | None = None
        self._annotation: str | None = None
        self._last_patch = float("-inf")

    @property
    def owned_key(self) -> str:
        return f"{self.domain}/{OWNED_ANNOTATION}"

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload (runtime.reload): its domain and label settings apply from the next publish on."""
        with self._wanted_lock:
            self._wanted = (config.domain, config.shared_product_suffix, config.deprecated_cuda_labels)

    def publish_node(self, node: NodeInfo, resources: list[Resource], annotation: dict) -> bool:
        """Publish the labels of `node` serving `resources`, under the domain of the latest config, and `annotation`."""
        with self._lock:
            if not self._adopt_config():
                return False
            labels = node_labels(self.domain, node, resources, self.shared_product_suffix, self.deprecated_cuda_labels)
            return self._publish(labels, annotation)

    def publish(self, labels: dict[str, str], annotation: dict) -> bool:
        """Patch what changed since the last patch; False when nothing changed or the debounce holds it back."""
        with self._lock:
            return self._publish(labels, annotation)

    def _adopt_config(self) -> bool:
        """Take the latest config's settings; a new domain retires the old one's keys (False: its keys are unknown
        yet)."""
        with self._wanted_lock:
            domain, self.shared_product_suffix, self.deprecated_cuda_labels = self._wanted
        if domain == self.domain:
            return True
        if self._labels is None and not self._read_node():  # which labels the old domain owns
            return False
        log.info("label domain %s -> %s: removing what was published under %s", self.domain, domain, self.domain)
        self._retired_labels.update(dict.fromkeys(self._labels or {}))
        self._retired_annotations.update(dict.fromkeys((f"{self.domain}/{ANNOTATION}", self.owned_key)))
        self.domain = domain
        prefix = f"{domain}/"
        self._retired_labels = {k: None for k in self._retired_labels if not k.startswith(prefix)}  # back to a domain
        self._retired_annotations = {k: None for k in self._retired_annotations if not k.startswith(prefix)}
        self._labels, self._owned_text, self._annotation, self._told = None, None, None, set()
        return True

    def _publish(self, labels: dict[str, str], annotation: dict) -> bool:
        if self._labels is None and not self._read_node():
            return False
        ours = self._labels or {}
        for key in sorted(set(labels) & self._foreign - self._told):
            log.info("node label %s was set by someone else (GPU feature discovery?): left alone", key)
            self._told.add(key)
        wanted = {k: v for k, v in labels.items() if k not in self._foreign}
        label_patch: dict[str, str | None] = dict(self._retired_labels)
        label_patch.update({k: v for k, v in wanted.items() if ours.get(k) != v})
        label_patch.update({k: None for k in ours if k not in wanted})
        owned_text = json.dumps(sorted(wanted), separators=(",", ":"))
        text = json.dumps(annotation, separators=(",", ":"), sort_keys=True)
        annotation_patch: dict[str, str | None] = dict(self._retired_annotations)
        if text != self._annotation:
            annotation_patch[f"{self.domain}/{ANNOTATION}"] = text
        if owned_text != self._owned_text:
            annotation_patch[self.owned_key] = owned_text
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
        self._labels = wanted
        self._owned_text = owned_text
        self._annotation = text
        self._retired_labels, self._retired_annotations = {}, {}
        return True

    def _read_node(self) -> bool:
        """Which labels are ours (listed in our annotation by an earlier run) and which belong to others."""
        try:
            labels, annotations = self.client.metadata()
        except Exception as err:
            log.warning("cannot read node %s labels: %s", self.client.node_name, err)
            return False
        self._owned_text = annotations.get(self.owned_key)
        try:
            listed = json.loads(self._owned_text or "[]")
        except ValueError:
            listed = []
        owned = {k for k in listed if isinstance(k, str)} if isinstance(listed, list) else set()
        self._labels = {k: v for k, v in labels.items() if k in owned}
        self._foreign = frozenset(k for k in labels if k not in owned)
        return True

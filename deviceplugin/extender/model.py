"""What the extender knows: a node's units read from its inventory annotation, and a pod's share requests.

Pure: inputs are the JSON the API server and kube-scheduler send, already decoded. Every input is bounded
and checked; a bad one raises InputError naming the field and the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

from ..kube.annotation import HEALTH_VALUES, VERSION

MAX_ANNOTATION_BYTES = 256 * 1024  # the API server's limit for all annotations of an object
MAX_UNITS = 4096  # per node
MAX_SHARES = 1_000_000  # per unit or per container request
MAX_CONTAINERS = 256  # per pod


class InputError(ValueError):
    """An annotation or pod the extender cannot use; the message names the field."""


@dataclass(frozen=True)
class Unit:
    """A whole GPU or one MIG instance, as the node plugin last published it."""

    uuid: str
    gpu: int  # the parent GPU's index
    profile: str  # MIG profile, "" for a whole GPU
    total: int
    used: int
    free: int  # 0 unless Healthy
    health: str

    @property
    def kind(self) -> str:
        return "MIG instance" if self.profile else "GPU"


@dataclass(frozen=True)  # not slots: cached_property needs a __dict__
class NodeResource:
    name: str
    pool: str
    allow_span: bool
    policy: str  # the node plugin's allocationPolicy: binpack | spread
    units: tuple[Unit, ...]

    @cached_property
    def totals(self) -> tuple[int, ...]:
        return tuple(u.total for u in self.units)


@dataclass(frozen=True)
class NodeInventory:
    node: str
    generation: int
    resources: dict[str, NodeResource]
    pods: frozenset[str]  # digests of the pods whose shares `used` already counts


def parse_annotation(node: str, text: str) -> NodeInventory:
    """The version 2 annotation of `node`; InputError for anything else."""
    if len(text) > MAX_ANNOTATION_BYTES:
        raise InputError(f"annotation is {len(text)} bytes, over {MAX_ANNOTATION_BYTES}")
    try:
        data = json.loads(text)
    except ValueError as err:
        raise InputError(f"annotation is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise InputError("annotation must be a JSON object")
    if data.get("version") != VERSION:
        raise InputError(f"annotation version {data.get('version')!r}: this extender reads version {VERSION} (upgrade the node plugin)")
    resources = {}
    count = 0
    for name, entry in _field(data, "resources", dict).items():
        where = f"resources.{name}"
        units = []
        for i, raw in enumerate(_field(entry, "units", list, where)):
            at = f"{where}.units[{i}]"
            health = _field(raw, "health", str, at)
            if health not in HEALTH_VALUES:
                raise InputError(f"{at}.health: {health!r} is not one of {', '.join(HEALTH_VALUES)}")
            total, used, free = (_count(raw, key, at) for key in ("total", "used", "free"))
            units.append(Unit(_field(raw, "uuid", str, at), _count(raw, "gpu", at), str(raw.get("profile", "")), total, used, free, health))
        count += len(units)
        if count > MAX_UNITS:
            raise InputError(f"annotation lists more than {MAX_UNITS} units")
        resources[name] = NodeResource(
            name, str(entry.get("pool", "")), entry.get("allowSpanGPUs") is True, str(entry.get("allocationPolicy", "binpack")), tuple(units)
        )
    pods = _field(data, "pods", list)
    return NodeInventory(node, _count(data, "generation"), resources, frozenset(str(p) for p in pods))


def _field(data, key: str, kind: type, where: str = ""):
    if not isinstance(data, dict) or not isinstance(data.get(key), kind):
        raise InputError(f"{where + '.' if where else ''}{key}: missing or not a {kind.__name__}")
    return data[key]


def _count(data, key: str, where: str = "") -> int:
    value = data.get(key) if isinstance(data, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"{where + '.' if where else ''}{key}: must be a whole number >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class ContainerRequest:
    name: str
    shares: tuple[tuple[str, int], ...]  # (resource, count) of managed resources, count > 0


@dataclass(frozen=True)
class PodRequest:
    """A pod's managed-resource requests: containers that run together, and init containers that run alone."""

    namespace: str
    name: str
    uid: str
    together: tuple[ContainerRequest, ...]  # containers and restartable (sidecar) init containers
    alone: tuple[ContainerRequest, ...]  # ordinary init containers, one at a time before the others

    @property
    def empty(self) -> bool:
        return not self.together and not self.alone

    @property
    def largest(self) -> tuple[str, int]:
        """(resource, count) of the largest container request (the pod must not be empty)."""
        return max(((r, n) for c in self.together + self.alone for r, n in c.shares), key=lambda rn: rn[1])


def pod_request(pod: object, managed) -> PodRequest:
    """A Pod object's requests of the resources `managed(name)` accepts; InputError names the bad field."""
    if not isinstance(pod, dict):
        raise InputError("Pod: missing or not an object")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise InputError("Pod.spec: missing or not an object")
    together: list[ContainerRequest] = []
    alone: list[ContainerRequest] = []
    for field in ("initContainers", "containers"):
        containers = spec.get(field) or []
        if not isinstance(containers, list) or len(containers) > MAX_CONTAINERS:
            raise InputError(f"Pod.spec.{field}: must be a list of at most {MAX_CONTAINERS} containers")
        for i, container in enumerate(containers):
            request = _container_request(container, f"Pod.spec.{field}[{i}]", managed)
            if request is None:
                continue
            sidecar = field == "initContainers" and container.get("restartPolicy") == "Always"
            (alone if field == "initContainers" and not sidecar else together).append(request)
    return PodRequest(str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", "")), tuple(together), tuple(alone))


def _container_request(container, where: str, managed) -> ContainerRequest | None:
    if not isinstance(container, dict):
        raise InputError(f"{where}: not an object")
    resources = container.get("resources") or {}
    # Extended resources: limits == requests when both are set; either alone is the request.
    amounts = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
    shares = []
    for name, quantity in sorted(amounts.items()):
        if not managed(name):
            continue
        count = _quantity(quantity, f"{where}.resources.{name}")
        if count:
            shares.append((name, count))
    return ContainerRequest(str(container.get("name", "")), tuple(shares)) if shares else None


def _quantity(value, where: str) -> int:
    """Extended resources are whole numbers; the API server accepts "2" and 2."""
    text = str(value)
    if not text.isdigit() or int(text) > MAX_SHARES:
        raise InputError(f"{where}: {value!r} is not a whole number of shares (0-{MAX_SHARES})")
    return int(text)

"""What the extender knows: a node's units (its inventory annotation) and host capacity, and a pod's requests.

Pure: inputs are the JSON the API server and kube-scheduler send, already decoded. Every input is bounded
and checked; a bad one raises InputError naming the field and the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from decimal import Decimal
from functools import cached_property

from ..cluster import MILLI, PodDemand
from ..kube.annotation import HEALTH_VALUES, VERSION
from ..model.node import MIB
from ..model.quantity import MAX_QUANTITY_LENGTH, parse_quantity

MAX_ANNOTATION_BYTES = 256 * 1024  # the API server's limit for all annotations of an object
MAX_UNITS = 4096  # per node
MAX_SHARES = 1_000_000  # per unit or per container request
MAX_CONTAINERS = 256  # per pod
MAX_MODELS = 64  # GPU models a pod's node affinity names, in all
MODEL_LABEL = "gpu.product"  # <domain>/gpu.product: the node's GPU model, as the node plugin labels it
UNLIMITED = 1 << 62  # a host capacity the Node does not state


class InputError(ValueError):
    """An annotation or pod the extender cannot use; the message names the field."""


@dataclass(frozen=True)
class InventoryUnit:
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
    units: tuple[InventoryUnit, ...]

    @cached_property
    def totals(self) -> tuple[int, ...]:
        return tuple(u.total for u in self.units)

    @cached_property
    def largest(self) -> int:
        """The largest unit's shares (0 without units)."""
        return max(self.totals, default=0)


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
        raise InputError(
            f"annotation version {data.get('version')!r}: this extender reads version {VERSION} (upgrade the "
            "node plugin)"
        )
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
            units.append(
                InventoryUnit(
                    _field(raw, "uuid", str, at),
                    _count(raw, "gpu", at),
                    str(raw.get("profile", "")),
                    total,
                    used,
                    free,
                    health,
                )
            )
        count += len(units)
        if count > MAX_UNITS:
            raise InputError(f"annotation lists more than {MAX_UNITS} units")
        resources[name] = NodeResource(
            name,
            str(entry.get("pool", "")),
            entry.get("allowSpanGPUs") is True,
            str(entry.get("allocationPolicy", "binpack")),
            tuple(units),
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
    cpu_milli: int = 0  # the pod's effective CPU request, as kube-scheduler counts it (host_request)
    memory_mib: int = 0
    gpu_models: frozenset[str] = frozenset()  # the GPU models it accepts (gpu_models); empty: any

    @property
    def empty(self) -> bool:
        return not self.together and not self.alone

    @property
    def largest(self) -> tuple[str, int]:
        """(resource, count) of the largest container request (the pod must not be empty)."""
        return max(((r, n) for c in self.together + self.alone for r, n in c.shares), key=lambda rn: rn[1])


def share_demand(count: int, total: int, cpu_milli: int = 0, memory_mib: int = 0) -> PodDemand:
    """A request of `count` shares of units of `total` shares, in the cluster model's milli-GPUs."""
    if total <= 1 or count > total:  # whole units
        return PodDemand(cpu_milli, memory_mib, num_gpu=-(-count // max(total, 1)), gpu_milli=MILLI)
    return PodDemand(cpu_milli, memory_mib, num_gpu=1, gpu_milli=-(-count * MILLI // total))


def pod_demand(request: PodRequest, total: int) -> PodDemand:
    """The pod as the cluster model sees it on units of `total` shares: by its largest resource, k/N of a GPU, or
    whole GPUs (containers each asking for whole units count together: 4 containers of N shares are 4 GPUs)."""
    resource, count = request.largest
    counts = [n for c in request.together for r, n in c.shares if r == resource]
    unit = max(total, 1)
    if len(counts) > 1 and all(n % unit == 0 for n in counts):
        return PodDemand(
            request.cpu_milli,
            request.memory_mib,
            num_gpu=sum(counts) // unit,
            gpu_milli=MILLI,
            gpu_models=request.gpu_models,
        )
    return replace(share_demand(count, total, request.cpu_milli, request.memory_mib), gpu_models=request.gpu_models)


def pod_request(pod: object, managed, model_label: str = "") -> PodRequest:
    """A Pod object's requests of the resources `managed(name)` accepts, and the GPU models it accepts by the node
    label `model_label` ("": not read); InputError names the bad field."""
    if not isinstance(pod, dict):
        raise InputError("Pod: missing or not an object")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise InputError("Pod.spec: missing or not an object")
    together: list[ContainerRequest] = []
    alone: list[ContainerRequest] = []
    cpu, memory = host_request(spec)
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
    return PodRequest(
        str(meta.get("namespace", "")),
        str(meta.get("name", "")),
        str(meta.get("uid", "")),
        tuple(together),
        tuple(alone),
        cpu,
        memory,
        gpu_models(spec, model_label) if model_label else frozenset(),
    )


def gpu_models(spec: dict, label: str) -> frozenset[str]:
    """The values of `label` a pod requires of its node: its nodeSelector's, else the union over its required node
    affinity terms (the terms are ORed) when every term has an `In` on the label; empty (any model) otherwise, and
    for more than MAX_MODELS values. What kube-scheduler's filters enforce; the extender only scores by it."""
    selector = spec.get("nodeSelector")
    if isinstance(selector, dict) and isinstance(selector.get(label), str):
        return frozenset([selector[label]])
    affinity = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}) if isinstance(spec.get("affinity"), dict) else {}
    )
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") if isinstance(affinity, dict) else None
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    if not isinstance(terms, list) or not terms or len(terms) > MAX_MODELS:
        return frozenset()
    models: set[str] = set()
    for term in terms:
        expressions = term.get("matchExpressions") if isinstance(term, dict) else None
        values = next(
            (
                e.get("values")
                for e in (expressions if isinstance(expressions, list) else [])[:MAX_MODELS]
                if isinstance(e, dict) and e.get("key") == label and e.get("operator") == "In"
            ),
            None,
        )
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            return frozenset()  # a term that admits any model
        models.update(values)
        if len(models) > MAX_MODELS:
            return frozenset()
    return frozenset(models)


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


@dataclass(frozen=True)
class HostCapacity:
    """A Node's allocatable CPU (milli), memory (MiB, rounded down) and pod slots, and its GPU model label."""

    cpu_milli: int = UNLIMITED
    memory_mib: int = UNLIMITED
    pods: int = UNLIMITED
    model: str = ""  # the node's model label (MODEL_LABEL), as pods' node affinity names it; "": none


def host_capacity(node: dict, model_label: str = "") -> HostCapacity:
    """`status.allocatable` of a Node object; a missing or unreadable entry counts as unlimited. With `model_label`,
    the node's value of that label too."""
    allocatable = ((node.get("status") or {}).get("allocatable") or {}) if isinstance(node, dict) else {}
    values = []
    for key, scale, down in (("cpu", 1000, True), ("memory", 1 / MIB, True), ("pods", 1, True)):
        try:
            values.append(_scaled(allocatable[key], scale, down))
        except (KeyError, InputError):
            values.append(UNLIMITED)
    labels = ((node.get("metadata") or {}).get("labels") or {}) if isinstance(node, dict) and model_label else {}
    model = labels.get(model_label) if isinstance(labels, dict) else None
    cpu, memory, pods = values
    return HostCapacity(cpu, memory, pods, model if isinstance(model, str) else "")


def host_request(spec: dict) -> tuple[int, int]:
    """(CPU milli, memory MiB) the pod takes on its node, as kube-scheduler's NodeResourcesFit counts it.

    The containers' requests and every sidecar (restartable init container) summed; each ordinary init container
    with the sidecars started before it; the larger of the two; plus `overhead`. A pod-level `resources.requests`
    replaces the containers' sum for the resources it names. A request defaults to the limit (as the API server
    defaults it).
    """
    total = [0, 0]
    sidecars = [0, 0]
    init_peak = [0, 0]
    for i, container in enumerate(_containers(spec, "containers")):
        total = _add(total, _container_host(container, f"Pod.spec.containers[{i}]"))
    for i, container in enumerate(_containers(spec, "initContainers")):
        request = _container_host(container, f"Pod.spec.initContainers[{i}]")
        if container.get("restartPolicy") == "Always":
            total = _add(total, request)
            sidecars = _add(sidecars, request)
            running = sidecars
        else:
            running = _add(request, sidecars)
        init_peak = [max(a, b) for a, b in zip(init_peak, running, strict=True)]
    result = [max(a, b) for a, b in zip(total, init_peak, strict=True)]
    pod_level = ((spec.get("resources") or {}).get("requests") or {}) if isinstance(spec.get("resources"), dict) else {}
    for k, key in enumerate(("cpu", "memory")):
        if key in pod_level:
            result[k] = _host_quantity(pod_level, key, "Pod.spec.resources.requests")
    overhead = spec.get("overhead") or {}
    if isinstance(overhead, dict):
        result = _add(result, [_host_quantity(overhead, k, "Pod.spec.overhead") for k in ("cpu", "memory")])
    return result[0], result[1]


def _containers(spec: dict, field: str) -> list[dict]:
    containers = spec.get(field) or []
    if not isinstance(containers, list) or len(containers) > MAX_CONTAINERS:
        raise InputError(f"Pod.spec.{field}: must be a list of at most {MAX_CONTAINERS} containers")
    return [c for c in containers if isinstance(c, dict)]


def _container_host(container: dict, where: str) -> list[int]:
    resources = container.get("resources") or {}
    if not isinstance(resources, dict):
        return [0, 0]
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    amounts = {**limits, **requests} if isinstance(requests, dict) and isinstance(limits, dict) else {}
    return [_host_quantity(amounts, key, f"{where}.resources") for key in ("cpu", "memory")]


def _host_quantity(amounts: dict, key: str, where: str) -> int:
    """CPU in milli (rounded up) or memory in MiB (rounded up), 0 when absent."""
    if key not in amounts:
        return 0
    try:
        return _scaled(amounts[key], 1000 if key == "cpu" else 1 / MIB, False)
    except InputError as err:
        raise InputError(f"{where}.{key}: {err}") from None


def _add(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in zip(a, b, strict=True)]


def _scaled(value: object, scale: float, down: bool) -> int:
    """A Kubernetes quantity ("500m", "2", "1.5Gi", "1e9") times `scale`, rounded down or up; bounded."""
    text = str(value)
    try:
        amount = parse_quantity(text) * Decimal(scale)
    except ValueError:
        raise InputError(f"{text[:MAX_QUANTITY_LENGTH]!r} is not a quantity") from None
    if amount < 0:
        raise InputError(f"{text!r} is negative")
    if amount > UNLIMITED:
        return UNLIMITED
    whole = int(amount)
    return whole if down or whole == amount else whole + 1

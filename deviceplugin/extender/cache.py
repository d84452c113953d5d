"""The extender's state: each node's units (its annotation) and host capacity, its pods, and reservations.

A node's annotation lags its pods by up to one agent round (10 s) plus the publisher's debounce, so the
free shares of a node are: the annotation's free, minus the shares of every pod bound or nominated to the
node that the annotation's `pods` does not list yet (assumed pods), minus the pods the extender itself
passed for this node a moment ago and whose binding it has not seen yet (in-flight reservations: the
scheduler binds asynchronously, so the next pod's filter can come before the previous pod's binding).
A reservation covers the nodes the pod was passed for (at most `max_reservation_nodes`) and ends when the
pod is seen bound, is deleted, is filtered again, or after `reservation_ttl` seconds.

Every bound or nominated pod (share pod or not) also takes its CPU, memory and a pod slot from its node's
allocatable, and so does every in-flight reservation, so the policies that weigh CPU and memory (fgdstrand's
stranded GPUs) see each node as kube-scheduler does.

Pure and thread-safe; the watches feed it, the HTTP handlers read it. Bounded: reservations are capped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import defaults
from ..cluster import MILLI, PodDemand
from ..kube.annotation import HEALTHY, pod_digest
from .dra import FIRST_FIT, MAX_POD_CLAIMS, ClaimInfo, SliceInfo, shares_of
from .fit import FreeShares, free_shares, place
from .inputs import (
    ContainerRequest,
    HostCapacity,
    InputError,
    InventoryUnit,
    NodeInventory,
    NodeResource,
    PodRequest,
    parse_annotation,
    pod_demand,
)


@dataclass(frozen=True)
class PodState:
    """A pod that is bound or nominated to a node (its request may name no managed resource)."""

    uid: str
    node: str
    request: PodRequest
    digest: str  # as the node's annotation lists it


class CandidateNode:
    """One node as the verbs see it: inventory, free shares now, and what they need precomputed.

    `room[resource]`: the most shares one container can take there (the largest free unit, or the sum with
    allowSpanGPUs), so the common pod's fit is one comparison. `host`: allocatable, and `host_free`: what is left
    of it (CPU milli, memory MiB, pod slots). `scores`: the scorer's memo for this state.
    A cached view is replaced, never changed, when the node's annotation, capacity or pods change.
    """

    __slots__ = ("name", "inventory", "free", "error", "room", "scores", "host", "host_free")

    def __init__(
        self,
        name: str,
        inventory: NodeInventory | None,
        free: FreeShares,
        error: str = "",
        host: HostCapacity = HostCapacity(),
        host_free: tuple[int, int, int] | None = None,
    ) -> None:
        self.name = name
        self.inventory = inventory
        self.free = free
        self.error = error  # why there is no inventory
        self.host = host
        self.host_free = host_free if host_free is not None else (host.cpu_milli, host.memory_mib, host.pods)
        resources = inventory.resources if inventory is not None else {}
        self.room = {r: sum(units) if resources[r].allow_span else max(units, default=0) for r, units in free.items()}
        self.scores: dict[str, int] = {}


@dataclass
class _Node:
    inventory: NodeInventory | None  # the annotation's resources and the DRA driver's devices
    error: str = ""  # why there is no inventory
    host: HostCapacity = HostCapacity()
    annotation: NodeInventory | None = None  # the annotation's alone
    view: CandidateNode | None = None  # after assumed pods, before reservations; None: to recompute


@dataclass
class _Reservation:
    request: PodRequest
    nodes: tuple[str, ...]
    expires: float
    seq: int = 0


class ClusterCache:
    def __init__(
        self,
        reservation_ttl: float = defaults.RESERVATION_TTL,
        max_reservations: int = 256,
        max_reservation_nodes: int = 256,
        clock: Callable[[], float] = time.monotonic,
        driver: str = "",
        classes: frozenset[str] = frozenset(),
    ) -> None:
        """`driver`, `classes`: the gpu-share DRA driver and the DeviceClasses whose claims ask it for shares ("": no
        DRA)."""
        self.driver = driver
        self.classes = classes
        self.reservation_ttl = reservation_ttl
        self.max_reservations = max_reservations
        self.max_reservation_nodes = max_reservation_nodes
        self.clock = clock
        self._lock = threading.RLock()
        self._nodes: dict[str, _Node] = {}
        self._pods: dict[str, PodState] = {}  # uid -> pod
        self._pods_on: dict[str, dict[str, PodState]] = {}  # node -> uid -> pod
        self._reservations: dict[str, _Reservation] = {}  # uid -> reservation, oldest first
        self._reserved_on: dict[str, set[str]] = {}  # node -> uids
        self._seq = 0
        # DRA: the driver's slices, the claims and templates, and per node its devices as units of one resource.
        self._slices: dict[str, SliceInfo] = {}  # slice name -> slice
        self._claims: dict[tuple[str, str], ClaimInfo] = {}  # (namespace, name) -> claim
        self._templates: dict[tuple[str, str], tuple[tuple[int, int, int], ...]] = {}  # (namespace, name) -> requests
        self._results: dict[
            tuple[str, str], dict[tuple[str, str], tuple[tuple[int, int], ...]]
        ] = {}  # (pool, device) -> claim -> (shares, memory)
        self._pool_node: dict[str, str] = {}
        self._dra: dict[str, NodeResource] = {}  # node -> its devices
        self._share_bytes = 0  # one share's memory on some device (a claim naming only memory)

    # --- fed by the watches ------------------------------------------------------------------
    def set_node(self, name: str, annotation: str | None, host: HostCapacity = HostCapacity()) -> None:
        """A node's annotation and allocatable (unlimited where the Node does not say)."""
        if annotation is None:
            entry = _Node(
                None,
                "node has no gpu-share inventory annotation (no gpu-share plugin, or it has not published yet)",
                host,
            )
        else:
            try:
                inventory = parse_annotation(name, annotation)
                entry = _Node(inventory, host=host, annotation=inventory)
            except InputError as err:
                entry = _Node(None, f"node's gpu-share inventory annotation is unusable: {err}", host)
        with self._lock:
            self._nodes[name] = entry
            self._merge(name)

    def delete_node(self, name: str) -> None:
        with self._lock:
            self._nodes.pop(name, None)

    def replace_nodes(self, nodes: dict[str, tuple[str | None, HostCapacity]]) -> None:
        """After a (re)list: exactly these nodes, each (annotation, allocatable)."""
        with self._lock:
            for name in set(self._nodes) - set(nodes):
                del self._nodes[name]
            for name, (annotation, host) in nodes.items():
                self.set_node(name, annotation, host)

    def set_pod(self, pod: PodState) -> None:
        with self._lock:
            self.delete_pod(pod.uid)
            self._pods[pod.uid] = pod
            self._pods_on.setdefault(pod.node, {})[pod.uid] = pod
            self._dirty(pod.node)
            self._drop_reservation(pod.uid)  # bound or nominated: now an assumed pod on its node

    def delete_pod(self, uid: str) -> None:
        with self._lock:
            self._drop_reservation(uid)
            old = self._pods.pop(uid, None)
            if old is not None:
                self._pods_on[old.node].pop(uid, None)
                if not self._pods_on[old.node]:
                    del self._pods_on[old.node]
                self._dirty(old.node)

    def replace_pods(self, pods: Iterable[PodState]) -> None:
        with self._lock:
            wanted = {p.uid: p for p in pods}
            for uid in set(self._pods) - set(wanted):
                self.delete_pod(uid)
            for pod in wanted.values():
                if self._pods.get(pod.uid) != pod:
                    self.set_pod(pod)

    def set_slice(self, name: str, info: SliceInfo | None) -> None:
        """A ResourceSlice of the driver (None: deleted, or not the driver's)."""
        with self._lock:
            old = self._slices.pop(name, None)
            if info is not None:
                self._slices[name] = info
            self._rebuild({s.node for s in (old, info) if s is not None})

    def replace_slices(self, slices: dict[str, SliceInfo]) -> None:
        with self._lock:
            nodes = {s.node for s in self._slices.values()} | {s.node for s in slices.values()}
            self._slices = dict(slices)
            self._rebuild(nodes)

    def set_claim(self, key: tuple[str, str], info: ClaimInfo | None) -> None:
        """A ResourceClaim by (namespace, name) (None: deleted)."""
        with self._lock:
            touched = self._unclaim(key)
            if info is not None:
                self._claims[key] = info
                touched |= self._claim(key, info)
                if info.allocated:
                    for uid in info.reserved_for:  # the allocation now counts what the pod's reservation held
                        self._drop_reservation(uid)
            self._rebuild(touched)

    def replace_claims(self, claims: dict[tuple[str, str], ClaimInfo]) -> None:
        with self._lock:
            touched: set[str] = set()
            for key in set(self._claims) - set(claims):
                touched |= self._unclaim(key)
            for key, info in claims.items():
                touched |= self._unclaim(key) | self._claim(key, info)
                self._claims[key] = info
            self._rebuild(touched)

    def set_template(self, key: tuple[str, str], requests: tuple[tuple[int, int, int], ...] | None) -> None:
        with self._lock:
            if requests is None:
                self._templates.pop(key, None)
            else:
                self._templates[key] = requests

    def replace_templates(self, templates: dict[tuple[str, str], tuple[tuple[int, int, int], ...]]) -> None:
        with self._lock:
            self._templates = dict(templates)

    def dra_request(self, pod: dict) -> tuple[ContainerRequest, ...]:
        """What a pod's claims not yet allocated ask of the driver: per request, `count` containers of its shares.

        Allocated claims are counted on their devices already (their consumedCapacity), so they ask nothing more.
        """
        spec = pod.get("spec") or {}
        entries = spec.get("resourceClaims") or []
        if not self.driver or not isinstance(entries, list):
            return ()
        namespace = str((pod.get("metadata") or {}).get("namespace", ""))
        generated = {
            str(s.get("name")): s.get("resourceClaimName")
            for s in ((pod.get("status") or {}).get("resourceClaimStatuses") or [])
            if isinstance(s, dict)
        }
        out: list[ContainerRequest] = []
        with self._lock:
            for entry in entries[:MAX_POD_CLAIMS]:
                if not isinstance(entry, dict):
                    continue
                name = entry.get("resourceClaimName") or generated.get(str(entry.get("name")))
                if name:
                    claim = self._claims.get((namespace, str(name)))
                    if claim is None or claim.allocated:
                        continue  # not created yet (kube-scheduler waits for it), or counted
                    requests = claim.requests
                elif entry.get("resourceClaimTemplateName"):
                    requests = self._templates.get((namespace, str(entry["resourceClaimTemplateName"])), ())
                else:
                    continue
                for i, (count, shares, memory) in enumerate(requests):
                    wanted = shares_of(shares, memory, self._share_bytes)
                    out += [
                        ContainerRequest(f"claim {entry.get('name')} request {i}", ((self.driver, wanted),))
                    ] * count
        return tuple(out)

    # --- read by the HTTP handlers ------------------------------------------------------------
    def node(self, name: str, exclude: str = "") -> tuple[NodeInventory | None, FreeShares | str]:
        """(inventory, free shares now) of a node, without pod `exclude`'s own assumption; (None, why) without one."""
        with self._lock:
            view = self._view(name, exclude)
        return (view.inventory, view.free) if view.inventory is not None else (None, view.error)

    def views(self, names: list[str], exclude: str = "") -> list[CandidateNode]:
        """Each node's view now, without pod `exclude`'s own assumption and reservation, under one lock.

        Views after assumed pods are cached per node; a node with other pods' reservations gets a fresh one.
        """
        out = []
        only_own = {exclude}
        with self._lock:
            nodes, reserved_on, pods_on = self._nodes, self._reserved_on, self._pods_on
            for name in names:
                entry = nodes.get(name)
                view = entry.view if entry is not None else None
                reserved = reserved_on.get(name)
                if (
                    view is None
                    or (reserved and reserved != only_own)
                    or (exclude and exclude in pods_on.get(name, ()))
                ):
                    view = self._view(name, exclude)
                out.append(view)
        return out

    def reserve(self, request: PodRequest, nodes: list[str]) -> None:
        """Pod `request` was passed for `nodes`: count it there until its binding shows (see the module doc)."""
        if not request.uid or not nodes:
            return
        with self._lock:
            self._drop_reservation(request.uid)
            if request.uid in self._pods:
                return  # already bound or nominated: counted as an assumed pod
            while len(self._reservations) >= self.max_reservations:
                self._drop_reservation(next(iter(self._reservations)))
            self._seq += 1
            kept = tuple(nodes[: self.max_reservation_nodes])
            self._reservations[request.uid] = _Reservation(
                request, kept, self.clock() + self.reservation_ttl, self._seq
            )
            for name in kept:
                self._reserved_on.setdefault(name, set()).add(request.uid)

    def forget_reservation(self, uid: str) -> None:
        with self._lock:
            self._drop_reservation(uid)

    def workload(self) -> list[PodDemand]:
        """Every pod bound or nominated to a node with a gpu-share inventory, as a cluster-model pod: the task shapes.

        A share pod is its largest request (k shares of units of N: k/N of a GPU) with its CPU and memory, a pod
        holding allocated DRA claims of the driver what its claims' results hold; any other pod on those nodes is
        CPU-only, as in the trace the policies were measured on.
        """
        with self._lock:
            claimed = self._claimed_shares()
            out = []
            for pod in self._pods.values():
                entry = self._nodes.get(pod.node)
                if entry is None or entry.inventory is None:
                    continue
                request = pod.request
                held = claimed.get(pod.uid)
                if held and request.empty:
                    out.append(_claimed_pod(held, request))
                    continue
                if request.empty:
                    out.append(PodDemand(request.cpu_milli, request.memory_mib))
                    continue
                info = entry.inventory.resources.get(request.largest[0])
                if info is not None and info.units:
                    out.append(pod_demand(request, max(info.totals)))
            return out

    def pod_count(self) -> int:
        """Every pod known (what `workload()` reads), cheaply: the scorer learns again when it has doubled."""
        return len(self._pods)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "nodes": len(self._nodes),
                "nodes_with_inventory": sum(1 for n in self._nodes.values() if n.inventory is not None),
                "assumed_pods": sum(1 for p in self._pods.values() if not p.request.empty and not self._counted(p)),
                "reservations": len(self._reservations),
            }

    # --- internals ----------------------------------------------------------------------------
    def _view(self, name: str, exclude: str) -> CandidateNode:
        entry = self._nodes.get(name)
        if entry is None:
            return CandidateNode(name, None, {}, "node is not known to the extender (not in its node cache)")
        if entry.inventory is None:
            if entry.view is None:
                entry.view = CandidateNode(name, None, {}, entry.error, entry.host)
            return entry.view
        if exclude and exclude in self._pods_on.get(name, ()):
            view = self._fresh_view(name, entry, exclude)  # a nominated pod filtered again: rare
        else:
            if entry.view is None:
                entry.view = self._fresh_view(name, entry, "")
            view = entry.view
        reserved = self._reserved(name, exclude)
        if not reserved:
            return view
        free = {r: list(units) for r, units in view.free.items()}
        cpu, memory, slots = view.host_free
        for request in reserved:
            place(request, entry.inventory, free)  # a pod that no longer fits takes nothing
            cpu, memory, slots = cpu - request.cpu_milli, memory - request.memory_mib, slots - 1
        return CandidateNode(name, entry.inventory, free, host=entry.host, host_free=(cpu, memory, slots))

    def _fresh_view(self, name: str, entry: _Node, exclude: str) -> CandidateNode:
        assert entry.inventory is not None
        host = entry.host
        cpu, memory, slots = host.cpu_milli, host.memory_mib, host.pods
        for uid, pod in self._pods_on.get(name, {}).items():
            if uid != exclude:
                cpu, memory, slots = cpu - pod.request.cpu_milli, memory - pod.request.memory_mib, slots - 1
        return CandidateNode(
            name, entry.inventory, self._free(name, entry.inventory, exclude), host=host, host_free=(cpu, memory, slots)
        )

    def _counted(self, pod: PodState) -> bool:
        entry = self._nodes.get(pod.node)
        return entry is not None and entry.inventory is not None and pod.digest in entry.inventory.pods

    def _free(self, name: str, inventory: NodeInventory, exclude: str) -> FreeShares:
        """The annotation's free shares minus the assumed pods' (a pod that no longer fits takes nothing)."""
        free = free_shares(inventory)
        for uid, pod in self._pods_on.get(name, {}).items():
            if uid != exclude and not pod.request.empty and pod.digest not in inventory.pods:
                place(pod.request, inventory, free)
        return free

    def _reserved(self, name: str, exclude: str) -> list[PodRequest]:
        """Other pods' live reservations on the node, oldest first (expired ones are dropped)."""
        uids = self._reserved_on.get(name)
        if not uids:
            return []
        now = self.clock()
        for uid in [u for u in uids if self._reservations[u].expires <= now]:
            self._drop_reservation(uid)
        live = sorted(
            (self._reservations[u] for u in self._reserved_on.get(name, ()) if u != exclude), key=lambda r: r.seq
        )
        return [r.request for r in live]

    def _claimed_shares(self) -> dict[str, list[tuple[int, int]]]:
        """Pod UID -> (shares, device's shares) of each result its allocated claims hold."""
        pool_of = {node: pool for pool, node in self._pool_node.items()}
        totals = {(pool_of.get(node, node), u.uuid): u.total for node, r in self._dra.items() for u in r.units}
        out: dict[str, list[tuple[int, int]]] = {}
        for info in self._claims.values():
            if not info.allocated or not info.consumed or not info.reserved_for:
                continue
            held = []
            for pool, device, shares, memory in info.consumed:
                total = totals.get((pool, device))
                if total:
                    held.append(
                        (total if shares < 0 else min(total, shares_of(shares, memory, self._share_bytes)), total)
                    )
            for uid in info.reserved_for:
                out.setdefault(uid, []).extend(held)
        return out

    def _claim(self, key: tuple[str, str], info: ClaimInfo) -> set[str]:
        """Record the claim's results on their devices; the nodes touched."""
        per_device: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for pool, device, shares, memory in info.consumed:
            per_device.setdefault((pool, device), []).append((shares, memory))
        for where, held in per_device.items():
            self._results.setdefault(where, {})[key] = tuple(held)
        return {self._pool_node[pool] for pool, _ in per_device if pool in self._pool_node}

    def _unclaim(self, key: tuple[str, str]) -> set[str]:
        old = self._claims.pop(key, None)
        if old is None:
            return set()
        touched = set()
        for pool, device, _, _ in old.consumed:
            held = self._results.get((pool, device))
            if held is not None:
                held.pop(key, None)
                if not held:
                    del self._results[(pool, device)]
            if pool in self._pool_node:
                touched.add(self._pool_node[pool])
        return touched

    def _rebuild(self, nodes: set[str]) -> None:
        """Each node's devices as units of the driver's resource, free = shares minus what claims hold."""
        if not nodes:
            return
        by_node: dict[str, list[tuple[str, SliceInfo]]] = {}
        for name, info in self._slices.items():
            self._pool_node[info.pool] = info.node
            if info.node in nodes:
                by_node.setdefault(info.node, []).append((name, info))
        for node in nodes:
            units = []
            for _, info in sorted(by_node.get(node, [])):  # kube-scheduler's order: slices by name, devices as listed
                for device in info.devices:
                    if device.share_bytes:
                        self._share_bytes = self._share_bytes or device.share_bytes
                    held = self._results.get((info.pool, device.name), {})
                    used = sum(
                        device.shares if s < 0 else shares_of(s, m, device.share_bytes)
                        for results in held.values()
                        for s, m in results
                    )
                    used = min(used, device.shares)
                    units.append(
                        InventoryUnit(device.name, device.index, "", device.shares, used, device.shares - used, HEALTHY)
                    )
            if units:
                self._dra[node] = NodeResource(self.driver, node, False, FIRST_FIT, tuple(units))
            else:
                self._dra.pop(node, None)
            self._merge(node)

    def _merge(self, name: str) -> None:
        entry = self._nodes.get(name)
        if entry is None:
            return
        dra, base = self._dra.get(name), entry.annotation
        if dra is None:
            entry.inventory = base
        elif base is None:
            entry.inventory = NodeInventory(name, 0, {dra.name: dra}, frozenset())
        else:
            entry.inventory = NodeInventory(name, base.generation, {**base.resources, dra.name: dra}, base.pods)
        entry.view = None

    def _dirty(self, name: str) -> None:
        entry = self._nodes.get(name)
        if entry is not None:
            entry.view = None

    def _drop_reservation(self, uid: str) -> None:
        reservation = self._reservations.pop(uid, None)
        if reservation is None:
            return
        for name in reservation.nodes:
            uids = self._reserved_on.get(name)
            if uids is not None:
                uids.discard(uid)
                if not uids:
                    del self._reserved_on[name]


def _claimed_pod(held: list[tuple[int, int]], request: PodRequest) -> PodDemand:
    """A DRA pod as the cluster model sees it: whole devices count together, else its largest share of one."""
    if len(held) > 1 and all(shares == total for shares, total in held):
        return PodDemand(request.cpu_milli, request.memory_mib, num_gpu=len(held), gpu_milli=MILLI)
    shares, total = max(held, key=lambda st: st[0] / st[1])
    return pod_demand(
        PodRequest("", "", "", (ContainerRequest("", (("", shares),)),), (), request.cpu_milli, request.memory_mib),
        total,
    )


def pod_state(pod: dict, request: PodRequest) -> PodState | None:
    """The cache entry of a Pod object: bound (spec.nodeName) or nominated, not finished; else None."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    node = (pod.get("spec") or {}).get("nodeName") or status.get("nominatedNodeName")
    if not node or not request.uid:
        return None
    return PodState(
        request.uid, str(node), request, "" if request.empty else pod_digest(request.namespace, request.name)
    )

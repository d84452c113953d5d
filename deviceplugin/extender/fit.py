"""Does a pod fit a node: every container's shares of each resource on one GPU or MIG instance.

The units are chosen the way the node plugin will choose them (its allocationPolicy: binpack takes the
fullest unit that fits, spread the emptiest, a cluster policy such as fgdstrand what it scores best), so the extender's
assumption for a pod it placed matches the node. Pools with allowSpanGPUs may take a container's shares from several
units, largest pieces first. Pure: works on the free shares of one node (FreeShares) that the cache keeps up to date.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..alloc.placement import choose_unit, largest_first
from ..kube.annotation import QUARANTINED, UNHEALTHY
from .dra import FIRST_FIT
from .inputs import NodeInventory, NodeResource, PodRequest

# Failure categories: the `reason` label of the filtered-out metric.
NO_INVENTORY = "no-inventory"  # no (readable) annotation: not a gpu-share node, or an old plugin
NO_RESOURCE = "no-resource"
TOO_LARGE = "larger-than-any-unit"
UNHEALTHY_UNIT = "unhealthy"
QUARANTINED_UNIT = "quarantined"
SPLIT = "split-shares"
INSUFFICIENT = "insufficient-shares"
REASONS = (NO_INVENTORY, NO_RESOURCE, TOO_LARGE, UNHEALTHY_UNIT, QUARANTINED_UNIT, SPLIT, INSUFFICIENT)

FreeShares = dict[str, list[int]]  # resource -> free shares per unit, in the annotation's unit order


@dataclass(frozen=True)
class Placement:
    container: str
    resource: str
    unit: int  # index into the resource's units
    shares: int


@dataclass(frozen=True)
class Fit:
    placements: tuple[Placement, ...] = ()
    category: str = ""  # "" when the pod fits
    reason: str = ""
    unresolvable: bool = False  # preemption cannot help: no unit of the node could ever hold it

    @property
    def ok(self) -> bool:
        return not self.category


def free_shares(node: NodeInventory) -> FreeShares:
    return {name: [u.free for u in r.units] for name, r in node.resources.items()}


def place(request: PodRequest, node: NodeInventory, free: FreeShares) -> Fit:
    """Place the pod on `free` (updated in place only when it fits), or say why it does not fit."""
    for container in request.alone:  # an init container runs alone: it only has to fit now
        for resource, count in container.shares:
            failure = _check(node, free, resource, count, container.name)
            if failure:
                return failure
    touched: dict[str, list[int]] = {}
    placements: list[Placement] = []
    for container in request.together:
        for resource, count in container.shares:
            failure = _check(node, touched if resource in touched else free, resource, count, container.name)
            if failure:
                return failure
            units = touched.setdefault(resource, list(free[resource]))
            placements += [
                Placement(container.name, resource, i, n) for i, n in _take(node.resources[resource], units, count)
            ]
    free.update(touched)
    return Fit(placements=tuple(placements))


def _check(node: NodeInventory, free: FreeShares, resource: str, count: int, container: str) -> Fit | None:
    info = node.resources.get(resource)
    if info is None or not info.units:
        return Fit(
            category=NO_RESOURCE, reason=f"node has no {resource} (not in its gpu-share inventory)", unresolvable=True
        )
    units = free[resource]
    if (sum(units) if info.allow_span else max(units)) >= count:
        return None
    return _why(info, units, count, container)


def _take(info: NodeResource, units: list[int], count: int) -> list[tuple[int, int]]:
    """(unit index, shares) taken for one container, chosen as the node plugin chooses."""
    if info.policy == FIRST_FIT:  # a DRA device: kube-scheduler's allocator takes the first that fits
        best = next((i for i, n in enumerate(units) if n >= count), None)
    else:
        best = choose_unit(info.policy, units, info.totals, count)
    if best is not None:
        units[best] -= count
        return [(best, count)]
    taken = []  # allowSpanGPUs: the largest pieces first
    for i in largest_first(units):
        n = min(units[i], count)
        if n:
            units[i] -= n
            taken.append((i, n))
            count -= n
        if not count:
            break
    return taken


def _why(info: NodeResource, free: list[int], count: int, container: str) -> Fit:
    units = info.units
    kind = units[0].kind
    asks = f"container {container} asks for {count} shares of {info.name}"
    largest = max(u.total for u in units)
    if count > largest and not info.allow_span:
        return Fit(
            category=TOO_LARGE, reason=f"{asks}; each {kind} of this node has at most {largest}", unresolvable=True
        )
    for health, category, why in (
        (UNHEALTHY, UNHEALTHY_UNIT, "is Unhealthy"),
        (QUARANTINED, QUARANTINED_UNIT, "is quarantined (a finished tenant's memory is still on it)"),
    ):
        blocked = [u for u in units if u.health == health and u.total - u.used >= count]
        if blocked:
            where = ", ".join(_name(u) for u in blocked[:4])
            return Fit(category=category, reason=f"{asks}; {where} would have room but {why}")
    pieces = sorted((n for n in free if n), reverse=True)
    if sum(free) >= count:
        split = "+".join(str(n) for n in pieces[:8]) + ("+..." if len(pieces) > 8 else "")
        return Fit(
            category=SPLIT,
            reason=f"{asks} on one {kind}; the most free on one {kind} is {pieces[0]} (free {split} "
            f"on {len(pieces)} {kind}s)",
        )
    return Fit(category=INSUFFICIENT, reason=f"{asks}; the node has {sum(free)} free")


def _name(unit) -> str:
    return f"GPU {unit.gpu}" + (f" MIG {unit.profile} {unit.uuid}" if unit.profile else "")

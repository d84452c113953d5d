"""Where shares land (GetPreferredAllocation): plain functions of a resource and device IDs, no transport.

The node plugin's server calls `preferred_allocation`; the cluster layer can call the same function. Repeated
calls with the same IDs give the same answer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from itertools import combinations
from math import comb

from ..model.devices import Device, Resource
from .modes import Placement, mode_of

CLUSTER_POLICIES = frozenset({"fgdstrand"})
# The node policies: the sort key of a unit that fits, from its free shares (lowest first; ties to the lowest index).
UNIT_ORDER: dict[str, Callable[[int], int]] = {
    "binpack": lambda free: free,  # the fullest unit that fits
    "spread": lambda free: -free,  # the emptiest
}
_MAX_COMBINATIONS = 5000


def preferred_allocation(
    resource: Resource, available: Iterable[str], must_include: Iterable[str], size: int
) -> list[str]:
    """Pick `size` devices from `available`, keeping `must_include`; all shares on one unit (GPU or MIG) when
    possible."""
    known = _dedupe(i for i in available if i in resource.devices)
    must = _dedupe(i for i in must_include if i in resource.devices)
    if size <= len(must):
        return must
    placement = mode_of(resource.pool).placement
    if placement == "topology":  # whenever there is a choice (size > len(must)), topology decides
        return must + best_connected(resource, [i for i in known if i not in must], must, size - len(must))
    free: dict[str, list[Device]] = defaultdict(list)  # unit uuid -> its free devices
    for device_id in known:
        if device_id not in must:
            free[resource.devices[device_id].unit.uuid].append(resource.devices[device_id])
    chosen = list(must)
    for uuid in unit_order(resource, placement, free, must, size - len(must)):
        for device in sorted(free[uuid], key=lambda d: d.share or 0):
            if len(chosen) == size:
                return chosen
            chosen.append(device.id)
    return chosen


def unit_order(
    resource: Resource, placement: Placement, free: dict[str, list[Device]], must: list[str], wanted: int
) -> list[str]:
    """Units (their UUIDs, keys of `free`: unit -> its free devices) in the order to take devices from."""
    rank = {u.uuid: i for i, u in enumerate(resource.units)}  # GPU index order, MIG instances in order
    in_order = sorted(free, key=rank.__getitem__)
    if placement == "in order":
        return in_order
    must_units = {resource.devices[i].unit.uuid for i in must}
    if must_units:
        # Complete the unit(s) already holding must_include first.
        return sorted(in_order, key=lambda u: u not in must_units)
    counts = [len(free.get(u.uuid, ())) for u in resource.units]
    best = choose_unit(resource.allocation_policy, counts, [u.replicas for u in resource.units], wanted)
    if best is not None:
        chosen = resource.units[best].uuid
        return [chosen] + [u for u in in_order if u != chosen]
    # Nothing fits on one unit: the largest pieces first, so the refusal in Allocate names few units.
    return [resource.units[i].uuid for i in largest_first(counts) if counts[i]]


def choose_unit(policy: str, free: Sequence[int], totals: Sequence[int], wanted: int) -> int | None:
    """The unit (its index) that takes `wanted` shares, from each unit's free and total shares; None when none has room.

    binpack: the fullest unit that fits (fewest free shares); spread: the emptiest; a cluster policy (fgdstrand): the
    unit it scores best, each unit a GPU with k of N free shares k/N of it free. Units of unequal share counts (MIG
    instances of different sizes) have no common measure: binpack then. Ties go to the lowest index.
    The node plugin's GetPreferredAllocation and the scheduler extender's assumption of where shares land both call it.
    """
    fitting = [i for i, n in enumerate(free) if n >= wanted]
    if not fitting:
        return None
    if policy in CLUSTER_POLICIES and len(set(totals)) == 1:
        from ..cluster.policies import share_unit

        best = share_unit(policy, list(free), totals[0], wanted)
        return fitting[0] if best is None else best
    order = UNIT_ORDER.get(policy, UNIT_ORDER["binpack"])  # fgdstrand over units of unequal sizes: binpack
    return min(fitting, key=lambda i: (order(free[i]), i))


def largest_first(free: Sequence[int]) -> list[int]:
    """Unit indexes by free shares, the most first (ties to the lowest index): where shares that fit no single unit
    go."""
    return sorted(range(len(free)), key=lambda i: -free[i])


def best_connected(resource: Resource, candidates: list[str], must: list[str], wanted: int) -> list[str]:
    """Whole GPUs for a multi-GPU request: the most NVLinks among them, then the fewest NUMA nodes, then low indexes."""
    gpus = {i: resource.devices[i].gpu for i in candidates + must}

    def score(ids: Iterable[str]) -> tuple[int, int, int]:
        chosen = [gpus[i] for i in (*must, *ids)]
        nvlinks = sum(resource.link(a, b).nvlinks for a, b in combinations(chosen, 2))
        return (nvlinks, -len({g.numa_node for g in chosen}), -sum(g.index for g in chosen))

    candidates = sorted(candidates, key=lambda i: gpus[i].index)
    if len(candidates) <= wanted:
        return candidates
    if comb(len(candidates), wanted) <= _MAX_COMBINATIONS:
        return list(max(combinations(candidates, wanted), key=score))
    chosen: tuple[str, ...] = ()
    for _ in range(wanted):  # greedy on large nodes
        chosen += (max((i for i in candidates if i not in chosen), key=lambda i: score(chosen + (i,))),)
    return list(chosen)


def _dedupe(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))

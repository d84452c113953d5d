"""Prioritize: the cluster placement policy (deviceplugin.cluster) scores each node that fits.

The pod's largest container request of a resource becomes a cluster-model pod (a fraction of one unit, or
whole units), and the node's units of that resource its GPUs with their free fraction; the policy's 0-100
score is scaled to the extender's 0-10. CPU and memory are left to kube-scheduler's own plugins.
"""

from __future__ import annotations

from functools import lru_cache

from ..cluster import MILLI, NEEDS_SHAPES, POLICIES, Node, Pod, Policy, make_policy
from .fit import FreeShares
from .model import NodeInventory, PodRequest

MAX_EXTENDER_SCORE = 10  # kube-scheduler's extenderv1.MaxExtenderPriority
USABLE_POLICIES = tuple(p for p in POLICIES if p not in NEEDS_SHAPES and p != "random")


class Scorer:
    """Scores are a pure function of (request, units' totals, units' free shares): memoised, bounded."""

    def __init__(self, policy: str = "binpack", memo: int = 65536) -> None:
        if policy not in USABLE_POLICIES:
            raise ValueError(f"--policy: {policy!r} is not one of {', '.join(USABLE_POLICIES)}")
        self.policy: Policy = make_policy(policy)
        self._score = lru_cache(maxsize=memo)(self._compute)

    def score(self, request: PodRequest, node: NodeInventory, free: FreeShares, largest: tuple[str, int] | None = None) -> int:
        """0-10 for a node the pod fits; 0 when the policy finds no room. `largest`: largest_request(request), precomputed."""
        resource, count = largest or largest_request(request)
        info = node.resources.get(resource)
        if info is None or not info.units:
            return 0
        return self._score(count, info.totals, tuple(free[resource]))

    def _compute(self, count: int, totals: tuple[int, ...], free: tuple[int, ...]) -> int:
        total = max(totals)
        if total == 1 or count > total:  # whole units
            pod = Pod(0, 0, num_gpu=-(-count // total), gpu_milli=MILLI)
        else:
            pod = Pod(0, 0, num_gpu=1, gpu_milli=-(-count * MILLI // total))
        gpu_free = [min(MILLI, f * MILLI // max(t, 1)) for t, f in zip(totals, free)]
        choice = self.policy.score(pod, Node("", 0, 0, "", gpu_free))
        return 0 if choice is None else choice.score * MAX_EXTENDER_SCORE // 100


def largest_request(request: PodRequest) -> tuple[str, int]:
    """The (resource, count) of the pod's largest container request: what the policy scores."""
    return max(((r, n) for c in request.together + request.alone for r, n in c.shares), key=lambda rn: rn[1])

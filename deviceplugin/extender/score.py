"""Prioritize: the cluster placement policy (deviceplugin.cluster) scores each node that fits.

The pod's largest container request of a resource becomes a cluster-model pod (a fraction of one unit, or
whole units), and the node's units of that resource its GPUs with their free fraction; the policy's 0-100
score is scaled to the extender's 0-10. CPU and memory are left to kube-scheduler's own plugins.
"""

from __future__ import annotations

from ..cluster import MILLI, NEEDS_SHAPES, POLICIES, Node, Pod, Policy, make_policy
from .fit import FreeShares
from .model import NodeInventory, PodRequest

MAX_EXTENDER_SCORE = 10  # kube-scheduler's extenderv1.MaxExtenderPriority
USABLE_POLICIES = tuple(p for p in POLICIES if p not in NEEDS_SHAPES and p != "random")


class Scorer:
    def __init__(self, policy: str = "binpack") -> None:
        if policy not in USABLE_POLICIES:
            raise ValueError(f"--policy: {policy!r} is not one of {', '.join(USABLE_POLICIES)}")
        self.policy: Policy = make_policy(policy)

    def score(self, request: PodRequest, node: NodeInventory, free: FreeShares) -> int:
        """0-10 for a node the pod fits; 0 when the policy finds no room."""
        resource, count = _largest(request)
        info = node.resources.get(resource)
        if info is None or not info.units:
            return 0
        total = max(u.total for u in info.units)
        if total == 1 or count > total:  # whole units
            pod = Pod(0, 0, num_gpu=-(-count // total), gpu_milli=MILLI)
        else:
            pod = Pod(0, 0, num_gpu=1, gpu_milli=-(-count * MILLI // total))
        gpu_free = [min(MILLI, f * MILLI // max(u.total, 1)) for u, f in zip(info.units, free[resource])]
        choice = self.policy.score(pod, Node(node.node, 0, 0, "", gpu_free))
        return 0 if choice is None else choice.score * MAX_EXTENDER_SCORE // 100


def _largest(request: PodRequest) -> tuple[str, int]:
    return max(((r, n) for c in request.together + request.alone for r, n in c.shares), key=lambda rn: rn[1])

"""Prioritize: the cluster placement policy (deviceplugin.cluster) scores each node that fits.

The pod's largest container request of a resource becomes a cluster-model pod (a fraction of one unit, or
whole units), and the node's units of that resource its GPUs with their free fraction; the policy's 0-100
score is scaled (rounded) to the extender's 0-10. CPU and memory are left to kube-scheduler's own plugins.
Policies that need the workload's task shapes (fgd) learn them from the share pods bound now, refreshed
every `refresh` seconds; until there are any, binpack scores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache

from ..cluster import MILLI, NEEDS_SHAPES, POLICIES, Node, Pod, Policy, TaskShapes, make_policy
from .cache import NodeView

MAX_EXTENDER_SCORE = 10  # kube-scheduler's extenderv1.MaxExtenderPriority
MAX_MEMO_SCORES = 32  # per node view: the (policy generation, resource, count) scores kept
USABLE_POLICIES = tuple(p for p in POLICIES if p != "random")


def cluster_pod(count: int, total: int) -> Pod:
    """A request of `count` shares of units of `total` shares, in the cluster model's milli-GPUs."""
    if total <= 1 or count > total:  # whole units
        return Pod(0, 0, num_gpu=-(-count // max(total, 1)), gpu_milli=MILLI)
    return Pod(0, 0, num_gpu=1, gpu_milli=-(-count * MILLI // total))


class Scorer:
    """Scores are a pure function of (request, units' totals, units' free shares) for one policy: memoised, bounded."""

    def __init__(
        self,
        policy: str = "binpack",
        memo: int = 65536,
        workload: Callable[[], list[tuple[int, int]]] = lambda: [],
        refresh: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`workload()`: (count, unit total) of the largest request of every bound share pod (for fgd)."""
        if policy not in USABLE_POLICIES:
            raise ValueError(f"--policy: {policy!r} is not one of {', '.join(USABLE_POLICIES)}")
        self.name = policy
        self.workload = workload
        self.refresh = refresh
        self.clock = clock
        self._fallback = make_policy("binpack")
        self._policy: Policy | None = None if policy in NEEDS_SHAPES else make_policy(policy)
        self._next_refresh = float("-inf")
        self._generation = 0  # bumped when the policy is rebuilt: keys the views' memos
        self._score = lru_cache(maxsize=memo)(self._compute)  # policies hash by identity

    @property
    def policy(self) -> Policy:
        """The policy scoring now (fgd: rebuilt from the workload every `refresh` seconds)."""
        if self.name in NEEDS_SHAPES and self.clock() >= self._next_refresh:
            pods = [cluster_pod(count, total) for count, total in self.workload()]
            self._policy = make_policy(self.name, TaskShapes.from_pods(pods)) if pods else None
            self._score.cache_clear()
            self._generation += 1
            self._next_refresh = self.clock() + self.refresh
        return self._policy or self._fallback

    def scores(self, resource: str, count: int, views: list[NodeView]) -> list[int]:
        """0-10 on each node for the pod whose largest request is `count` shares of `resource` (0: no room).

        Memoised on each node's view (replaced when the node changes) and across nodes in the same state.
        """
        policy = self.policy
        key = (self._generation, resource, count)
        out = []
        for view in views:
            score = view.scores.get(key)
            if score is None:
                info = view.inventory.resources.get(resource) if view.inventory is not None else None
                score = self._score(policy, count, info.totals, tuple(view.free[resource])) if info is not None and info.units else 0  # type: ignore[arg-type]
                if len(view.scores) >= MAX_MEMO_SCORES:
                    view.scores.clear()
                view.scores[key] = score
            out.append(score)
        return out

    @staticmethod
    def _compute(policy: Policy, count: int, totals: tuple[int, ...], free: tuple[int, ...]) -> int:
        gpu_free = [min(MILLI, f * MILLI // max(t, 1)) for t, f in zip(totals, free)]
        choice = policy.score(cluster_pod(count, max(totals)), Node("", 0, 0, "", gpu_free))
        return 0 if choice is None else (choice.score * MAX_EXTENDER_SCORE + 50) // 100  # rounded: 0-10 is coarse enough

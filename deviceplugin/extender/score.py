"""Prioritize: the cluster placement policy (deviceplugin.cluster) scores each node that fits.

The pod's largest container request of a resource becomes a cluster-model pod (a fraction of one unit, or
whole units) with the pod's CPU and memory request, and the node a cluster-model node: its units of that
resource as GPUs with their free fraction, its allocatable CPU, memory and pod slots with what its pods and
in-flight reservations leave free. So fgdstrand sees the CPU and memory that strand GPUs, as in the simulator.

kube-scheduler's extender scale is 0-10, and FGD's 0-100 scores differ by a point or two between good nodes:
rounded, they tie. So the scores are ranked within each call: the policy's best score gets 10, the next distinct
score 9, and so on down to 1 (0: no room). Where several nodes share the best score, one keeps 10 and every other
node goes one lower, so the policy's choice is always the extender's top node alone. The one is the node
whose name hashes lowest: one fixed pseudo-random order of the nodes, the same for every pod, on every retry and in
every extender replica, as `simulate` breaks FGD's ties by its node order. Equals then fill one node after another;
a pick per pod (the hash keyed by its UID) spread them like LeastAllocated, which takes the emptiest node, and both
spread CPU and memory over the nodes a large pod needs whole (docs/scheduler.md, "Task shapes and ties").

Policies that need the workload's task shapes (fgd, fgdstrand) take them from the operator's workload file
(`--workload`), else learn them from the pods bound now: again whenever the cluster's pod count has doubled or
halved since (a cluster filling up, emptied) and every `refresh` seconds; until there are any, binpack scores.
Shapes learned from the first pods of an empty cluster miss its rare large shapes: FGD then fills the nodes an
8-GPU pod needs.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from functools import lru_cache

from ..cluster import MILLI, NEEDS_SHAPES, POLICIES, Node, PodDemand, Policy, TaskShapes, make_policy
from ..cluster.policies import FgdStrandPolicy
from .cache import CandidateNode
from .inputs import HostCapacity, PodRequest, pod_demand

MAX_EXTENDER_SCORE = 10  # kube-scheduler's extenderv1.MaxExtenderPriority
MAX_MEMO_SCORES = 32  # per node view: the (policy generation, request) scores kept
USABLE_POLICIES = tuple(p for p in POLICIES if p != "random")
NO_ROOM = -1
_generations = itertools.count(1)  # one sequence for every Scorer: a view's memo never mixes two policies


def ranked(raw: list[int], names: Sequence[str] = ()) -> list[int]:
    """The policy's 0-100 scores (NO_ROOM: does not fit) as 0-10: the best distinct score 10, the next 9, ... at least
    1. With the nodes' `names`, where several nodes share the best score one of them alone keeps 10 (`tie_winner`)
    and every other node goes one lower."""
    levels = sorted({s for s in raw if s != NO_ROOM}, reverse=True)
    if not levels:
        return [0] * len(raw)
    best = [i for i, s in enumerate(raw) if s == levels[0]]
    tied = bool(names) and len(best) > 1
    first = MAX_EXTENDER_SCORE - 1 if tied else MAX_EXTENDER_SCORE
    rank = {s: max(1, first - i) for i, s in enumerate(levels)}
    out = [rank.get(s, 0) for s in raw]
    if tied:
        out[tie_winner(best, names)] = MAX_EXTENDER_SCORE
    return out


def tie_winner(best: list[int], names: Sequence[str]) -> int:
    """Of the indices `best` (nodes the policy scores alike), the one whose name hashes lowest."""
    return min(best, key=lambda i: hashlib.blake2b(names[i].encode(), digest_size=8).digest())


def _key(generation: int, resource: str, pod: PodDemand) -> str:
    models = ",".join(sorted(pod.gpu_models))
    return f"{generation}|{resource}|{pod.cpu_milli}|{pod.memory_mib}|{pod.num_gpu}|{pod.gpu_milli}|{models}"


class Scorer:
    """Scores are a pure function of (request, units' totals and free shares, host capacity and free) for one
    policy: memoised, bounded."""

    def __init__(
        self,
        policy: str = "binpack",
        memo: int = 65536,
        workload: Callable[[], list[PodDemand]] = lambda: [],
        refresh: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        shapes: TaskShapes | None = None,
        size: Callable[[], int] = lambda: 0,
    ) -> None:
        """`shapes`: the workload's task shapes, fixed (fgd, fgdstrand); without them they are learned from
        `workload()`, the pods bound now as cluster-model pods, whenever `size()` (the cluster's pod count) has
        doubled or halved since and every `refresh` seconds."""
        if policy not in USABLE_POLICIES:
            raise ValueError(f"--policy: {policy!r} is not one of {', '.join(USABLE_POLICIES)}")
        if shapes is not None and policy not in NEEDS_SHAPES:
            raise ValueError(f"--workload: the {policy} policy uses no task shapes (only {', '.join(NEEDS_SHAPES)})")
        self.name = policy
        self.workload = workload
        self.refresh = refresh
        self.clock = clock
        self.size = size
        self.learning = policy in NEEDS_SHAPES and shapes is None
        self._fallback = make_policy("binpack")
        self._policy: Policy | None = (
            make_policy(policy, shapes) if shapes is not None or policy not in NEEDS_SHAPES else None
        )
        self._next_refresh = float("-inf")
        self._learned_at_size = 0
        self._generation = next(_generations)  # renewed when the policy is rebuilt: keys the views' memos
        self._lock = threading.Lock()
        self._score = lru_cache(maxsize=memo)(self._compute)  # policies hash by identity

    @property
    def policy(self) -> Policy:
        """The policy scoring now (learning fgd: rebuilt from the workload, see __init__)."""
        return self._current()[0]

    def _current(self) -> tuple[Policy, int]:
        """The policy and its generation, read together (HTTP workers score at once; one of them rebuilds)."""
        with self._lock:
            size = self.size() if self.learning else 0
            if self.learning and (
                self.clock() >= self._next_refresh
                or size >= 2 * max(1, self._learned_at_size)
                or 2 * size < self._learned_at_size
            ):
                self._learned_at_size = size
                pods = self.workload()
                built = make_policy(self.name, TaskShapes.from_pods(pods)) if any(p.num_gpu for p in pods) else None
                self._policy = built
                self._score.cache_clear()
                self._generation = next(_generations)
                self._next_refresh = self.clock() + self.refresh
            return self._policy or self._fallback, self._generation

    def raw_scores(self, request: PodRequest, views: list[CandidateNode]) -> list[int]:
        """The policy's score on each node for the pod (by its largest request), NO_ROOM where it does not fit: 0-100,
        or cpu_only_score's own scale for a CPU-only pod under fgdstrand (only the order counts: `ranked`).

        Memoised on each node's view (replaced when the node changes) and across nodes in the same state.
        """
        policy, generation = self._current()
        if request.empty:
            return self._host_only(policy, generation, request, views)
        resource = request.largest[0]
        pods: dict[int, tuple[PodDemand, str]] = {}  # unit total -> the pod in the cluster model, its memo key
        total, pod, key = -1, None, ""
        out = []
        for view in views:
            inventory = view.inventory
            info = inventory.resources.get(resource) if inventory is not None else None
            if info is None or not info.units:
                out.append(NO_ROOM)
                continue
            if info.largest != total:  # nodes alike share the last one
                total = info.largest
                entry = pods.get(total)
                if entry is None:
                    made = pod_demand(request, total)
                    entry = pods[total] = (made, _key(generation, resource, made))  # a str caches its hash
                pod, key = entry
            score = view.scores.get(key)
            if score is None:
                score = self._score(policy, pod, info.totals, tuple(view.free[resource]), view.host, view.host_free)  # type: ignore[arg-type]
                if len(view.scores) >= MAX_MEMO_SCORES:
                    view.scores.clear()
                view.scores[key] = score
            out.append(score)
        return out

    def _host_only(self, policy: Policy, generation: int, request: PodRequest, views: list[CandidateNode]) -> list[int]:
        """A pod asking for no share (CPU-only): scored on each node's GPUs (its largest resource's units) and host; a
        node without a gpu-share inventory as a node without GPUs (nothing to strand there). Under fgdstrand by the
        GPUs it would strand, then by the node's idle GPUs (FgdStrandPolicy.cpu_only_score): nodes alike there (every
        node without GPUs, say) score alike, and kube-scheduler's own scores decide among them; no tie winner is
        picked for a CPU-only pod (`ranked` without names), so the cluster's own preferences keep their say."""
        pod = PodDemand(request.cpu_milli, request.memory_mib)
        key = _key(generation, "", pod)
        out = []
        for view in views:
            score = view.scores.get(key)
            if score is None:
                resources = (
                    [r for r in view.inventory.resources.values() if r.units] if view.inventory is not None else []
                )
                info = max(resources, key=lambda r: len(r.units), default=None)
                totals, free = (info.totals, tuple(view.free[info.name])) if info is not None else ((), ())
                score = self._score(policy, pod, totals, free, view.host, view.host_free)  # type: ignore[arg-type]
                if len(view.scores) >= MAX_MEMO_SCORES:
                    view.scores.clear()
                view.scores[key] = score
            out.append(score)
        return out

    @staticmethod
    def _compute(
        policy: Policy,
        pod: PodDemand,
        totals: tuple[int, ...],
        free: tuple[int, ...],
        host: HostCapacity,
        host_free: tuple[int, int, int],
    ) -> int:
        gpu_free = [min(MILLI, f * MILLI // max(t, 1)) for t, f in zip(totals, free, strict=True)]
        cpu, memory, slots = (max(0, v) for v in host_free)
        node = Node(
            "", host.cpu_milli, host.memory_mib, host.model, gpu_free, cpu, memory, host.pods, host.pods - slots
        )
        if not pod.num_gpu and isinstance(policy, FgdStrandPolicy):
            score = policy.cpu_only_score(pod, node)
            return NO_ROOM if score is None else score
        choice = policy.score(pod, node)
        return NO_ROOM if choice is None else choice.score

"""The task-shape distribution and the FGD paper's fragmentation measure.

A task shape is what a pod asks for, less its memory: CPU milli, GPU count, milli per GPU and accepted
GPU models (as in the authors' simulator). The popular shapes are the most frequent ones that together
cover `coverage` (95 %) of the pods of the original, un-inflated list; CPU-only pods count among them.

Fragmentation of node n for shape m (Weng et al., ATC'23): all idle GPU milli of n when m cannot run
there (CPU, model, or too few GPUs with room), else the idle milli on the GPUs whose free milli is below
m's `gpu_milli`. F_n = sum over shapes of popularity(m) * F_n(m). A CPU-only shape uses no GPU, so every
idle GPU milli is a fragment for it, as in the authors' simulator (reading "below 0 milli" literally
instead gives FGD about 0.4 points less on the default trace).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable
from functools import lru_cache
from typing import NamedTuple

from .capacity import FINEST_SPLIT, MILLI, Node, PodDemand

DEFAULT_COVERAGE = 0.95
_CACHE_SIZE = 1 << 18  # distinct (model, free-GPU multiset, CPU bracket) states remembered


class Shape(NamedTuple):
    cpu_milli: int
    num_gpu: int
    gpu_milli: int
    gpu_models: frozenset[str]


def shape_of(pod: PodDemand) -> Shape:
    return Shape(pod.cpu_milli, pod.num_gpu, pod.gpu_milli, pod.gpu_models)


class TaskShapes:
    """Popular task shapes with their popularity (summing to 1), and the fragmentation they imply."""

    def __init__(
        self,
        shapes: Iterable[tuple[Shape, float]],
        cpu_per_gpu_milli: float | None = None,
        memory_per_gpu_milli: float | None = None,
    ) -> None:
        """`cpu_per_gpu_milli`, `memory_per_gpu_milli`: what the pods ask per milli-GPU they ask (default: CPU from
        the shapes, memory unknown)."""
        self.shapes: tuple[tuple[Shape, float], ...] = tuple(shapes)
        if not self.shapes:
            raise ValueError("task shapes: need at least one shape")
        total = sum(p for _, p in self.shapes)
        if total <= 0 or any(p < 0 for _, p in self.shapes):
            raise ValueError("task shapes: popularities must be >= 0 and not all 0")
        self.shapes = tuple((s, p / total) for s, p in self.shapes)
        # A node's CPU matters only through which shapes' CPU requests it meets: index it by bracket.
        self._cpu_steps = sorted({s.cpu_milli for s, _ in self.shapes})
        self._rows = tuple(
            (self._cpu_steps.index(s.cpu_milli), s.num_gpu, s.gpu_milli, s.gpu_models, p) for s, p in self.shapes
        )
        self._memo = lru_cache(maxsize=_CACHE_SIZE)(self._compute)
        gpu_demand = sum(p * s.num_gpu * s.gpu_milli for s, p in self.shapes)
        if cpu_per_gpu_milli is None and gpu_demand:
            cpu_per_gpu_milli = sum(p * s.cpu_milli for s, p in self.shapes) / gpu_demand
        self.cpu_per_gpu_milli = cpu_per_gpu_milli
        self.memory_per_gpu_milli = memory_per_gpu_milli

    def __reduce__(self):  # the memo does not pickle: rebuild it
        return (TaskShapes, (self.shapes, self.cpu_per_gpu_milli, self.memory_per_gpu_milli))

    @classmethod
    def from_pods(cls, pods: Iterable[PodDemand], coverage: float = DEFAULT_COVERAGE) -> TaskShapes:
        """The most frequent shapes covering `coverage` of `pods` (ties: the larger shape first)."""
        if not 0 < coverage <= 1:
            raise ValueError(f"task shapes: coverage must be in (0, 1], got {coverage}")
        pods = list(pods)
        counts = Counter(shape_of(p) for p in pods)
        if not counts:
            raise ValueError("task shapes: no pods to learn shapes from")
        ordered = sorted(
            counts.items(),
            key=lambda kv: (kv[1], kv[0].cpu_milli, kv[0].gpu_milli, kv[0].num_gpu, sorted(kv[0].gpu_models)),
            reverse=True,
        )
        total, covered, chosen = sum(counts.values()), 0, []
        for shape, n in ordered:
            chosen.append((shape, float(n)))
            covered += n
            if covered >= coverage * total:
                break
        gpu_demand = sum(p.gpu_request for p in pods)
        if not gpu_demand:
            return cls(chosen)
        return cls(chosen, sum(p.cpu_milli for p in pods) / gpu_demand, sum(p.memory_mib for p in pods) / gpu_demand)

    @classmethod
    def shares(cls, replicas: int) -> TaskShapes:
        """Inside one node, where only GPU shares are known: every request of k of `replicas` shares
        (k/replicas of a GPU), equally popular."""
        if not 1 <= replicas <= FINEST_SPLIT:
            raise ValueError(f"task shapes: replicas must be 1-{FINEST_SPLIT}, got {replicas}")
        return cls([(Shape(0, 1, k * MILLI // replicas, frozenset()), 1.0) for k in range(1, replicas + 1)])

    def fragmentation(self, node: Node) -> float:
        """F_n of the node as it is now."""
        return self.fragmentation_of(node.model, node.gpu_free, node.cpu_free)

    def fragmentation_of(self, model: str, gpu_free: Iterable[int], cpu_free: int) -> float:
        """F_n of a node of this model with these free milli per GPU and this much free CPU."""
        return self._memo(model, tuple(sorted(gpu_free)), bisect_right(self._cpu_steps, cpu_free))

    def _compute(self, model: str, gpus: tuple[int, ...], cpu_bracket: int) -> float:
        prefix = [0]
        for f in gpus:
            prefix.append(prefix[-1] + f)
        idle = prefix[-1]
        if idle == 0:
            return 0.0
        frag = 0.0
        for cpu_index, num_gpu, gpu_milli, models, p in self._rows:
            if num_gpu == 0 or cpu_bracket <= cpu_index or (models and model not in models):
                frag += p * idle  # uses no GPU here: every idle GPU is a fragment for this shape
            else:
                room = bisect_left(gpus, gpu_milli)  # gpus[room:] each have gpu_milli free
                frag += p * (idle if len(gpus) - room < num_gpu else prefix[room])
        return frag


@lru_cache(maxsize=64)
def share_shapes(replicas: int) -> TaskShapes:
    """`TaskShapes.shares(replicas)`, built once per share count."""
    return TaskShapes.shares(replicas)

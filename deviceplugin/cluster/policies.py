"""Placement policies: each scores one node for one pod and names the GPUs the pod would take there.

`policy.score(pod, node)` returns `Choice(score, gpus)` with an integer score 0-100 (higher is better),
or None when the pod does not fit the node. A scheduler takes the node with the highest score; ties go to
the first node in its node order. Multi-GPU and whole-GPU requests take the first fully free GPUs by index;
a fractional request takes the lowest-index GPU among those with the best score.

The baselines follow the FGD paper's simulator (Weng et al., "Beware of Fragmentation: Scheduling
GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC 2023).
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple, Protocol

from .capacity import MILLI, Node, PodDemand, first_gpus, fits, fitting_gpus
from .shapes import TaskShapes, share_shapes

MAX_SPEC_CPU = 128_000  # the largest node of the paper's cluster: BestFit and DotProduct normalise by it
MAX_SPEC_GPU = 8 * MILLI
MAX_SCORE = 100


class Choice(NamedTuple):
    score: int  # 0-100, higher is better
    gpus: tuple[int, ...]  # GPU indices on the node, one per requested GPU


class Policy(Protocol):
    name: str
    deterministic: bool  # False: the same state may score differently (random)

    def score(self, pod: PodDemand, node: Node) -> Choice | None: ...


def _clamp(value: float) -> int:
    return max(0, min(MAX_SCORE, int(value)))


def best_fit_gpus(pod: PodDemand, node: Node) -> tuple[int, ...]:
    """Fractional: the fitting GPU with the least free milli (lowest index on ties); else the first free GPUs."""
    if not pod.fractional:
        return first_gpus(pod, node)
    free = node.gpu_free
    return (min(fitting_gpus(pod, node), key=lambda i: (free[i], i)),)


def worst_fit_gpus(pod: PodDemand, node: Node) -> tuple[int, ...]:
    """Fractional: the fitting GPU with the most free milli (lowest index on ties); else the first free GPUs."""
    if not pod.fractional:
        return first_gpus(pod, node)
    free = node.gpu_free
    return (min(fitting_gpus(pod, node), key=lambda i: (-free[i], i)),)


class RandomPolicy:
    """A random score for every node that fits, a random fitting GPU for a fractional request."""

    name = "random"
    deterministic = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def score(self, pod: PodDemand, node: Node) -> Choice | None:
        if not fits(pod, node):
            return None
        gpus = (self.rng.choice(fitting_gpus(pod, node)),) if pod.fractional else first_gpus(pod, node)
        return Choice(self.rng.randint(0, MAX_SCORE), gpus)


class BestFitPolicy:
    """100 x (1 - [0.5 (cpu_free - cpu_req)/128000 + 0.5 (gpu_free - gpu_req)/8000]): the least left over wins."""

    name = "bestfit"
    deterministic = True

    def score(self, pod: PodDemand, node: Node) -> Choice | None:
        if not fits(pod, node):
            return None
        left = (
            0.5 * (node.cpu_free - pod.cpu_milli) / MAX_SPEC_CPU
            + 0.5 * (node.gpu_free_total - pod.gpu_request) / MAX_SPEC_GPU
        )
        return Choice(_clamp((1 - left) * MAX_SCORE), best_fit_gpus(pod, node))


class DotProductPolicy:
    """Tetris: the smallest dot product of the node's free (CPU, GPU) and the pod's request, both over the max spec."""

    name = "dotproduct"
    deterministic = True

    def score(self, pod: PodDemand, node: Node) -> Choice | None:
        if not fits(pod, node):
            return None
        dot = (node.cpu_free / MAX_SPEC_CPU) * (pod.cpu_milli / MAX_SPEC_CPU) + (node.gpu_free_total / MAX_SPEC_GPU) * (
            pod.gpu_request / MAX_SPEC_GPU
        )
        return Choice(_clamp((1 - dot / 2) * MAX_SCORE), best_fit_gpus(pod, node))


class GpuPackingPolicy:
    """Partly used GPUs first (the fuller the better), then free GPUs of a used node, then a free node (the smaller the
    better)."""

    name = "gpupacking"
    deterministic = True

    def score(self, pod: PodDemand, node: Node) -> Choice | None:
        if not fits(pod, node):
            return None
        gpus = best_fit_gpus(pod, node)
        if pod.num_gpu == 0:
            return Choice(0, gpus)
        free = node.gpu_free
        fully_free = sum(1 for f in free if f == MILLI)
        if fully_free == len(free):
            return Choice(max(MAX_SCORE // 3 - fully_free, fully_free), gpus)
        # Which GPUs packing would use: the least free first.
        using = sorted((i for i in range(len(free)) if free[i] >= pod.gpu_milli), key=lambda i: free[i])[: pod.num_gpu]
        whole = sum(1 for i in using if free[i] == MILLI)
        if whole:
            return Choice(max(MAX_SCORE // 2 - whole, MAX_SCORE // 3), gpus)
        left_percent = sum(free[i] * 100 // MILLI for i in using)
        return Choice(max(MAX_SCORE - left_percent // 10, MAX_SCORE // 2), gpus)


def fgd_score(frag_before: float, frag_after: float) -> int:
    """The paper's score: int(100 x sigmoid(decrease of fragmentation / 1000))."""
    return int(MAX_SCORE / (1 + math.exp((frag_after - frag_before) / MILLI)))


class FgdPolicy:
    """Fragmentation Gradient Descent: the placement that least increases the node's expected fragmentation."""

    name = "fgd"
    deterministic = True

    def __init__(self, shapes: TaskShapes) -> None:
        self.shapes = shapes

    def measure(self, model: str, gpu_free: list[int], cpu_free: int, memory_free: int) -> float:
        """What the policy descends: here the paper's fragmentation (CPU and GPUs only)."""
        return self.shapes.fragmentation_of(model, gpu_free, cpu_free)

    def score(self, pod: PodDemand, node: Node) -> Choice | None:
        if not fits(pod, node):
            return None
        before = self.measure(node.model, node.gpu_free, node.cpu_free, node.memory_free)
        cpu_after, memory_after = node.cpu_free - pod.cpu_milli, node.memory_free - pod.memory_mib
        if not pod.fractional:
            gpus = first_gpus(pod, node)
            after_free = list(node.gpu_free)
            for i in gpus:
                after_free[i] -= pod.gpu_milli
            return Choice(fgd_score(before, self.measure(node.model, after_free, cpu_after, memory_after)), gpus)
        best: Choice | None = None
        tried: set[int] = set()
        for i in fitting_gpus(pod, node):
            free = node.gpu_free[i]
            if free in tried:  # same free milli: the same outcome as a lower-index GPU
                continue
            tried.add(free)
            after_free = list(node.gpu_free)
            after_free[i] = free - pod.gpu_milli
            score = fgd_score(before, self.measure(node.model, after_free, cpu_after, memory_after))
            if best is None or score > best.score:
                best = Choice(score, (i,))
        return best


CPU_ONLY_SCALE = 1 << 20  # cpu_only_score: above any node's idle GPU milli
STRANDING_HEADROOM = 0.8  # count CPU (memory) as short only below 80 % of what the pods ask per milli-GPU


class FgdStrandPolicy(FgdPolicy):
    """FGD that also counts stranded GPUs: idle GPU milli that the node's free CPU (memory) cannot feed.

    The paper's fragmentation sees CPU only as "this shape runs here or not". A node whose CPU or memory
    runs out first strands its idle GPUs for every shape at once, and which node a CPU-only or CPU-heavy pod
    lands on decides that. Stranded milli = max(0, idle milli - free CPU / (0.8 x CPU per milli-GPU the
    pods ask)), the same for memory; it is added to the fragmentation the policy descends.
    """

    name = "fgdstrand"

    def __init__(self, shapes: TaskShapes) -> None:
        super().__init__(shapes)
        self.cpu_need = (shapes.cpu_per_gpu_milli or 0) * STRANDING_HEADROOM
        self.memory_need = (shapes.memory_per_gpu_milli or 0) * STRANDING_HEADROOM

    def stranded(self, gpu_free: list[int], cpu_free: int, memory_free: int) -> float:
        """Idle GPU milli that the free CPU, and the free memory, cannot feed (the two summed)."""
        idle = sum(gpu_free)
        out = 0.0
        if self.cpu_need:
            out += max(0.0, idle - cpu_free / self.cpu_need)
        if self.memory_need:
            out += max(0.0, idle - memory_free / self.memory_need)
        return out

    def measure(self, model: str, gpu_free: list[int], cpu_free: int, memory_free: int) -> float:
        return self.shapes.fragmentation_of(model, gpu_free, cpu_free) + self.stranded(gpu_free, cpu_free, memory_free)

    def strand_score(self, pod: PodDemand, node: Node) -> int | None:
        """A CPU-only pod's score: MAX_SCORE where it strands no more idle GPU milli, less by the milli it strands
        (at least 1); None where it does not fit. Neutral where nothing is stranded, so it only steers away."""
        if not fits(pod, node):
            return None
        before = self.stranded(node.gpu_free, node.cpu_free, node.memory_free)
        after = self.stranded(node.gpu_free, node.cpu_free - pod.cpu_milli, node.memory_free - pod.memory_mib)
        return max(1, MAX_SCORE - math.ceil(max(0.0, after - before) * MAX_SCORE / MILLI / max(1, len(node.gpu_free))))

    def cpu_only_score(self, pod: PodDemand, node: Node) -> int | None:
        """A CPU-only pod's score, higher is better, on a scale of its own (ranked, never added to others): first
        `strand_score`, then fewer idle GPU milli on the node. So the pod takes CPU and memory where they feed the
        fewest idle GPUs (a node without GPUs or with all in use first), rather than spread over the nodes a large
        GPU pod will need whole. None where it does not fit."""
        strand = self.strand_score(pod, node)
        if strand is None:
            return None
        return strand * CPU_ONLY_SCALE - min(node.gpu_free_total, CPU_ONLY_SCALE - 1)


class BinpackPolicy:
    """The node plugin's binpack across nodes: the node left fullest (GPU, or CPU for CPU-only pods), the fullest GPU
    that fits."""

    name = "binpack"
    deterministic = True

    def score(self, pod: PodDemand, node: Node) -> Choice | None:
        if not fits(pod, node):
            return None
        return Choice(_used_after_percent(pod, node), best_fit_gpus(pod, node))


class SpreadPolicy:
    """The node plugin's spread across nodes: the node left emptiest, the emptiest GPU that fits."""

    name = "spread"
    deterministic = True

    def score(self, pod: PodDemand, node: Node) -> Choice | None:
        if not fits(pod, node):
            return None
        return Choice(MAX_SCORE - _used_after_percent(pod, node), worst_fit_gpus(pod, node))


def _used_after_percent(pod: PodDemand, node: Node) -> int:
    if pod.num_gpu:
        capacity = MILLI * len(node.gpu_free)
        return _clamp(MAX_SCORE * (capacity - node.gpu_free_total + pod.gpu_request) / capacity)
    if node.cpu_milli == 0:
        return MAX_SCORE
    return _clamp(MAX_SCORE * (node.cpu_milli - node.cpu_free + pod.cpu_milli) / node.cpu_milli)


POLICIES = ("random", "bestfit", "dotproduct", "gpupacking", "fgd", "fgdstrand", "binpack", "spread")
NEEDS_SHAPES = frozenset({"fgd", "fgdstrand"})


def share_unit(policy: str, free: list[int], replicas: int, wanted: int) -> int | None:
    """The unit a node plugin with `allocationPolicy: <cluster policy>` gives `wanted` shares: each of its units
    a GPU of `replicas` shares, `free[i]` of them free; the share shapes 1..replicas equally popular. None: no room.

    The node plugin's GetPreferredAllocation and the scheduler extender's assumption both call this.
    """
    node = Node("", 0, 0, "", [f * MILLI // replicas for f in free])
    choice = make_policy(policy, shapes=share_shapes(replicas)).score(
        PodDemand(0, 0, 1, wanted * MILLI // replicas), node
    )
    return choice.gpus[0] if choice else None


def make_policy(name: str, shapes: TaskShapes | None = None, rng: random.Random | None = None) -> Policy:
    """The policy called `name` (one of POLICIES). `shapes` is required by those in NEEDS_SHAPES; `rng` seeds random."""
    if name in NEEDS_SHAPES and shapes is None:
        raise ValueError(f"policy {name} needs the task-shape distribution (TaskShapes)")
    if name == "random":
        return RandomPolicy(rng)
    if name in ("fgd", "fgdstrand"):
        assert shapes is not None
        return FgdPolicy(shapes) if name == "fgd" else FgdStrandPolicy(shapes)
    simple: dict[str, type] = {
        "bestfit": BestFitPolicy,
        "dotproduct": DotProductPolicy,
        "gpupacking": GpuPackingPolicy,
        "binpack": BinpackPolicy,
        "spread": SpreadPolicy,
    }
    if name not in simple:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return simple[name]()

"""The FGD paper's packing experiment on the cluster model.

Per seed: shuffle the pod list; inflate it to `inflate` x the GPU capacity (drop random pods while the
summed request exceeds it, or append pods resampled from the list until the next one's per-GPU milli
would pass it); shuffle the node order once. Pods arrive one at a time and never leave; each goes to the
node with the highest policy score, ties to the first node in that order; a pod that fits nowhere fails
and is not retried. The KPI is the GPU allocation ratio (allocated milli / capacity), averaged over the
arrivals whose rounded arrived demand is round(100 x inflate) % of capacity.

Scores are cached per pod shape and node; a placement invalidates only the node it changed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from math import ceil
from multiprocessing import get_context

from .capacity import FINEST_SPLIT, MILLI, Node, PodDemand, fits, place
from .policies import NEEDS_SHAPES, make_policy
from .shapes import TaskShapes

DEFAULT_INFLATE = 1.3
_SHAPE_CACHE = 4096  # pod shapes whose per-node scores are kept


@dataclass(frozen=True)
class RunResult:
    policy: str
    seed: int
    allocation: float  # GPU allocation ratio (0-1) at the target demand
    failed_pods: int
    arrived_pods: int
    gpus: int
    seconds: float
    curve: tuple[float, ...] = field(
        repr=False
    )  # allocation ratio after the last arrival within each integer % of demand
    placements: tuple[tuple[str, str | None, tuple[int, ...]], ...] = field(
        repr=False, default=()
    )  # (pod, node or None, GPUs)

    @property
    def unallocated_gpus(self) -> float:
        return self.gpus * (1 - self.allocation)


def share_rounded(pod: PodDemand, replicas: int | None) -> PodDemand:
    """A fractional request rounded up to whole shares of 1/`replicas` GPU (floor of the share's milli)."""
    if not replicas or not pod.fractional:
        return pod
    shares = ceil(pod.gpu_milli * replicas / MILLI)
    return PodDemand(pod.cpu_milli, pod.memory_mib, pod.num_gpu, shares * MILLI // replicas, pod.gpu_models, pod.name)


def arrivals(pods: Sequence[PodDemand], capacity_milli: int, inflate: float, rng: random.Random) -> list[PodDemand]:
    """The shuffled pod list inflated (or cut) to `inflate` x capacity, as the paper's experiment does."""
    order = list(pods)
    rng.shuffle(order)
    target = inflate * capacity_milli
    total = sum(p.gpu_request for p in order)
    if total > target:
        while total > target and order:
            total -= order.pop(rng.randrange(len(order))).gpu_request
        return order
    while True:
        pod = rng.choice(pods)
        if total + pod.gpu_milli > target:  # the per-GPU milli, so a multi-GPU pod may overshoot a little
            return order
        order.append(pod)
        total += pod.gpu_request


def node_order(count: int, rng: random.Random) -> list[int]:
    """The per-run node order that breaks ties (drawn after the arrivals, from the same generator)."""
    order = list(range(count))
    rng.shuffle(order)
    return order


class Experiment:
    """One cluster and pod list; `run(policy, seed)` simulates one arrival sequence."""

    def __init__(
        self,
        nodes: Sequence[Node],
        pods: Sequence[PodDemand],
        inflate: float = DEFAULT_INFLATE,
        replicas: int | None = None,
    ) -> None:
        if not nodes or not pods:
            raise ValueError("simulate: need at least one node and one pod")
        if not 0 < inflate <= 100:
            raise ValueError(f"simulate: inflate must be in (0, 100], got {inflate}")
        if replicas is not None and not 1 <= replicas <= FINEST_SPLIT:
            raise ValueError(f"simulate: replicas must be 1-{FINEST_SPLIT}, got {replicas}")
        self.nodes = tuple(nodes)
        self.pods = tuple(pods)
        self.inflate = inflate
        self.replicas = replicas
        self.gpus = sum(len(n.gpu_free) for n in nodes)
        if self.gpus == 0:
            raise ValueError("simulate: the nodes have no GPUs")
        # What the scheduler sees: requests rounded to shares; shapes learned from the original list.
        self.scheduled = {p: share_rounded(p, replicas) for p in self.pods}
        self.shapes = TaskShapes.from_pods([self.scheduled[p] for p in self.pods])

    def run(self, policy_name: str, seed: int) -> RunResult:
        started = time.perf_counter()
        rng = random.Random(seed)
        capacity = MILLI * self.gpus
        pods = arrivals(self.pods, capacity, self.inflate, rng)
        nodes = [self.nodes[i].copy() for i in node_order(len(self.nodes), rng)]
        policy = make_policy(policy_name, self.shapes if policy_name in NEEDS_SHAPES else None, random.Random(seed + 1))
        scorer: Callable[[PodDemand, Node], tuple[int, tuple[int, ...]] | None]
        scorer = policy.score if policy.deterministic else (lambda pod, node: (0, ()) if fits(pod, node) else None)
        cache: dict[PodDemand, list] = {}  # pod shape -> [scores, gpus, len(changed) when fresh]
        changed: list[int] = []  # node index of every placement so far
        target = int(100 * self.inflate + 0.5)
        arrived = allocated = failed = 0
        at_target: list[int] = []
        curve: dict[int, int] = {}
        placements: list[tuple[str, str | None, tuple[int, ...]]] = []
        for pod in pods:
            want = self.scheduled.get(pod) or share_rounded(pod, self.replicas)
            entry = cache.get(want)
            if entry is None:
                if len(cache) >= _SHAPE_CACHE:
                    del cache[next(iter(cache))]
                entry = cache[want] = [[-1] * len(nodes), [()] * len(nodes), 0]
                stale: Iterable[int] = range(len(nodes))
            elif len(changed) - entry[2] >= len(nodes):
                stale = range(len(nodes))
            else:
                stale = set(changed[entry[2] :])
            scores, gpus = entry[0], entry[1]
            for i in stale:
                choice = scorer(want, nodes[i])
                scores[i], gpus[i] = (-1, ()) if choice is None else choice
            entry[2] = len(changed)
            top = max(scores)
            if top < 0:
                failed += 1
                placements.append((pod.name, None, ()))
            else:
                if policy.deterministic:
                    i = scores.index(top)
                    chosen = gpus[i]
                else:
                    i = policy.rng.choice([j for j, s in enumerate(scores) if s >= 0])  # type: ignore[attr-defined]
                    chosen = policy.score(want, nodes[i]).gpus  # type: ignore[union-attr]
                place(want, nodes[i], chosen)
                changed.append(i)
                allocated += pod.gpu_request
                placements.append((pod.name, nodes[i].name, chosen))
            arrived += pod.gpu_request
            percent = int(100 * arrived / capacity + 0.5)
            curve[percent] = allocated
            if percent == target:
                at_target.append(allocated)
        allocation = (sum(at_target) / len(at_target) if at_target else allocated) / capacity
        points = tuple(curve.get(p, 0) / capacity for p in range(max(curve) + 1))
        points = tuple(max(points[: k + 1]) for k in range(len(points)))  # demand levels skipped by a large pod
        return RunResult(
            policy_name,
            seed,
            allocation,
            failed,
            len(pods),
            self.gpus,
            time.perf_counter() - started,
            points,
            tuple(placements),
        )


_worker: Experiment | None = None


def _init_worker(experiment: Experiment) -> None:
    global _worker
    _worker = experiment


def _run_in_worker(policy: str, seed: int) -> RunResult:
    assert _worker is not None
    return _worker.run(policy, seed)


def run_all(
    experiment: Experiment,
    policies: Sequence[str],
    seeds: Sequence[int],
    jobs: int = 1,
    on_result: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Every (policy, seed) run, `jobs` at a time in worker processes; results in (policy, seed) order."""
    tasks = [(p, s) for p in policies for s in seeds]
    results: list[RunResult] = []
    if jobs <= 1 or len(tasks) == 1:
        for policy, seed in tasks:
            results.append(experiment.run(policy, seed))
            if on_result:
                on_result(results[-1])
        return results
    with ProcessPoolExecutor(
        max_workers=min(jobs, len(tasks)),
        mp_context=get_context("spawn"),
        initializer=_init_worker,
        initargs=(experiment,),
    ) as pool:
        futures = [pool.submit(_run_in_worker, p, s) for p, s in tasks]
        for future in as_completed(futures):
            results.append(future.result())
            if on_result:
                on_result(results[-1])
    rank = {t: k for k, t in enumerate(tasks)}
    return sorted(results, key=lambda r: rank[(r.policy, r.seed)])

"""Cluster packing: a pure model of GPU nodes and pods, and the placement policies that score them.

No gRPC, protobuf or Kubernetes imports: the scheduler extender, the node plugin and the simulator all
call this code.

Public API (stable):

- `PodDemand(cpu_milli, memory_mib, num_gpu=0, gpu_milli=0, gpu_models=frozenset(), name="")`: a request;
  `gpu_milli` is per GPU (1000 = a whole GPU), a fractional request is for one GPU.
- `Node(name, cpu_milli, memory_mib, model, gpu_free, cpu_free=-1, memory_free=-1, max_pods=110, pods=0)`:
  one node's capacity and what is free now (`gpu_free[i]`: GPU i's free milli; -1: all free).
- `fits(pod, node)`, `place(pod, node, gpus)`.
- `TaskShapes.from_pods(pods)`: the popular task shapes (95 % of pods), and what pods ask per milli-GPU,
  that the policies in `NEEDS_SHAPES` (fgd, fgdstrand) need; `TaskShapes.shares(n)` inside one node, where
  only share counts are known (every k of n shares equally popular).
- `make_policy(name, shapes=None, rng=None)` for a name in `POLICIES`; then
  `policy.score(pod, node) -> Choice(score, gpus) | None`: an integer score 0-100 (higher is better; a
  scheduler takes the highest, ties to the first node in its order) and the GPU indices the pod takes on
  that node, or None when it does not fit.
"""

from .capacity import DEFAULT_MAX_PODS, MILLI, Node, PodDemand, fits, place
from .policies import NEEDS_SHAPES, POLICIES, Choice, Policy, make_policy
from .shapes import Shape, TaskShapes

__all__ = [
    "DEFAULT_MAX_PODS",
    "MILLI",
    "NEEDS_SHAPES",
    "POLICIES",
    "Choice",
    "Node",
    "PodDemand",
    "Policy",
    "Shape",
    "TaskShapes",
    "fits",
    "make_policy",
    "place",
]

"""The cluster model's capacity: nodes and what is free on them, what pods demand, and the fit rule.

GPU capacity is counted in milli-GPUs: 1000 is one whole GPU. A pod asks for `num_gpu` GPUs with
`gpu_milli` free on each; a fractional request (`gpu_milli` < 1000) lands on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MILLI = 1000
FINEST_SPLIT = (
    MILLI  # the most shares one GPU splits into in this model (a share is at least one milli-GPU): --replicas' bound
)
DEFAULT_MAX_PODS = 110  # the kubelet's default pod limit per node


@dataclass(frozen=True, slots=True)
class PodDemand:
    """What a pod requests. `gpu_models` empty: any GPU model; else the models it accepts."""

    cpu_milli: int
    memory_mib: int
    num_gpu: int = 0
    gpu_milli: int = 0
    gpu_models: frozenset[str] = frozenset()
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for key in ("cpu_milli", "memory_mib", "num_gpu", "gpu_milli"):
            if getattr(self, key) < 0:
                raise ValueError(f"pod {self.name or '?'}: {key} must be >= 0, got {getattr(self, key)}")
        if self.gpu_milli > MILLI:
            raise ValueError(f"pod {self.name or '?'}: gpu_milli is per GPU, at most {MILLI}, got {self.gpu_milli}")
        if (self.num_gpu == 0) != (self.gpu_milli == 0):
            raise ValueError(
                f"pod {self.name or '?'}: num_gpu and gpu_milli must both be 0 or both > 0, got {self.num_gpu} "
                f"and {self.gpu_milli}"
            )
        if self.gpu_milli < MILLI and self.num_gpu > 1:
            raise ValueError(
                f"pod {self.name or '?'}: a fractional request (gpu_milli {self.gpu_milli}) is for one GPU, got "
                f"num_gpu {self.num_gpu}"
            )

    @property
    def gpu_request(self) -> int:
        """Total milli-GPUs requested."""
        return self.num_gpu * self.gpu_milli

    @property
    def fractional(self) -> bool:
        return 0 < self.gpu_milli < MILLI

    def accepts(self, model: str) -> bool:
        return not self.gpu_models or model in self.gpu_models


@dataclass(slots=True)
class Node:
    """A node and what is still free on it; `gpu_free[i]` is GPU i's free milli."""

    name: str
    cpu_milli: int
    memory_mib: int
    model: str
    gpu_free: list[int]
    cpu_free: int = -1  # -1: the whole capacity
    memory_free: int = -1
    max_pods: int = DEFAULT_MAX_PODS
    pods: int = 0

    def __post_init__(self) -> None:
        if self.cpu_free < 0:
            self.cpu_free = self.cpu_milli
        if self.memory_free < 0:
            self.memory_free = self.memory_mib
        if any(not 0 <= f <= MILLI for f in self.gpu_free):
            raise ValueError(f"node {self.name}: free milli per GPU must be 0-{MILLI}, got {self.gpu_free}")

    @classmethod
    def empty(
        cls, name: str, cpu_milli: int, memory_mib: int, gpus: int, model: str = "", max_pods: int = DEFAULT_MAX_PODS
    ) -> Node:
        return cls(name, cpu_milli, memory_mib, model, [MILLI] * gpus, max_pods=max_pods)

    @property
    def gpu_free_total(self) -> int:
        return sum(self.gpu_free)

    def copy(self) -> Node:
        return Node(
            self.name,
            self.cpu_milli,
            self.memory_mib,
            self.model,
            list(self.gpu_free),
            self.cpu_free,
            self.memory_free,
            self.max_pods,
            self.pods,
        )


def host_fits(pod: PodDemand, node: Node) -> bool:
    """CPU, memory and a pod slot: all a CPU-only pod needs."""
    return node.cpu_free >= pod.cpu_milli and node.memory_free >= pod.memory_mib and node.pods < node.max_pods


def fits(pod: PodDemand, node: Node) -> bool:
    """CPU, memory, a pod slot, an accepted GPU model and `num_gpu` GPUs each with `gpu_milli` free."""
    if not host_fits(pod, node):
        return False
    if pod.num_gpu == 0:
        return True
    if not pod.accepts(node.model):
        return False
    need = pod.gpu_milli
    return sum(1 for f in node.gpu_free if f >= need) >= pod.num_gpu


def fitting_gpus(pod: PodDemand, node: Node) -> list[int]:
    """Indices of the GPUs with room for one of the pod's per-GPU requests."""
    return [i for i, f in enumerate(node.gpu_free) if f >= pod.gpu_milli]


def first_gpus(pod: PodDemand, node: Node) -> tuple[int, ...]:
    """Multi-GPU and whole-GPU requests: the first GPUs by index with room (fully free ones for whole GPUs)."""
    return tuple(fitting_gpus(pod, node)[: pod.num_gpu])


def place(pod: PodDemand, node: Node, gpus: tuple[int, ...]) -> None:
    """Take the pod's resources on `node`, its per-GPU request on each of `gpus`."""
    if len(gpus) != pod.num_gpu:
        raise ValueError(f"pod {pod.name}: needs {pod.num_gpu} GPUs, given {len(gpus)}")
    if not fits(pod, node) or any(node.gpu_free[i] < pod.gpu_milli for i in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"pod {pod.name} does not fit node {node.name} on GPUs {gpus}")
    node.cpu_free -= pod.cpu_milli
    node.memory_free -= pod.memory_mib
    node.pods += 1
    for i in gpus:
        node.gpu_free[i] -= pod.gpu_milli

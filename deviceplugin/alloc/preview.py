"""What a container of each resource receives, as `config check --node` previews it: the grant Allocate would give
(the same `unit_grant`) for one device of the first unit, and what of it is enforced."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.types import WatchdogPolicy
from ..model.devices import Resource
from ..model.shares import share_compute_percent, share_memory_mib
from .container import unit_grant


@dataclass(frozen=True)
class ContainerPreview:
    what: str  # "1 share of GPU 0 (Tesla T4)", "MIG 1g.10gb of GPU 0", "GPU 0 (Tesla T4)"
    envs: dict[str, str]
    memory_mib: int
    compute_percent: int
    enforced: str  # how memory and compute are held to those numbers, or that they are not


def container_preview(resource: Resource, watchdog_policy: WatchdogPolicy) -> ContainerPreview:
    """One device (a share, a MIG instance or a whole GPU) of the resource's first unit."""
    unit = resource.units[0]
    pool = resource.pool
    grant = unit_grant(resource, [(unit, 1)])
    where = f"GPU {unit.gpu.index} ({unit.gpu.model})" if unit.mig is None else f"MIG {unit.mig.profile} of GPU {unit.gpu.index}"
    if not pool.shared:
        enforced = "isolated by the hardware (MIG)" if unit.mig else "the whole GPU, no neighbours"
        return ContainerPreview(where, dict(grant.envs), unit.memory_mib, 100, enforced)
    memory, compute = share_memory_mib(unit), share_compute_percent(unit)
    if not pool.mps:
        watchdog = "reports" if watchdog_policy == "report" else "kills"
        enforced = (f"not enforced: compute is time-sliced (turns, not a cap); memory is not capped by the GPU, the memory "
                    f"watchdog {watchdog} a container over it")
    elif pool.mps_limits == "strict":
        enforced = (f"enforced by the MPS daemon for every client (its defaults: active threads {compute} %, pinned memory "
                    f"{memory} MiB per GPU); one share per container")
    else:
        enforced = "enforced by MPS from the container's CUDA_MPS_* limits (k shares: k times both)"
    return ContainerPreview(f"1 share of {where}", dict(grant.envs), memory, compute, enforced)

"""What a container of each resource receives, as `config check --node` previews it: the grant Allocate would give
(the same `unit_grant`) for one device of the first unit, and what of it is enforced."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.types import WatchdogPolicy
from ..model.devices import Resource
from ..model.shares import share_compute_percent, share_memory_mib
from .allocator import unit_grant
from .modes import mode_of


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
    where = (
        f"GPU {unit.gpu.index} ({unit.gpu.model})"
        if unit.mig is None
        else f"MIG {unit.mig.profile} of GPU {unit.gpu.index}"
    )
    what = f"1 share of {where}" if pool.shared else where
    enforced = mode_of(pool).enforcement(pool, unit, watchdog_policy)
    return ContainerPreview(what, dict(grant.envs), share_memory_mib(unit), share_compute_percent(unit), enforced)

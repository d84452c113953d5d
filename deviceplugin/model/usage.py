"""Who holds which device, as plain data: the usage map the agent rebuilds from pod-resources every round."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ContainerShare:
    """One container's devices of one resource on one GPU or MIG instance."""

    namespace: str
    pod: str
    container: str
    resource: str
    pool: str
    unit_uuid: str  # GPU or MIG UUID
    gpu_uuid: str
    devices: tuple[str, ...]
    shares: int  # devices held (1 per whole GPU or MIG instance)
    memory_limit_mib: int
    time_sliced: bool  # a shared pool without MPS: memory is not enforced, the watchdog watches it

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.namespace, self.pod, self.container)


@dataclass(frozen=True)
class Usage:
    """The node's usage map, as of one pod-resources List."""

    shares: tuple[ContainerShare, ...] = ()
    active_containers: frozenset[tuple[str, str, str]] = frozenset()  # every container of every active pod

    def allocated(self) -> frozenset[str]:
        return frozenset(d for s in self.shares for d in s.devices)

"""Who holds which device, as plain data: the usage map the agent rebuilds from pod-resources every round, and the
holds that pin a GPU's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from .devices import SHARE_SEPARATOR


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


@dataclass(frozen=True)
class Hold:
    """One device something on the node holds, with the shape it was granted in: a container (pod-resources, the
    kubelet's checkpoint) or any other holder (a prepared DRA claim). While a GPU has a hold, its shape is pinned:
    a reload that would change it waits until the hold is gone (alloc.pending)."""

    resource: str  # the extended resource (or driver) the device was granted under
    device: str  # its device ID: a GPU or MIG UUID, or `<uuid>::<k>`
    replicas: int | None = None  # shares of its unit when granted (1: a whole unit); None: not known from this source
    holder: str = field(default="", compare=False)  # who, for log lines: `namespace/pod/container`
    pod_uid: str = field(default="", compare=False)  # the holding pod's UID where the source names it (the checkpoint)

    @property
    def unit_uuid(self) -> str:
        """The GPU or MIG UUID the device is on."""
        return self.device.split(SHARE_SEPARATOR, 1)[0]

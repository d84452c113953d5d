"""What a GPU node has: the inventory interface every discovery backend implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class InventoryError(RuntimeError):
    """A backend could not describe the node (bad node file, driver failure)."""


@dataclass(frozen=True)
class Gpu:
    """One physical GPU as discovery reports it."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    numa_node: int | None = None  # None: the platform reports no NUMA affinity
    pci_bus_id: str = ""
    compute_capability: str = ""


@dataclass(frozen=True)
class NodeInfo:
    """Everything discovery knows about the node."""

    gpus: tuple[Gpu, ...]
    driver_version: str = ""
    cuda_driver_version: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def gpu(self, uuid: str) -> Gpu:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise KeyError(uuid)


class Inventory(Protocol):
    """A discovery backend: the simulated node or real NVML."""

    def discover(self) -> NodeInfo:
        """Describe the node's GPUs now."""
        ...

    def close(self) -> None:
        """Release the backend (NVML shutdown); idempotent."""
        ...

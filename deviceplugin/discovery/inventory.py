"""The interface every discovery backend implements (the simulated node, real NVML)."""

from __future__ import annotations

from typing import Protocol

from ..model.node import GpuProcess, GpuStats, HealthEvent, NodeInfo


class InventoryError(RuntimeError):
    """A backend could not describe the node (bad node file, driver failure)."""


class Inventory(Protocol):
    """A discovery backend: the simulated node or real NVML."""

    def discover(self) -> NodeInfo:
        """Describe the node's GPUs now."""
        ...

    def wait_for_event(self, timeout: float) -> HealthEvent | None:
        """Block up to `timeout` seconds for a health event that is not filtered by the backend."""
        ...

    def check(self, gpu_uuid: str) -> str | None:
        """None when a basic query on the GPU succeeds, else why it failed."""
        ...

    def reset_required(self, gpu_uuid: str) -> bool | None:
        """The driver's word on whether the GPU needs a reset now (NVML's GPU recovery action); None: cannot tell."""
        ...

    def stats(self, gpu_uuid: str) -> GpuStats:
        """Memory used, utilisation, temperature and power now (fields None when unknown)."""
        ...

    def processes(self, gpu_uuid: str) -> list[GpuProcess] | None:
        """Compute (and MPS client) processes on the GPU with their memory; None when they cannot be read (unknown:
        callers keep what they knew or treat the GPU as busy)."""
        ...

    def close(self) -> None:
        """Release the backend (NVML shutdown); idempotent."""
        ...

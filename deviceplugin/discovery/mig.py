"""Making and destroying MIG instances: the calls both backends (real NVML, the simulated node) answer alike.

The errors carry NVML's return codes, so a caller tells "that placement is taken" (INSUFFICIENT_RESOURCES) from
"processes or compute instances still use it" (IN_USE) from "MIG mode is off" (NOT_SUPPORTED) the same way on both.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..model.mig import MigInstance, MigProfile
from .inventory import InventoryError

# NVML's return codes (nvml.h; tests check them against pynvml's NVML_ERROR_* constants).
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NOT_FOUND = 6
GPU_IS_LOST = 15
IN_USE = 19
INSUFFICIENT_RESOURCES = 23
CODE_NAMES = {
    INVALID_ARGUMENT: "INVALID_ARGUMENT",
    NOT_SUPPORTED: "NOT_SUPPORTED",
    NOT_FOUND: "NOT_FOUND",
    GPU_IS_LOST: "GPU_IS_LOST",
    IN_USE: "IN_USE",
    INSUFFICIENT_RESOURCES: "INSUFFICIENT_RESOURCES",
}
MAX_GPU_INSTANCES = 32  # GPU-instance IDs tried when listing (NVML gives small IDs: at most 7 instances, IDs below 16)
MAX_COMPUTE_INSTANCES = 8  # compute-instance IDs tried per GPU instance
MAX_PLACEMENTS = 16  # placements read per profile (a GPU has 8 memory slices)


class MigError(InventoryError):
    """A MIG call failed; `code` is NVML's return code (0 when the failure was not NVML's)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code

    @property
    def code_name(self) -> str:
        return CODE_NAMES.get(self.code, f"NVML error {self.code}" if self.code else "error")


@runtime_checkable
class MigControl(Protocol):
    """MIG instance management on one node's GPUs, by GPU UUID."""

    def mig_profiles(self, gpu_uuid: str) -> tuple[MigProfile, ...]:
        """The GPU's GPU-instance profiles with their possible placements; MigError NOT_SUPPORTED when MIG is off."""
        ...

    def mig_instances(self, gpu_uuid: str) -> tuple[MigInstance, ...]:
        """The GPU instances on the GPU now, each with its compute instance (if any) and MIG UUID."""
        ...

    def create_gpu_instance(self, gpu_uuid: str, profile_id: int, start: int) -> int:
        """A GPU instance of the profile at the placement starting at `start`; its ID. INSUFFICIENT_RESOURCES when
        the placement overlaps an instance (or the profile's instances or engines are used up)."""
        ...

    def create_compute_instance(self, gpu_uuid: str, gi_id: int) -> MigInstance:
        """One compute instance taking the whole GPU instance; the instance with its MIG UUID."""
        ...

    def destroy_compute_instance(self, gpu_uuid: str, gi_id: int, ci_id: int) -> None:
        """IN_USE while processes run on it; NOT_FOUND when it is gone."""
        ...

    def destroy_gpu_instance(self, gpu_uuid: str, gi_id: int) -> None:
        """IN_USE while it has compute instances or processes; NOT_FOUND when it is gone."""
        ...

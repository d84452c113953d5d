"""MIG as NVML describes it: the GPU-instance profiles a GPU offers, where each may be placed, and the instances made.

Plain data read from the discovery backend at run time (NVML's profile and placement queries, or the simulated
node's answers to the same queries): nothing here knows a GPU model. docs/nvml.md#dynamic-mig has the calls.
"""

from __future__ import annotations

from dataclasses import dataclass

# The engines a GPU-instance profile reports (nvmlGpuInstanceProfileInfo_t), by the counter name DRA publishes.
ENGINES = ("copy-engines", "decoders", "encoders", "jpeg-engines", "ofa-engines")


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of one GPU (nvmlDeviceGetGpuInstanceProfileInfo and its possible placements)."""

    id: int  # NVML's profile ID (info.id), what creation takes
    name: str  # "1g.10gb", "1g.10gb+me" (the info's name without its "MIG " prefix)
    compute_slices: int  # info.sliceCount
    memory_slices: int  # the placements' size: memory slices one instance takes
    memory_mib: int  # info.memorySizeMB
    instance_count: int  # info.instanceCount: the most instances of this profile on the GPU
    placements: tuple[
        int, ...
    ]  # start memory slices an instance may take (nvmlDeviceGetGpuInstancePossiblePlacements_v2)
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0

    def engines(self) -> dict[str, int]:
        """Engine counts by counter name (ENGINES)."""
        values = (self.copy_engines, self.decoders, self.encoders, self.jpeg_engines, self.ofa_engines)
        return dict(zip(ENGINES, values, strict=True))

    def slices(self, start: int) -> range:
        """The memory slices an instance placed at `start` takes."""
        return range(start, start + self.memory_slices)


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance on a GPU, with its compute instance when it has one (nvmlGpuInstanceGetInfo and friends)."""

    gi_id: int
    profile_id: int
    start: int  # the placement's first memory slice
    size: int  # memory slices
    ci_id: int | None = None  # None: a GPU instance without a compute instance (a creation cut short)
    uuid: str = ""  # the MIG device's UUID; "" without a compute instance


def full_profile(profiles: tuple[MigProfile, ...]) -> MigProfile | None:
    """The profile that takes the whole GPU (most memory slices, then most compute slices): its figures are the
    GPU's."""
    return max(profiles, key=lambda p: (p.memory_slices, p.compute_slices), default=None)

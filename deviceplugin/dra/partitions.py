"""Dynamic MIG as DRA partitionable devices (DRAPartitionableDevices, beta and on in Kubernetes 1.36).

A MIG-enabled GPU of a `strategy: dynamic` pool is published as one counter set and one device per GPU-instance
profile and placement. Everything comes from the GPU's profiles as NVML answers them (`Gpu.mig_profiles`):

- the counter set `gpu-<index>-mig` holds one counter per memory slice (`memory-slice-<i>`, value 1), the GPU's
  `compute-slices`, its MIG `memory` (bytes) and each engine a profile has (`copy-engines`, `decoders`,
  `encoders`, `jpeg-engines`, `ofa-engines`), the totals being the whole-GPU profile's (the largest count);
- the device `gpu-<index>-mig-<profile>-<start>` (`1g.10gb+me` at 3: `gpu-0-mig-1g-10gb-me-3`) consumes the memory
  slices its placement takes, its compute slices, memory and engines.

So the scheduler can only allocate devices whose placements do not overlap and whose engines add up, the rules NVML
applies when the instance is created; a claim that no longer fits stays unschedulable instead of failing at
prepare. The counters live in slices of their own (the API allows a slice devices or counters, never both; at most
8 counter sets of at most 32 counters each per slice).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..model.mig import MigProfile, full_profile
from ..model.node import MIB, Gpu

log = logging.getLogger(__name__)

MAX_COUNTER_SETS_PER_SLICE = 8
MAX_COUNTERS_PER_SET = 32
COMPUTE_SLICES = "compute-slices"
MEMORY = "memory"


def memory_slice(i: int) -> str:
    return f"memory-slice-{i}"


@dataclass(frozen=True)
class Partition:
    """One placement of one MIG profile on one GPU: what a dynamic-MIG device stands for."""

    gpu: Gpu
    profile: MigProfile
    start: int

    @property
    def counter_set(self) -> str:
        return counter_set_name(self.gpu)

    def consumes(self) -> dict[str, int]:
        """The counters an instance here takes from its GPU's set."""
        used = {memory_slice(i): 1 for i in self.profile.slices(self.start)}
        used[COMPUTE_SLICES] = self.profile.compute_slices
        used[MEMORY] = self.profile.memory_mib * MIB
        used.update({k: v for k, v in self.profile.engines().items() if v and k in gpu_counters(self.gpu)})
        return used


def counter_set_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.index}-mig"


def device_name(partition: Partition) -> str:
    """A DNS label: `gpu-<index>-mig-<profile with . and + as ->-<start>`."""
    profile = partition.profile.name.replace(".", "-").replace("+", "-").lower()
    return f"gpu-{partition.gpu.index}-mig-{profile}-{partition.start}"


def gpu_counters(gpu: Gpu, kept: Sequence[tuple[int, int]] = ()) -> dict[str, int]:
    """The GPU's counters (empty when it has no profiles); see the module docstring. `kept`: (profile ID, start) of
    instances that stay on the GPU without a claim: what they take is published as taken (those counters lowered, a
    memory slice to 0), so no device overlapping them is allocated."""
    whole = full_profile(gpu.mig_profiles)
    if whole is None:
        return {}
    counters = {memory_slice(i): 1 for i in range(whole.memory_slices)}
    counters[COMPUTE_SLICES] = whole.compute_slices
    counters[MEMORY] = whole.memory_mib * MIB
    for engine in whole.engines():
        most = max(p.engines()[engine] for p in gpu.mig_profiles)
        if most:
            counters[engine] = most
    by_id = {p.id: p for p in gpu.mig_profiles}
    for profile_id, start in kept:
        if profile_id in by_id:
            taken = Partition(gpu=gpu, profile=by_id[profile_id], start=start)
            for name, value in taken.consumes().items():
                if name in counters:
                    counters[name] = max(0, counters[name] - value)
    return counters


def partitions(gpu: Gpu) -> list[Partition]:
    """Every profile x placement of the GPU, smaller profiles first and each profile's placements from the last
    slice down (the scheduler's first fit then leaves the low slices, which the large profiles need, free longest);
    none when the GPU's counters would exceed the API's limit."""
    counters = gpu_counters(gpu)
    if len(counters) > MAX_COUNTERS_PER_SET:
        log.error(
            "GPU %d (%s): its MIG profiles make %d counters, over the API's %d per set; no dynamic MIG on it",
            gpu.index,
            gpu.uuid,
            len(counters),
            MAX_COUNTERS_PER_SET,
        )
        return []
    found = []
    for profile in sorted(gpu.mig_profiles, key=lambda p: (p.memory_slices, p.compute_slices, p.name)):
        for start in sorted(profile.placements, reverse=True):
            if start + profile.memory_slices <= counters_slices(counters):
                found.append(Partition(gpu=gpu, profile=profile, start=start))
    return found


def counters_slices(counters: dict[str, int]) -> int:
    return sum(1 for name in counters if name.startswith("memory-slice-"))


def counter_sets(
    gpus: Sequence[Gpu], kept: Mapping[str, Sequence[tuple[int, int]]] | None = None
) -> list[dict[str, Any]]:
    """resource.k8s.io/v1 CounterSets of these GPUs, in index order; `kept`: GPU UUID -> instances of no claim that
    stay (`gpu_counters`)."""
    kept = kept or {}
    return [
        {
            "name": counter_set_name(g),
            "counters": {k: {"value": str(v)} for k, v in gpu_counters(g, kept.get(g.uuid, ())).items()},
        }
        for g in sorted(gpus, key=lambda g: g.index)
    ]

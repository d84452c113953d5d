"""MIG on a simulated GPU: NVIDIA's published profile and placement tables, and NVML's rules for instances.

The simulated node (`discovery.simulated`) and the tests' fake pynvml (`tests/support/fake_pynvml.py`) both answer
NVML's MIG queries and calls from here, so the driver is exercised against one model of MIG, the one NVML has:

- profiles and their possible placements per GPU model (A100 40GB and 80GB, H100 80GB, H200 141GB, B200), as the
  MIG user guide lists them (docs/nvml.md#dynamic-mig has the table); profiles answer only while MIG mode is on,
  placements always (as NVML's placement query does);
- creating a GPU instance: NOT_SUPPORTED with MIG mode off, INVALID_ARGUMENT for a start the profile may not take,
  INSUFFICIENT_RESOURCES when the placement overlaps an instance or the profile's instances or the GPU's engines are
  used up;
- destroying: IN_USE while a compute instance (for a GPU instance) or a process (for either) is on it, NOT_FOUND
  when it is gone.

IDs are the fake's own (the lowest free GPU-instance ID from 1, compute instance 0): like NVML's, they are not
to be predicted by a caller, which reads them back. Each compute instance gets a new MIG UUID.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..model.mig import MigInstance, MigProfile, full_profile
from ..model.node import MigDevice
from .mig import IN_USE, INSUFFICIENT_RESOURCES, INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED, MigError

# (profile ID, compute slices, memory slices, instances, placements): the same on every model below.
_SHAPES = {
    19: (1, 1, 7, (0, 1, 2, 3, 4, 5, 6)),  # 1g, one memory slice
    20: (1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),  # 1g+me: one memory slice with the media engines
    15: (1, 2, 4, (0, 2, 4, 6)),  # 1g, two memory slices
    14: (2, 2, 3, (0, 2, 4)),
    9: (3, 4, 2, (0, 4)),
    5: (4, 4, 1, (0,)),
    0: (7, 8, 1, (0,)),
}
# Engines per profile ID: (copy engines, decoders, JPEG, OFA); no profile of these GPUs has an encoder.
_AMPERE_ENGINES = {
    19: (1, 0, 0, 0),
    20: (1, 1, 1, 1),
    15: (1, 1, 0, 0),
    14: (2, 1, 0, 0),
    9: (3, 2, 0, 0),
    5: (4, 2, 0, 0),
    0: (7, 5, 1, 1),
}
_HOPPER_ENGINES = {
    19: (1, 1, 1, 0),
    20: (1, 1, 1, 1),
    15: (1, 1, 1, 0),
    14: (2, 2, 2, 0),
    9: (3, 3, 3, 0),
    5: (4, 4, 4, 0),
    0: (8, 7, 7, 1),
}
# Per model: profile ID -> (name, memory MiB as the fake reports it).
_MODELS: dict[str, tuple[dict[int, tuple[str, int]], dict[int, tuple[int, int, int, int]]]] = {
    "A100-40GB": (
        {
            19: ("1g.5gb", 4864),
            20: ("1g.5gb+me", 4864),
            15: ("1g.10gb", 9856),
            14: ("2g.10gb", 9856),
            9: ("3g.20gb", 19968),
            5: ("4g.20gb", 19968),
            0: ("7g.40gb", 40192),
        },
        _AMPERE_ENGINES,
    ),
    "A100-80GB": (
        {
            19: ("1g.10gb", 9984),
            20: ("1g.10gb+me", 9984),
            15: ("1g.20gb", 19968),
            14: ("2g.20gb", 19968),
            9: ("3g.40gb", 40192),
            5: ("4g.40gb", 40192),
            0: ("7g.80gb", 80896),
        },
        _AMPERE_ENGINES,
    ),
    "H100-80GB": (
        {
            19: ("1g.10gb", 9856),
            20: ("1g.10gb+me", 9856),
            15: ("1g.20gb", 19968),
            14: ("2g.20gb", 19968),
            9: ("3g.40gb", 40192),
            5: ("4g.40gb", 40192),
            0: ("7g.80gb", 80896),
        },
        _HOPPER_ENGINES,
    ),
    "H200-141GB": (
        {
            19: ("1g.18gb", 17152),
            20: ("1g.18gb+me", 17152),
            15: ("1g.35gb", 34560),
            14: ("2g.35gb", 34560),
            9: ("3g.71gb", 69760),
            5: ("4g.71gb", 69760),
            0: ("7g.141gb", 140544),
        },
        _HOPPER_ENGINES,
    ),
    "B200-180GB": (
        {
            19: ("1g.23gb", 22784),
            20: ("1g.23gb+me", 22784),
            15: ("1g.45gb", 45312),
            14: ("2g.45gb", 45312),
            9: ("3g.90gb", 90880),
            5: ("4g.90gb", 90880),
            0: ("7g.180gb", 182784),
        },
        _HOPPER_ENGINES,
    ),
}
_GIB = 1024


def model_key(name: str, memory_mib: int) -> str | None:
    """Which table a GPU's name and memory select; None: the simulation has no MIG table for it."""
    upper = name.upper()
    if "A100" in upper:
        return "A100-80GB" if memory_mib > 48 * _GIB else "A100-40GB"
    if "H100" in upper and memory_mib <= 88 * _GIB:
        return "H100-80GB"
    if "H200" in upper:
        return "H200-141GB"
    if "B200" in upper:
        return "B200-180GB"
    return None


def model_profiles(key: str) -> tuple[MigProfile, ...]:
    """The profiles of a table, in the order NVML's profile enumeration gives them (smallest first)."""
    names, engines = _MODELS[key]
    profiles = []
    for profile_id, (name, memory) in names.items():
        compute, slices, count, placements = _SHAPES[profile_id]
        copy, decoders, jpegs, ofas = engines[profile_id]
        profiles.append(
            MigProfile(
                id=profile_id,
                name=name,
                compute_slices=compute,
                memory_slices=slices,
                memory_mib=memory,
                instance_count=count,
                placements=placements,
                copy_engines=copy,
                decoders=decoders,
                jpeg_engines=jpegs,
                ofa_engines=ofas,
            )
        )
    return tuple(profiles)


@dataclass(frozen=True)
class _Instance:
    gi_id: int
    profile: MigProfile
    start: int
    ci_id: int | None = None
    uuid: str = ""


class SimulatedMig:
    """One simulated GPU's MIG state. Thread-safe. `in_use(mig_uuid)`: a process runs on that MIG device."""

    def __init__(
        self, gpu_uuid: str, name: str, memory_mib: int, enabled: bool, in_use: Callable[[str], bool] = lambda _: False
    ) -> None:
        self.gpu_uuid = gpu_uuid
        self.enabled = enabled
        key = model_key(name, memory_mib)
        self.model = key or name
        self.table = model_profiles(key) if key else ()
        self.in_use = in_use
        self._instances: dict[int, _Instance] = {}
        self._made = 0
        self._lock = threading.Lock()

    # --- NVML's queries ---------------------------------------------------------------------------
    def profiles(self) -> tuple[MigProfile, ...]:
        if not self.enabled:
            raise MigError(f"GPU {self.gpu_uuid}: MIG mode is off", NOT_SUPPORTED)
        if not self.table:
            raise MigError(f"GPU {self.gpu_uuid}: the simulation has no MIG profiles for {self.model}", NOT_SUPPORTED)
        return self.table

    def placements(self, profile_id: int) -> tuple[int, ...]:
        """Every possible placement of the profile, MIG mode on or off (NVML's placement query does the same)."""
        return self._profile(profile_id).placements

    def instances(self) -> tuple[MigInstance, ...]:
        if not self.enabled:
            raise MigError(f"GPU {self.gpu_uuid}: MIG mode is off", NOT_SUPPORTED)
        with self._lock:
            return tuple(self._public(i) for i in sorted(self._instances.values(), key=lambda i: i.gi_id))

    @staticmethod
    def _public(i: _Instance) -> MigInstance:
        return MigInstance(
            gi_id=i.gi_id,
            profile_id=i.profile.id,
            start=i.start,
            size=i.profile.memory_slices,
            ci_id=i.ci_id,
            uuid=i.uuid,
        )

    # --- creation ---------------------------------------------------------------------------------
    def create_gpu_instance(self, profile_id: int, start: int) -> int:
        if not self.enabled:
            raise MigError(f"GPU {self.gpu_uuid}: MIG mode is off", NOT_SUPPORTED)
        profile = self._profile(profile_id)
        if start not in profile.placements:
            raise MigError(
                f"GPU {self.gpu_uuid}: profile {profile.name} cannot start at memory slice {start}", INVALID_ARGUMENT
            )
        with self._lock:
            self._check_room(profile, start)
            gi_id = next(i for i in range(1, len(self._instances) + 2) if i not in self._instances)
            self._instances[gi_id] = _Instance(gi_id=gi_id, profile=profile, start=start)
            return gi_id

    def create_compute_instance(self, gi_id: int) -> MigInstance:
        with self._lock:
            instance = self._instances.get(gi_id)
            if instance is None:
                raise MigError(f"GPU {self.gpu_uuid}: no GPU instance {gi_id}", NOT_FOUND)
            if instance.ci_id is not None:
                raise MigError(
                    f"GPU {self.gpu_uuid}: GPU instance {gi_id} has no room for another compute instance",
                    INSUFFICIENT_RESOURCES,
                )
            self._made += 1
            made = uuid.uuid5(uuid.NAMESPACE_URL, f"gpu-share/mig/{self.gpu_uuid}/{gi_id}/{self._made}")
            instance = self._instances[gi_id] = replace(instance, ci_id=0, uuid=f"MIG-{made}")
            return self._public(instance)

    def adopt(self, devices: Sequence[MigDevice]) -> None:
        """The instances a node file lists (which name no placement), at placements where they all fit (a search:
        the first free placement of each can block a later one); those whose profile the table lacks, or a layout
        no placement fits, are left out: the simulation only knows what it can place."""
        by_name = {p.name: p for p in self.table}
        wanted = sorted((d for d in devices if d.profile in by_name), key=lambda d: -by_name[d.profile].memory_slices)
        with self._lock:
            if not self._place(wanted, by_name):
                for device in wanted:  # no layout holds them all: each where it still fits
                    self._place([device], by_name)

    def _place(self, devices: list[MigDevice], by_name: dict[str, MigProfile]) -> bool:
        """Place every device (under the lock), backtracking; False (and nothing placed) when no layout fits."""
        if not devices:
            return True
        device, rest = devices[0], devices[1:]
        profile = by_name[device.profile]
        if device.gi_id in self._instances:
            return False
        for start in profile.placements:
            try:
                self._check_room(profile, start)
            except MigError:
                continue
            self._instances[device.gi_id] = _Instance(
                gi_id=device.gi_id, profile=profile, start=start, ci_id=device.ci_id, uuid=device.uuid
            )
            if self._place(rest, by_name):
                return True
            del self._instances[device.gi_id]
        return False

    # --- destruction ------------------------------------------------------------------------------
    def destroy_compute_instance(self, gi_id: int, ci_id: int) -> None:
        with self._lock:
            instance = self._instances.get(gi_id)
            if instance is None or instance.ci_id != ci_id:
                raise MigError(f"GPU {self.gpu_uuid}: no compute instance {ci_id} in GPU instance {gi_id}", NOT_FOUND)
            if self.in_use(instance.uuid):
                raise MigError(f"GPU {self.gpu_uuid}: processes run on MIG device {instance.uuid}", IN_USE)
            self._instances[gi_id] = replace(instance, ci_id=None, uuid="")

    def destroy_gpu_instance(self, gi_id: int) -> None:
        with self._lock:
            instance = self._instances.get(gi_id)
            if instance is None:
                raise MigError(f"GPU {self.gpu_uuid}: no GPU instance {gi_id}", NOT_FOUND)
            if instance.ci_id is not None:
                raise MigError(
                    f"GPU {self.gpu_uuid}: GPU instance {gi_id} still has compute instance {instance.ci_id}", IN_USE
                )
            del self._instances[gi_id]

    # --- inside -----------------------------------------------------------------------------------
    def _profile(self, profile_id: int) -> MigProfile:
        for profile in self.table:
            if profile.id == profile_id:
                return profile
        raise MigError(f"GPU {self.gpu_uuid}: no GPU-instance profile {profile_id} on {self.model}", INVALID_ARGUMENT)

    def _check_room(self, profile: MigProfile, start: int) -> None:
        """INSUFFICIENT_RESOURCES unless an instance of `profile` fits at `start` beside the others (under the lock)."""
        taken = {s for i in self._instances.values() for s in i.profile.slices(i.start)}
        overlap = sorted(taken & set(profile.slices(start)))
        if overlap:
            why = f"placement {start} of {profile.name} overlaps memory slices {overlap} of another instance"
            raise MigError(f"GPU {self.gpu_uuid}: {why}", INSUFFICIENT_RESOURCES)
        if sum(1 for i in self._instances.values() if i.profile.id == profile.id) >= profile.instance_count:
            raise MigError(
                f"GPU {self.gpu_uuid}: {profile.name} has at most {profile.instance_count} instances",
                INSUFFICIENT_RESOURCES,
            )
        whole = full_profile(self.table)
        if whole is None:
            return
        used = [i.profile for i in self._instances.values()] + [profile]
        if sum(p.compute_slices for p in used) > whole.compute_slices:
            raise MigError(f"GPU {self.gpu_uuid}: no compute slices left for {profile.name}", INSUFFICIENT_RESOURCES)
        for engine in whole.engines():
            if sum(p.engines()[engine] for p in used) > max(p.engines()[engine] for p in self.table):
                raise MigError(f"GPU {self.gpu_uuid}: no {engine} left for {profile.name}", INSUFFICIENT_RESOURCES)

"""One object per sharing mode: what differs between whole GPUs, time-sliced shares, MPS shares and MIG instances.

`mode_of(pool)` looks a pool's mode up once; the plan (units and devices), the placement order, the grant's share
facts, the labels and the DRA driver ask that object instead of branching on the pool's mode and backend.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from ..config.types import MPS_LIMIT_REASON, Mode, PoolConfig, WatchdogPolicy, max_replicas
from ..model.devices import Device, Resource, Unit, share_device_id
from ..model.node import Gpu
from ..model.shares import share_compute_percent, share_memory_mib
from ..mps.paths import MpsPaths

log = logging.getLogger(__name__)

# Environment variables a share-aware application can read.
ENV_SHARE_COUNT = "GPU_SHARE_COUNT"
ENV_SHARE_TOTAL = "GPU_SHARE_TOTAL"
ENV_MEMORY_LIMIT = "GPU_SHARE_MEMORY_LIMIT_MIB"
ENV_COMPUTE_PERCENT = "GPU_SHARE_COMPUTE_PERCENT"
ENV_MPS_ACTIVE_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_MPS_PINNED_MEMORY = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"

PoolResource = tuple[str, str, list[Unit]]  # (resource name, label, units): one resource of a pool on a node
# How GetPreferredAllocation orders devices: the best-connected set of whole GPUs; one device per unit, in the units'
# order; or shares, on the unit the allocation policy picks.
Placement = Literal["topology", "in order", "policy"]


@dataclass(frozen=True)
class ClientLimits:
    """An MPS client's own limits at or below what its shares give (a DRA claim's SharingConfig); None: its shares'."""

    active_thread_percent: int | None = None
    pinned_memory_mib: int | None = None


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


class SharingMode(ABC):
    """By default whole devices, one per unit, with nothing added to the grant; each mode overrides what differs."""

    name: ClassVar[str]  # the DRA devices' `mode` attribute
    strategy: ClassVar[str] = "none"  # the sharing-strategy labels (GPU feature discovery's values)
    placement: ClassVar[Placement]

    @abstractmethod
    def resources(self, pool: PoolConfig, gpus: list[Gpu]) -> list[PoolResource]:
        """The resources the pool yields on these GPUs; ValueError naming the config key for GPUs it cannot serve."""

    def devices(self, units: Sequence[Unit]) -> dict[str, Device]:
        return {u.uuid: Device(id=u.uuid, unit=u) for u in units}

    def id_lengths(self, unit: Unit) -> list[tuple[str, int]]:
        """(the longest device ID of one length, how many IDs have that length) for one unit."""
        return [(unit.uuid, 1)]

    def budget_terms(self, pool: PoolConfig, units: Sequence[Unit]) -> tuple[str, str]:
        """(what each unit advertises, the remedy) for a device list over the ListAndWatch budget."""
        return "whole devices", "select fewer GPUs"

    def grant_facts(
        self,
        resource: Resource,
        holdings: Sequence[tuple[Unit, int]],
        mps_client_limits: bool | None,
        limits: ClientLimits | None = None,
    ) -> tuple[dict[str, str], tuple[Mount, ...]]:
        """What the grant adds for this mode: environment variables and mounts (`limits`: MPS modes only)."""
        return {}, ()

    def may_span(self, pool: PoolConfig) -> bool:
        """Whether one container's devices may lie on several units (whole GPUs and MIG instances: always)."""
        return True

    def most_per_container(self, pool: PoolConfig) -> int | None:
        """The most devices one container may hold, where the mode itself bounds it (None: it does not)."""
        return None

    @abstractmethod
    def enforcement(self, pool: PoolConfig, unit: Unit, watchdog_policy: WatchdogPolicy) -> str:
        """How a container's memory and compute are held to what it is given, or that they are not (`config check`)."""

    def __repr__(self) -> str:
        return f"<sharing mode {self.name}>"


class Exclusive(SharingMode):
    name = "exclusive"
    placement = "topology"

    def resources(self, pool: PoolConfig, gpus: list[Gpu]) -> list[PoolResource]:
        for gpu in gpus:
            if gpu.mig_enabled:
                log.warning(
                    "GPU %d (%s) has MIG enabled: pool %s (exclusive) does not advertise it whole; use mode mig",
                    gpu.index,
                    gpu.uuid,
                    pool.name,
                )
        return [(pool.resource, pool.name, [_whole(g) for g in gpus if not g.mig_enabled])]

    def enforcement(self, pool: PoolConfig, unit: Unit, watchdog_policy: WatchdogPolicy) -> str:
        return "the whole GPU, no neighbours"


class Mig(SharingMode):
    name = "mig"
    placement = "in order"

    def resources(self, pool: PoolConfig, gpus: list[Gpu]) -> list[PoolResource]:
        if pool.dynamic_mig:  # each GPU whole: the DRA driver publishes a MIG-enabled one as its profiles' placements,
            # each with the pool's `replicas` shares of the instance made for it; a GPU with MIG mode off is one device
            units = [replace(_whole(g), replicas=pool.replicas if g.mig_enabled else 1) for g in gpus]
            return [(pool.resource, pool.name, units)]
        by_profile: dict[str, list[Unit]] = {}
        for gpu in gpus:
            if not gpu.mig_enabled:
                log.warning(
                    "GPU %d (%s) does not have MIG enabled: pool %s (mig) does not advertise it",
                    gpu.index,
                    gpu.uuid,
                    pool.name,
                )
            for device, unit in zip(gpu.mig_devices, _mig_units(gpu), strict=True):
                by_profile.setdefault(device.profile, []).append(unit)
        if pool.mig_strategy == "single":
            if len(by_profile) > 1:
                found = "; ".join(
                    f"{p} on GPU {', '.join(str(i) for i in sorted({u.gpu.index for u in units}))}"
                    for p, units in sorted(by_profile.items())
                )
                raise ValueError(
                    f"{pool.key_path}.strategy: single needs one MIG profile on every GPU of the pool, found {found}; "
                    "use strategy mixed"
                )
            return [(pool.resource, pool.name, [u for units in by_profile.values() for u in units])]
        return [
            (mig_resource_name(pool.domain, profile), f"{pool.name}-{profile.replace('+', '.')}", units)
            for profile, units in sorted(by_profile.items())
        ]

    def enforcement(self, pool: PoolConfig, unit: Unit, watchdog_policy: WatchdogPolicy) -> str:
        if unit.replicas > 1:  # a dynamic pool's instance shared by claims (the DRA driver)
            return (
                f"isolated by the hardware (MIG) from other instances; its {unit.replicas} shares take turns in it "
                f"(not enforced between them: {TIME_SLICED.enforcement(pool, unit, watchdog_policy)})"
            )
        return "isolated by the hardware (MIG)"


class TimeSliced(SharingMode):
    """Shares of a unit (a GPU, or a MIG instance of a MIG-enabled GPU), taking turns on it."""

    name = "time-slicing"
    strategy = "time-slicing"
    placement = "policy"
    limit_reason: ClassVar[str] = ""  # why a unit has at most max_replicas shares, for the error

    def resources(self, pool: PoolConfig, gpus: list[Gpu]) -> list[PoolResource]:
        # A MIG-enabled GPU is shared instance by instance.
        units = [u for g in gpus for u in (_mig_units(g) if g.mig_enabled else [_whole(g)])]
        return [(pool.resource, pool.name, [self._with_replicas(pool, u) for u in units])]

    def _with_replicas(self, pool: PoolConfig, unit: Unit) -> Unit:
        """A unit with its share count: `replicas`, or as many `memoryPerShare` as fit (at most max_replicas)."""
        if pool.memory_per_share_mib is None:
            return replace(unit, replicas=pool.replicas)
        replicas = unit.memory_mib // pool.memory_per_share_mib
        what = (
            f"MIG instance {unit.uuid} ({unit.mig.profile}" if unit.mig else f"GPU {unit.gpu.index} ({unit.gpu.model}"
        )
        if replicas < 1:
            raise ValueError(
                f"{pool.key_path}.memoryPerShare: {pool.memory_per_share_mib} MiB is larger than {what}, "
                f"{unit.memory_mib} MiB)"
            )
        most = max_replicas(pool.backend)
        if replicas > most:
            raise ValueError(
                f"{pool.key_path}.memoryPerShare: {pool.memory_per_share_mib} MiB makes {replicas} shares of {what}, "
                f"{unit.memory_mib} MiB), over the limit of {most} shares per GPU or MIG instance{self.limit_reason}; "
                "use a larger memoryPerShare"
            )
        return replace(unit, replicas=replicas)

    def devices(self, units: Sequence[Unit]) -> dict[str, Device]:
        return {
            share_device_id(u.uuid, k): Device(id=share_device_id(u.uuid, k), unit=u, share=k)
            for u in units
            for k in range(u.replicas)
        }

    def id_lengths(self, unit: Unit) -> list[tuple[str, int]]:
        shapes = []
        low = 0
        while low < unit.replicas:
            high = min(unit.replicas, max(10, low * 10))  # share numbers low..high-1 have the same number of digits
            shapes.append((share_device_id(unit.uuid, high - 1), high - low))
            low = high
        return shapes

    def may_span(self, pool: PoolConfig) -> bool:
        return pool.allow_span  # shares of one container on one unit, unless allowSpanGPUs

    def budget_terms(self, pool: PoolConfig, units: Sequence[Unit]) -> tuple[str, str]:
        return (
            f"{max(u.replicas for u in units)} shares each",
            "raise memoryPerShare" if pool.memory_per_share_mib else "lower replicas",
        )

    def grant_facts(
        self,
        resource: Resource,
        holdings: Sequence[tuple[Unit, int]],
        mps_client_limits: bool | None,
        limits: ClientLimits | None = None,
    ) -> tuple[dict[str, str], tuple[Mount, ...]]:
        """GPU_SHARE_*: the shares a container holds and what they are worth."""
        envs = {
            ENV_SHARE_COUNT: str(sum(k for _, k in holdings)),
            ENV_SHARE_TOTAL: str(holdings[0][0].replicas),
            ENV_MEMORY_LIMIT: str(_memory(holdings)),
            ENV_COMPUTE_PERCENT: str(_compute(holdings)),
        }
        return envs, ()

    def enforcement(self, pool: PoolConfig, unit: Unit, watchdog_policy: WatchdogPolicy) -> str:
        watchdog = "reports" if watchdog_policy == "report" else "kills"
        return (
            f"not enforced: compute is time-sliced (turns, not a cap); memory is not capped by the GPU, the memory "
            f"watchdog {watchdog} a container over it"
        )


class Mps(TimeSliced):
    """Shares of a whole GPU run through the pool's MPS control daemon, which caps compute and pinned memory."""

    name = "mps"
    strategy = "mps"
    limit_reason = f" ({MPS_LIMIT_REASON})"

    def resources(self, pool: PoolConfig, gpus: list[Gpu]) -> list[PoolResource]:
        if any(g.mig_enabled for g in gpus):
            mig = ", ".join(str(g.index) for g in gpus if g.mig_enabled)
            raise ValueError(
                f"{pool.key_path}.backend: mps is not supported on MIG-enabled GPUs (GPU {mig}); "
                "use timeSlicing or a mig pool"
            )
        return super().resources(pool, gpus)

    def most_per_container(self, pool: PoolConfig) -> int | None:
        return 1 if pool.mps_limits == "strict" else None  # strict: every client gets the daemon's one-share defaults

    def grant_facts(
        self,
        resource: Resource,
        holdings: Sequence[tuple[Unit, int]],
        mps_client_limits: bool | None,
        limits: ClientLimits | None = None,
    ) -> tuple[dict[str, str], tuple[Mount, ...]]:
        """GPU_SHARE_*, the MPS pipe and its mounts, and per-client limits: `mps_client_limits`, or when None the
        pool's `mpsLimits: proportional`; `limits` (the caller checked they are at most the shares') lower them, and
        GPU_SHARE_COMPUTE_PERCENT and GPU_SHARE_MEMORY_LIMIT_MIB with them."""
        envs, _ = super().grant_facts(resource, holdings, mps_client_limits)
        paths = MpsPaths.of(resource.settings.mps_root, resource.pool.name)
        envs["CUDA_MPS_PIPE_DIRECTORY"] = str(paths.pipe)
        if resource.pool.mps_limits == "proportional" if mps_client_limits is None else mps_client_limits:
            limits = limits or ClientLimits()
            compute = _compute(holdings) if limits.active_thread_percent is None else limits.active_thread_percent
            memory = _memory(holdings) if limits.pinned_memory_mib is None else limits.pinned_memory_mib
            envs[ENV_COMPUTE_PERCENT], envs[ENV_MEMORY_LIMIT] = str(compute), str(memory)
            envs[ENV_MPS_ACTIVE_THREADS] = str(compute)
            envs[ENV_MPS_PINNED_MEMORY] = f"0={memory}M"  # device 0: an MPS client sees its one GPU
        return envs, (
            Mount(container_path=str(paths.pipe), host_path=str(paths.pipe)),
            Mount(container_path="/dev/shm", host_path=str(paths.shm)),
        )

    def enforcement(self, pool: PoolConfig, unit: Unit, watchdog_policy: WatchdogPolicy) -> str:
        if pool.mps_limits == "strict":
            return (
                "enforced by the MPS daemon for every client (its defaults: active threads "
                f"{share_compute_percent(unit)} %, pinned memory {share_memory_mib(unit)} MiB per GPU); "
                "one share per container"
            )
        return "enforced by MPS from the container's CUDA_MPS_* limits (k shares: k times both)"


EXCLUSIVE, TIME_SLICED, MPS, MIG = Exclusive(), TimeSliced(), Mps(), Mig()
SHARING_MODES: tuple[SharingMode, ...] = (EXCLUSIVE, TIME_SLICED, MPS, MIG)
_BY_POOL_MODE: dict[Mode, SharingMode] = {"exclusive": EXCLUSIVE, "shared": TIME_SLICED, "mig": MIG}


def mode_of(pool: PoolConfig) -> SharingMode:
    """The pool's sharing mode: its `mode`, and for a shared pool its backend."""
    return MPS if pool.mps else _BY_POOL_MODE[pool.mode]


def mig_resource_name(domain: str, profile: str) -> str:
    """The mixed strategy's name: <domain>/mig-<profile>, with '+' (e.g. 1g.10gb+me) made '.'."""
    return f"{domain}/mig-{profile.replace('+', '.')}"


def _whole(gpu: Gpu) -> Unit:
    return Unit(uuid=gpu.uuid, gpu=gpu, memory_mib=gpu.memory_mib)


def _mig_units(gpu: Gpu) -> list[Unit]:
    return [Unit(uuid=m.uuid, gpu=gpu, memory_mib=m.memory_mib, mig=m) for m in gpu.mig_devices]


def _memory(holdings: Sequence[tuple[Unit, int]]) -> int:
    return sum(share_memory_mib(u, k) for u, k in holdings)


def _compute(holdings: Sequence[tuple[Unit, int]]) -> int:
    """Percent of one GPU; over 100 only when spanning."""
    return sum(share_compute_percent(u, k) for u, k in holdings)

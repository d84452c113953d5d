"""What a GPU node has, as discovery reports it: GPUs, MIG instances, links, health events, readings."""

from __future__ import annotations

from dataclasses import dataclass, field

from .mig import MigProfile

MIB = 1024 * 1024  # bytes in a MiB: memory is counted in MiB everywhere in the model

# PCIe common-ancestor levels between two GPUs, closest first (NVML's topology levels).
PCIE_LEVELS = ("board", "switch", "multi-switch", "host-bridge", "numa-node", "system")


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance (a GPU instance with one compute instance)."""

    uuid: str
    profile: str  # e.g. "1g.10gb", "3g.40gb"
    memory_mib: int
    gi_id: int
    ci_id: int
    index: int  # MIG device index on the parent GPU


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
    minor_number: int | None = None  # N of /dev/nvidiaN
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    mig_capable: bool = False  # the hardware supports MIG, enabled or not
    mig_profiles: tuple[MigProfile, ...] = ()  # GPU-instance profiles with their placements (read while MIG is enabled)


@dataclass(frozen=True)
class Link:
    """How two GPUs are connected: NVLink count and PCIe common ancestor."""

    nvlinks: int = 0
    pcie: str = ""  # one of PCIE_LEVELS, "" when unknown

    def describe(self) -> str:
        return f"NV{self.nvlinks}" if self.nvlinks else (self.pcie or "?")


@dataclass(frozen=True)
class HealthEvent:
    """Something that makes a GPU (or one MIG instance on it) unfit for new work."""

    gpu_uuid: str
    reason: str
    xid: int | None = None
    mig_uuid: str | None = None  # None: the whole GPU
    reset_required: bool = False  # the backend knows only a GPU reset clears it (double-bit ECC, a lost GPU)


@dataclass(frozen=True)
class GpuStats:
    """A GPU's live readings; None where the GPU does not report one."""

    memory_used_mib: int | None = None
    utilization_percent: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU (or one MIG instance of it)."""

    pid: int
    gpu_uuid: str
    used_mib: int
    mig_uuid: str | None = None


@dataclass(frozen=True)
class NodeInfo:
    """Everything discovery knows about the node."""

    gpus: tuple[Gpu, ...]
    driver_version: str = ""
    cuda_driver_version: str = ""
    links: dict[tuple[str, str], Link] = field(default_factory=dict)  # keyed (uuid, uuid), lower index first
    name: str = ""
    skipped: tuple[tuple[int, str], ...] = ()  # (index, why) of GPUs discovery could not describe: not advertised

    def link(self, a: Gpu, b: Gpu) -> Link:
        return link_between(self.links, a, b)


def link_between(links: dict[tuple[str, str], Link], a: Gpu, b: Gpu) -> Link:
    """How `a` and `b` are connected, from links keyed (uuid, uuid) with the lower index first; Link() when unknown."""
    first, second = sorted((a, b), key=lambda g: g.index)
    return links.get((first.uuid, second.uuid), Link())


def gpu_family(major: int, minor: int) -> str:
    """The architecture of a CUDA compute capability, by GFD's family names ("undefined" when unknown)."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return {
        1: "tesla",
        2: "fermi",
        3: "kepler",
        5: "maxwell",
        6: "pascal",
        9: "hopper",
        10: "blackwell",
        12: "blackwell",
    }.get(major, "undefined")

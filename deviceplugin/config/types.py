"""The config's types: what a parsed, validated gpu-share config file is (parse.py builds it from YAML).

Every key, its default and an example are in docs/configuration.md. In short::

    version: v1
    domain: example.com              # default: $GPU_SHARE_DOMAIN, else example.com
    allocationPolicy: binpack        # binpack | spread | fgdstrand
    deviceListStrategy: envvar       # envvar | cdi
    cdiKind: nvidia.com/gpu          # CDI names are <cdiKind>=<UUID>
    deviceSpecs: false               # add /dev/nvidia* device specs to Allocate
    sharedProductSuffix: false       # gpu.product label gets GFD's -SHARED when GPUs are shared
    deprecatedCudaLabels: false      # also GFD's deprecated cuda.driver.* and cuda.runtime.* labels
    deviceRoot: /                    # where /dev and /proc/driver/nvidia are found
    mpsRoot: /run/gpu-share/mps      # MPS pipe, log and shm directories, per pool
    memoryWatchdog: {policy: report, quarantine: false}
    defaultProfile: default
    pools: [...]                     # the `default` profile
    profiles:                        # named profiles; a node picks one by label or --profile
      inference:
        pools: [...]
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import Literal, TypeVar, get_args

from .. import limits
from ..model.node import Gpu

SUPPORTED_VERSIONS = ("v1",)
DEFAULT_DOMAIN = "example.com"
DOMAIN_ENV = "GPU_SHARE_DOMAIN"  # the domain when the file has none (the kustomization sets it)
DEFAULT_PROFILE = "default"
DEFAULT_REPLICAS = 10
DEFAULT_MPS_ROOT = "/run/gpu-share/mps"
# Each choice the file offers, as a type (mypy refuses a misspelt comparison) and as the tuple parse.py checks against.
Mode = Literal["exclusive", "shared", "mig"]
Backend = Literal["timeSlicing", "mps"]
MpsLimits = Literal["strict", "proportional"]
MigStrategy = Literal["mixed", "single", "dynamic"]  # dynamic: instances made per claim (DRA only)
AllocationPolicy = Literal["binpack", "spread", "fgdstrand"]  # fgdstrand: the cluster policy (deviceplugin.cluster)
DeviceListStrategy = Literal["envvar", "cdi"]
WatchdogPolicy = Literal["report", "kill"]
MODES: tuple[Mode, ...] = get_args(Mode)
BACKENDS: tuple[Backend, ...] = get_args(Backend)
MPS_LIMITS: tuple[MpsLimits, ...] = get_args(MpsLimits)
MIG_STRATEGIES: tuple[MigStrategy, ...] = get_args(MigStrategy)
ALLOCATION_POLICIES: tuple[AllocationPolicy, ...] = get_args(AllocationPolicy)
DEVICE_LIST_STRATEGIES: tuple[DeviceListStrategy, ...] = get_args(DeviceListStrategy)
WATCHDOG_POLICIES: tuple[WatchdogPolicy, ...] = get_args(WatchdogPolicy)
DYNAMIC_MIG_RESOURCE = "mig-dynamic"  # the resource name of a strategy dynamic pool (DRA publishes no resource names)
DEFAULT_RESOURCE: dict[Mode, str] = {
    "exclusive": "gpu",
    "shared": "gpu-share",
    "mig": "gpu",
}  # mig: only with strategy single
Choice = TypeVar("Choice", bound=str)


def one_of(value: object, allowed: tuple[Choice, ...], default: Choice) -> Choice:
    """`value` as the choice it equals, else `default` (the caller reports the bad value)."""
    return next((choice for choice in allowed if choice == value), default)


class ConfigError(ValueError):
    """One or more problems in a config; each line is `key.path: reason` (at most MAX_REPORTED_PROBLEMS are shown)."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        shown = problems[: limits.MAX_REPORTED_PROBLEMS]
        if len(problems) > len(shown):
            shown = [*shown, f"... and {len(problems) - len(shown)} more problems"]
        super().__init__(f"{source}: " + ("\n  ".join([""] + shown) if len(shown) > 1 else shown[0]))


@dataclass(frozen=True)
class GpuSelector:
    indexes: tuple[int, ...] = ()
    uuids: tuple[str, ...] = ()
    models: tuple[str, ...] = ()

    @property
    def selects_rest(self) -> bool:
        """True when the pool takes every GPU that no other pool selects."""
        return not (self.indexes or self.uuids or self.models)

    def matches(self, gpu: Gpu) -> bool:
        return (
            gpu.index in self.indexes
            or gpu.uuid in self.uuids
            or any(fnmatch.fnmatchcase(gpu.model.lower(), p.lower()) for p in self.models)
        )


@dataclass(frozen=True)
class PoolConfig:
    name: str
    mode: Mode
    resource: str  # fully qualified <domain>/<name>; "" for mig pools with the mixed strategy
    domain: str = DEFAULT_DOMAIN
    replicas: int = 1  # shares per GPU or MIG instance (ignored when memory_per_share_mib is set)
    memory_per_share_mib: int | None = None
    backend: Backend = "timeSlicing"
    mps_limits: MpsLimits = "strict"
    allow_span: bool = False
    exclusive_process: bool = (
        False  # backend mps: `gpu-share mps` puts the pool's GPUs in EXCLUSIVE_PROCESS while it serves
    )
    sharing_strategies: tuple[Backend, ...] = ()  # backend mps: what a DRA claim may choose; () = the backend alone
    mig_strategy: MigStrategy = "mixed"
    gpus: GpuSelector = field(default_factory=GpuSelector)
    key_path: str = "pools[0]"  # the YAML key path of the pool in the file, for messages

    @property
    def shared(self) -> bool:
        return self.mode == "shared"

    @property
    def mps(self) -> bool:
        return self.shared and self.backend == "mps"

    @property
    def dynamic_mig(self) -> bool:
        """MIG instances made for each claim and destroyed after it (only the DRA driver serves such a pool)."""
        return self.mode == "mig" and self.mig_strategy == "dynamic"

    @property
    def strategies(self) -> tuple[Backend, ...]:
        """The sharing strategies a DRA claim's SharingConfig may choose on a shared pool: `sharingStrategies`, else
        the backend alone."""
        return self.sharing_strategies or (self.backend,)


@dataclass(frozen=True)
class AllocationSettings:
    """The node-wide settings that decide GetPreferredAllocation and Allocate answers: every resource carries them (a
    change restarts its server on reload)."""

    allocation_policy: AllocationPolicy
    device_list_strategy: DeviceListStrategy
    cdi_kind: str
    device_specs: bool
    device_root: str
    mps_root: str


@dataclass(frozen=True)
class Config:
    version: str = "v1"
    domain: str = DEFAULT_DOMAIN
    allocation_policy: AllocationPolicy = "binpack"
    device_list_strategy: DeviceListStrategy = "envvar"
    cdi_kind: str = "nvidia.com/gpu"
    device_specs: bool = False
    shared_product_suffix: bool = False  # GFD's -SHARED on the gpu.product label when GPUs are shared
    deprecated_cuda_labels: bool = False  # also GFD's deprecated cuda.driver.*, cuda.runtime.* labels
    device_root: str = "/"
    mps_root: str = DEFAULT_MPS_ROOT
    watchdog_policy: WatchdogPolicy = "report"
    quarantine: bool = False
    default_profile: str = DEFAULT_PROFILE
    profiles: dict[str, tuple[PoolConfig, ...]] = field(default_factory=dict)
    source: str = "built-in default"

    def pools(self, profile: str | None = None) -> tuple[PoolConfig, ...]:
        """The pools of `profile` (the default profile when None or empty)."""
        name = profile or self.default_profile
        if name not in self.profiles:
            raise ConfigError(
                [f"profile {name!r} is not in the config (profiles: {', '.join(sorted(self.profiles))})"], self.source
            )
        return self.profiles[name]

    def allocation_settings(self) -> AllocationSettings:
        return AllocationSettings(
            allocation_policy=self.allocation_policy,
            device_list_strategy=self.device_list_strategy,
            cdi_kind=self.cdi_kind,
            device_specs=self.device_specs,
            device_root=self.device_root,
            mps_root=self.mps_root,
        )


def default_config() -> Config:
    """Every GPU in one shared pool with 10 shares per GPU."""
    domain = default_domain()
    pool = PoolConfig(
        name="default", mode="shared", resource=f"{domain}/gpu-share", domain=domain, replicas=DEFAULT_REPLICAS
    )
    return Config(domain=domain, profiles={DEFAULT_PROFILE: (pool,)})


def default_domain() -> str:
    """$GPU_SHARE_DOMAIN, else example.com: the domain of a config without a `domain` key."""
    return os.environ.get(DOMAIN_ENV) or DEFAULT_DOMAIN


MPS_LIMIT_REASON = (
    f"an MPS server takes {limits.MPS_MAX_CLIENTS} clients per GPU, and each needs at least 1 % of its threads"
)


def max_replicas(backend: str) -> int:
    """The most shares per GPU or MIG instance: MPS caps them at its client limit (which also keeps 100 % / N >= 1)."""
    return min(limits.MPS_MAX_CLIENTS, 100) if backend == "mps" else limits.MAX_REPLICAS

"""Sharing chosen per claim: the driver's opaque device config `SharingConfig`, parsed, picked per request in the
order the resource.k8s.io API defines, and checked against the pool and what the claim consumed (docs/dra.md).

A claim's `spec.devices.config[]` (or its DeviceClass's `spec.config[]`) passes it to the driver::

    opaque:
      driver: gpu-share.example.com
      parameters:
        apiVersion: gpu-share.example.com/v1alpha1
        kind: SharingConfig
        sharing:
          strategy: mps                           # timeSlicing | mps, where the device's pool offers it
          mpsConfig:                              # strategy mps only; each at most what the claim consumed
            defaultActiveThreadPercentage: 25
            defaultPinnedDeviceMemoryLimit: 4Gi
          timeSlicingConfig: {interval: Default}  # strategy timeSlicing only; only Default (see `_INTERVAL_REASON`)

The field names are those of NVIDIA's DRA driver (`GpuConfig.sharing`). The scheduler copies the class's configs
(`source: FromClass`) and then the claim's (`FromClaim`) into `status.allocation.devices.config`; a config applies
to a result when its `requests` is empty or names the result's request (`<req>/<sub>` or its `<req>`), and of the
configs of this driver that apply, the last one is used whole (configs are not merged field by field, as in
NVIDIA's and the Kubernetes example driver). Another driver's config is not read. Every config of this driver is
parsed, used or not: a malformed one fails the claim, naming the config and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..alloc.modes import MPS, TIME_SLICED, ClientLimits, SharingMode, mode_of
from ..config.schema import Fields, SchemaError, join
from ..config.types import BACKENDS, Backend
from ..logs import safe_text
from ..model.node import MIB
from ..model.quantity import parse_quantity
from ..model.shares import share_compute_percent
from .devices import ClaimError, ClaimShare

VERSION = "v1alpha1"
KIND = "SharingConfig"
MAX_PARAMETER_BYTES = 10 * 1024  # the API's own bound on opaque parameters
MAX_DEPTH = 4  # parameters > sharing > mpsConfig > a value
MAX_ENTRIES = 16  # fields of one mapping, entries of one list
MAX_REQUESTS = 32  # a config's `requests` (the API's bound)
MAX_REQUEST_CHARS = 127  # `<req>/<sub>`, two DNS labels
INTERVALS = ("Default", "Short", "Medium", "Long")  # NVIDIA's TimeSlicingConfig.interval values
_INTERVAL_REASON = (
    "the time slice is a setting of the whole GPU (what `nvidia-smi compute-policy --set-timeslice` changes), which "
    "every process on it shares, and NVML offers no call to set it outside vGPU; gpu-share leaves it at the driver's "
    "default, so only Default is accepted"
)

_TOP: dict[str, type] = {"apiVersion": str, "kind": str, "sharing": dict}
_SHARING: dict[str, type] = {"strategy": str, "mpsConfig": dict, "timeSlicingConfig": dict}
_MPS: dict[str, type] = {"defaultActiveThreadPercentage": int, "defaultPinnedDeviceMemoryLimit": str}
_TIME_SLICING: dict[str, type] = {"interval": str}


def api_version(driver: str) -> str:
    """`gpu-share.<domain>/v1alpha1`: the config's API group is the driver's name."""
    return f"{driver}/{VERSION}"


@dataclass(frozen=True)
class SharingConfig:
    """One parsed SharingConfig; None: not given."""

    strategy: Backend | None = None
    active_thread_percentage: int | None = None
    pinned_memory_bytes: int | None = None
    interval: str | None = None
    mps_config: bool = False  # `sharing.mpsConfig` is present
    time_slicing_config: bool = False  # `sharing.timeSlicingConfig` is present


@dataclass(frozen=True)
class DeviceConfig:
    """One of this driver's entries of `status.allocation.devices.config`, parsed."""

    where: str  # `config[2] (FromClaim)`, for messages
    requests: tuple[str, ...]  # empty: every request
    config: SharingConfig

    def applies_to(self, request: str) -> bool:
        return not self.requests or request in self.requests or request.split("/", 1)[0] in self.requests


@dataclass(frozen=True)
class Sharing:
    """What a request runs under: the strategy's mode (None: the pool's) and MPS client limits (None: its shares')."""

    mode: SharingMode | None = None
    limits: ClientLimits | None = None
    strategy: str = ""  # the strategy when it is not the pool's mode (the record keeps it: the watchdog reads it)


NO_SHARING_CONFIG = Sharing()


def driver_configs(configs: Sequence[Any], driver: str) -> list[DeviceConfig]:
    """This driver's configs, in the allocation's order (class configs, then the claim's), each parsed; ClaimError
    naming the config and the field for a malformed one. Other drivers' configs are skipped unread."""
    out = []
    for index, entry in enumerate(configs):
        if not isinstance(entry, Mapping):
            continue
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        where = f"config[{index}] ({safe_text(str(entry.get('source') or 'no source'), 20)})"
        requests = entry.get("requests") or []
        if not isinstance(requests, list) or len(requests) > MAX_REQUESTS:
            raise ClaimError(f"{where}: requests must be a list of at most {MAX_REQUESTS} request names")
        if not all(isinstance(r, str) and 0 < len(r) <= MAX_REQUEST_CHARS for r in requests):
            raise ClaimError(f"{where}: requests must be request names (<request> or <request>/<subrequest>)")
        try:
            config = parse_parameters(opaque.get("parameters"), driver)
        except SchemaError as err:
            raise ClaimError(f"{where}: {err}") from None
        out.append(DeviceConfig(where=where, requests=tuple(requests), config=config))
    return out


def parse_parameters(parameters: Any, driver: str) -> SharingConfig:
    """A SharingConfig from an opaque config's `parameters` (the JSON object the API returns); SchemaError naming
    the field otherwise: unknown fields, wrong types, another version or kind, too large or too deep."""
    if not isinstance(parameters, Mapping):
        raise SchemaError("parameters", "must be a JSON object (a SharingConfig)")
    _bounded(parameters, "", 0)
    size = len(json.dumps(parameters, separators=(",", ":")))
    if size > MAX_PARAMETER_BYTES:
        raise SchemaError("parameters", f"{size} bytes, more than {MAX_PARAMETER_BYTES}")
    top = Fields(parameters, "", _TOP)
    version, kind = top.get("apiVersion", "", required=True), top.get("kind", "", required=True)
    if version != api_version(driver):
        raise SchemaError("apiVersion", f"must be {api_version(driver)}, got {safe_text(repr(version), 80)}")
    if kind != KIND:
        raise SchemaError("kind", f"must be {KIND}, got {safe_text(repr(kind), 80)}")
    if not top.has("sharing"):
        return SharingConfig()
    sharing = Fields(top.get("sharing"), "sharing", _SHARING)
    strategy = sharing.get("strategy")
    if strategy is not None and strategy not in BACKENDS:
        raise SchemaError(
            "sharing.strategy", f"must be one of {', '.join(BACKENDS)}, got {safe_text(repr(strategy), 80)}"
        )
    percent = memory = interval = None
    if sharing.has("mpsConfig"):
        mps = Fields(sharing.get("mpsConfig"), "sharing.mpsConfig", _MPS)
        percent = mps.get("defaultActiveThreadPercentage")
        if percent is not None and not 1 <= percent <= 100:
            raise SchemaError(
                "sharing.mpsConfig.defaultActiveThreadPercentage", f"must be 1-100, got {safe_text(str(percent), 40)}"
            )
        raw = mps.get("defaultPinnedDeviceMemoryLimit")
        if raw is not None:
            memory = _memory_bytes(raw)
    if sharing.has("timeSlicingConfig"):
        interval = Fields(sharing.get("timeSlicingConfig"), "sharing.timeSlicingConfig", _TIME_SLICING).get("interval")
        if interval is not None and interval not in INTERVALS:
            raise SchemaError(
                "sharing.timeSlicingConfig.interval",
                f"must be one of {', '.join(INTERVALS)}, got {safe_text(repr(interval), 80)}",
            )
    return SharingConfig(
        strategy=next((b for b in BACKENDS if b == strategy), None),
        active_thread_percentage=percent,
        pinned_memory_bytes=memory,
        interval=interval,
        mps_config=sharing.has("mpsConfig"),
        time_slicing_config=sharing.has("timeSlicingConfig"),
    )


def config_for(configs: Sequence[DeviceConfig], request: str) -> DeviceConfig | None:
    """The config that applies to a result of `request`: the last one whose `requests` match."""
    return next((c for c in reversed(configs) if c.applies_to(request)), None)


def _allowed_strategies(share: ClaimShare) -> tuple[Backend, ...]:
    """What a claim may choose on the device: a shared pool's `strategies`; a whole GPU or a MIG instance
    time-slices its claim's processes, as any GPU without MPS does (published as `sharingTimeSlicing`/`sharingMPS`)."""
    return share.device.strategies


def resolve(entry: DeviceConfig | None, shares: Sequence[ClaimShare]) -> Sharing:
    """What one request's devices (`shares`, of one pool) run under with `entry`; ClaimError naming the config and
    the field when the pool does not offer it or it asks more than the claim consumed."""
    if entry is None or not shares:
        return NO_SHARING_CONFIG
    config, where, first = entry.config, entry.where, shares[0]
    pool = first.device.resource.pool
    allowed = _allowed_strategies(first)
    strategy = config.strategy or (pool.backend if pool.shared else "timeSlicing")  # what a claim without one runs
    if strategy not in allowed:
        raise ClaimError(
            f"{where}: sharing.strategy: {strategy} is not offered on device {first.device.name}: {_offer(first)}"
        )
    if config.mps_config and strategy != "mps":
        raise ClaimError(f"{where}: sharing.mpsConfig: only applies to strategy mps (this request runs {strategy})")
    if config.time_slicing_config and strategy != "timeSlicing":
        raise ClaimError(
            f"{where}: sharing.timeSlicingConfig: only applies to strategy timeSlicing (this request runs {strategy})"
        )
    if config.interval not in (None, "Default"):
        raise ClaimError(
            f"{where}: sharing.timeSlicingConfig.interval: {config.interval} cannot be set: {_INTERVAL_REASON}"
        )
    paid = _paid(shares)
    limits = None
    if config.active_thread_percentage is not None or config.pinned_memory_bytes is not None:
        compute = sum(share_compute_percent(s.device.unit, s.shares) for s in shares)
        memory = sum(s.memory_mib for s in shares)
        percent, pinned = config.active_thread_percentage, config.pinned_memory_bytes
        if percent is not None and percent > compute:
            raise ClaimError(
                f"{where}: sharing.mpsConfig.defaultActiveThreadPercentage: {percent} is more than the {compute} % "
                f"the claim consumed ({paid}); at most {compute}"
            )
        pinned_mib = None if pinned is None else pinned // MIB
        if pinned_mib is not None and pinned_mib > memory:
            raise ClaimError(
                f"{where}: sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: {pinned_mib} MiB is more than the "
                f"{memory} MiB the claim consumed ({paid}); at most {memory}Mi"
            )
        limits = ClientLimits(active_thread_percent=percent, pinned_memory_mib=pinned_mib)
    mode = MPS if strategy == "mps" else TIME_SLICED if pool.shared else None
    if mode is mode_of(pool):
        mode = None
    return Sharing(mode=mode, limits=limits, strategy=strategy if mode else "")


def _offer(share: ClaimShare) -> str:
    pool = share.device.resource.pool
    if not pool.shared:
        return (
            f"pool {pool.name} is mode {pool.mode}: no MPS control daemon serves its devices, which time-slice their "
            "claim's processes"
        )
    if not pool.mps:
        return (
            f"pool {pool.name} is backend timeSlicing: no MPS control daemon runs for its GPUs; ask for a device of an "
            "MPS pool (mode mps)"
        )
    return (
        f"pool {pool.name} offers {', '.join(pool.strategies)} (its sharingStrategies): its claims are held to MPS "
        "limits, and a client outside MPS would not be"
    )


def _paid(shares: Sequence[ClaimShare]) -> str:
    return "; ".join(
        f"{s.shares} of {s.device.shares} shares of {s.device.name}"
        if s.device.shared
        else f"the whole {s.device.name}"
        for s in shares[:4]
    )


def _memory_bytes(raw: str) -> int:
    path = "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"
    try:
        value = parse_quantity(raw)
    except ValueError as err:
        raise SchemaError(path, str(err)) from None
    if value < MIB:
        raise SchemaError(path, f"must be at least 1Mi, got {safe_text(raw, 64)}")
    return int(value)


def _bounded(value: Any, path: str, depth: int) -> None:
    """Refuse what no SharingConfig is: nesting deeper than MAX_DEPTH, or a mapping or list of more than MAX_ENTRIES
    (checked before anything else reads it, so a hostile config costs little)."""
    if depth > MAX_DEPTH:
        raise SchemaError(path, f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, Mapping):
        if len(value) > MAX_ENTRIES:
            raise SchemaError(path or "parameters", f"{len(value)} fields, more than {MAX_ENTRIES}")
        for key, item in value.items():
            _bounded(item, join(path, key), depth + 1)
    elif isinstance(value, list):
        if len(value) > MAX_ENTRIES:
            raise SchemaError(path, f"{len(value)} entries, more than {MAX_ENTRIES}")
        for i, item in enumerate(value):
            _bounded(item, f"{path}[{i}]", depth + 1)

"""One resource's allocator: every check of a request, the preferred allocation and the grants, as plain data.

Built from a `Resource` and its part of the node's runtime state (`ResourceHealth`), pure and synchronous: the
device plugin's servicer decodes a request, calls it and encodes the answer; every refusal is an `AllocationError`
with a `Refusal` and a message for the kubelet's event. Repeated calls with the same IDs give the same answer.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..logs import brief, safe_text
from ..model.devices import Device, Resource, Unit
from .devicenodes import DeviceNode, MissingCapability, device_specs
from .modes import ClientLimits, Mount, SharingMode, mode_of
from .placement import preferred_allocation

MAX_DEVICE_ID_BYTES = 256  # share IDs are ~45 bytes; anything far longer is not ours
MAX_CONTAINER_REQUESTS = 64  # the kubelet sends one per call; far more is not a kubelet


class Refusal(enum.Enum):
    """Why a request is refused, whatever the transport: the plugin maps each to a gRPC status code."""

    INVALID = "invalid"  # the request itself is wrong (unknown IDs, shares spanning units, bad sizes)
    PRECONDITION = (
        "precondition"  # the request is fine, the devices are not fit for it now (unhealthy, quarantined, pending)
    )


class AllocationError(Exception):
    """A request the plugin refuses, with why (`code`) and a message for the kubelet's event."""

    def __init__(self, code: Refusal, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ContainerGrant:
    """Everything one container is given: environment, mounts, device nodes and CDI device names."""

    envs: Mapping[str, str]
    mounts: tuple[Mount, ...] = ()
    device_specs: tuple[DeviceNode, ...] = ()
    cdi_devices: tuple[str, ...] = ()  # fully qualified CDI names, <cdiKind>=<UUID>


def check_holding(resource: Resource, holdings: Sequence[tuple[Unit, int]]) -> None:
    """Refuse a holding (which units, how many devices of each) the pool's mode does not allow one container: shares
    spanning units where the mode keeps a container on one, more devices than the mode allows one container, more
    shares of a unit than it has. Pure; `unit_grant` calls it, so both node APIs refuse the same holdings."""
    pool = resource.pool
    mode = mode_of(pool)
    if not holdings:
        raise AllocationError(Refusal.INVALID, f"no devices in the request for {resource.name}")
    over = [(u, k) for u, k in holdings if k < 1 or k > u.replicas]
    if over:
        unit, k = over[0]
        raise AllocationError(
            Refusal.INVALID, f"{resource.name}: {k} devices of {unit.uuid}, which has {unit.replicas}"
        )
    units = [u for u, _ in holdings]
    if len(units) > 1 and not mode.may_span(pool):
        kind = "MIG instances" if units[0].mig else "GPUs"
        per_unit = "; ".join(f"{u.uuid} {k} share{'s' if k > 1 else ''}" for u, k in holdings[:8])
        per_unit += f"; and {len(units) - 8} more" if len(units) > 8 else ""
        raise AllocationError(
            Refusal.INVALID,
            f"shares of {resource.name} span {len(units)} {kind} ({per_unit}); "
            f"all shares of a container must be on one {kind[:-1]}",
        )
    total = sum(k for _, k in holdings)
    if (most := mode.most_per_container(pool)) is not None and total > most:
        raise AllocationError(
            Refusal.INVALID,
            f"{resource.name} uses MPS with strict limits: one share per container, got {total} "
            "(ask for 1, or use mpsLimits: proportional)",
        )


def unit_grant(
    resource: Resource,
    holdings: Sequence[tuple[Unit, int]],
    mps_client_limits: bool | None = None,
    mode: SharingMode | None = None,
    limits: ClientLimits | None = None,
) -> ContainerGrant:
    """What a container gets for `k` devices (shares, or 1 for a whole unit) of each unit: the one place both node
    APIs (the device plugin's Allocate, the DRA driver's NodePrepareResources) build a grant.

    `mps_client_limits`: give an MPS client its own limits from its shares (the pool's `mpsLimits: proportional`
    when None; the DRA driver always does, from the claim's consumed capacity). `mode` and `limits`: a DRA claim's
    SharingConfig (`dra.sharingconfig`, which checks them against the pool): the strategy it runs under, when not the
    pool's mode, and MPS limits below its shares'. A holding the pool's mode does not allow one container is refused
    (`check_holding`)."""
    check_holding(resource, holdings)
    units = [u for u, _ in holdings]
    settings = resource.settings
    visible = ",".join(u.uuid for u in units)
    envs: dict[str, str] = {}
    cdi: tuple[str, ...] = ()
    if settings.device_list_strategy == "cdi":
        # The CDI devices alone say what the container sees. The kubelet merges the CDI devices of every resource a
        # container holds, but keeps one value of an env: a CUDA_VISIBLE_DEVICES here would hide the GPUs of the
        # container's other resource (a container holding both gpu and gpu-share).
        cdi = tuple(f"{settings.cdi_kind}={u.uuid}" for u in units)
    else:
        envs["CUDA_VISIBLE_DEVICES"] = envs["NVIDIA_VISIBLE_DEVICES"] = visible
    try:
        specs = tuple(device_specs(settings.device_root, units)) if settings.device_specs else ()
    except MissingCapability as err:
        raise AllocationError(Refusal.PRECONDITION, f"{resource.name}: {err}") from None
    share_envs, mounts = (mode or mode_of(resource.pool)).grant_facts(resource, holdings, mps_client_limits, limits)
    envs.update(share_envs)
    return ContainerGrant(envs=envs, mounts=mounts, device_specs=specs, cdi_devices=cdi)


@dataclass(frozen=True)
class ResourceHealth:
    """One resource's part of the node's runtime state, as Allocate and ListAndWatch use it: mapped from its units'
    verdicts (`NodeView.resource_health`), never decided here."""

    unhealthy: frozenset[str] = frozenset()  # UUIDs of its units with a fault or a shape that waits: all devices
    quarantined_devices: frozenset[str] = frozenset()  # the free device IDs of its quarantined units
    pending: frozenset[str] = frozenset()  # GPUs kept in their old shape until their holders leave (alloc.pending)
    mps_ready: bool = True  # False: the pool's MPS control daemon is not ready, every device Unhealthy


class PreferredRequest(NamedTuple):
    """One container's GetPreferredAllocation request."""

    available: Sequence[str]
    must_include: Sequence[str]
    size: int


class Allocation(NamedTuple):
    """What one Allocate call grants: a grant per container, in request order."""

    grants: tuple[ContainerGrant, ...]
    device_ids: tuple[str, ...]  # every container's IDs, in request order
    units: tuple[str, ...]  # the UUIDs of the units granted, sorted


class ResourceAllocator:
    """Checks, places and grants the requests of one resource, against its health at one moment."""

    def __init__(self, resource: Resource, health: ResourceHealth = ResourceHealth()) -> None:
        self.resource = resource
        self.health = health

    def check_size(self, containers: Sequence[Sequence[str]]) -> None:
        """Refuse what no kubelet sends before anything is built from it (one call's container requests)."""
        resource = self.resource
        if len(containers) > MAX_CONTAINER_REQUESTS:
            raise AllocationError(
                Refusal.INVALID, f"{len(containers)} container requests in one call (at most {MAX_CONTAINER_REQUESTS})"
            )
        for ids in containers:
            if len(ids) > len(resource.devices):
                raise AllocationError(
                    Refusal.INVALID,
                    f"{len(ids)} device IDs, more than the {len(resource.devices)} devices of {resource.name}",
                )

    def preferred(self, requests: Sequence[PreferredRequest]) -> list[list[str]]:
        """GetPreferredAllocation: the devices to pick for each container request."""
        self.check_size([r.available for r in requests])
        answers = []
        for request in requests:
            _check_preferred(request)
            answers.append(preferred_allocation(self.resource, request.available, request.must_include, request.size))
        return answers

    def allocate(self, containers: Sequence[Sequence[str]]) -> Allocation:
        """Allocate: each container's grant for its device IDs."""
        resource = self.resource
        if not containers:
            raise AllocationError(Refusal.INVALID, f"AllocateRequest for {resource.name} has no container requests")
        self.check_size(containers)
        for ids in containers:
            _check_ids(ids, "devices_ids")
        if not self.health.mps_ready:
            raise AllocationError(
                Refusal.PRECONDITION, f"the MPS control daemon of pool {resource.pool.name} is not ready"
            )
        self._check_pending(containers)
        grants: list[ContainerGrant] = []
        units: set[str] = set()
        for ids in containers:
            grant, granted = self._grant(ids)
            grants.append(grant)
            units.update(u.uuid for u in granted)
        return Allocation(tuple(grants), tuple(i for ids in containers for i in ids), tuple(sorted(units)))

    def grant(self, device_ids: Sequence[str]) -> ContainerGrant:
        """What one container gets for these devices: the devices' checks only, not the request's bounds or the pool's
        state (`allocate` adds those)."""
        return self._grant(device_ids)[0]

    def _check_pending(self, containers: Sequence[Sequence[str]]) -> None:
        pending = self.health.pending
        if not pending:
            return
        devices = self.resource.devices
        waiting = sorted(
            {
                d.gpu.uuid
                for ids in containers
                for i in ids
                if (d := devices.get(i)) is not None and d.gpu.uuid in pending
            }
        )
        if waiting:
            raise AllocationError(
                Refusal.PRECONDITION,
                f"devices of {self.resource.name} on GPU(s) {brief(waiting, 4)} are not granted: those GPUs keep their "
                "previous configuration for the containers that hold them and switch to the new one once released",
            )

    def _grant(self, device_ids: Sequence[str]) -> tuple[ContainerGrant, list[Unit]]:
        resource, health = self.resource, self.health
        ids = sorted(set(device_ids))
        if not ids:
            raise AllocationError(Refusal.INVALID, f"no device IDs in the request for {resource.name}")
        unknown = [i for i in ids if i not in resource.devices]
        if unknown:
            raise AllocationError(Refusal.INVALID, f"unknown device IDs for {resource.name}: {brief(unknown, 8)}")
        devices = [resource.devices[i] for i in ids]
        sick = [d.id for d in devices if d.unit.is_unhealthy(health.unhealthy)] if health.unhealthy else []
        if sick:
            raise AllocationError(
                Refusal.PRECONDITION, f"devices on an unhealthy GPU for {resource.name}: {brief(sick, 8)}"
            )
        quarantined = [i for i in ids if i in health.quarantined_devices] if health.quarantined_devices else []
        if quarantined:
            raise AllocationError(
                Refusal.PRECONDITION,
                f"devices quarantined for {resource.name} (their GPU holds a finished container's memory): "
                f"{brief(quarantined, 8)}",
            )
        units = _units_of(resource, devices)
        return unit_grant(resource, [(u, sum(1 for d in devices if d.unit is u)) for u in units]), units


def _check_ids(ids: Sequence[str], what: str) -> None:
    """Refuse an ID no device of ours could have: error messages stay small and printable."""
    if max(map(len, ids), default=0) <= MAX_DEVICE_ID_BYTES:  # one pass in C: the common case
        return
    device_id = next(i for i in ids if len(i) > MAX_DEVICE_ID_BYTES)
    raise AllocationError(
        Refusal.INVALID,
        f"{what}: a device ID of {len(device_id)} characters (at most {MAX_DEVICE_ID_BYTES}): {safe_text(device_id)}",
    )


def _check_preferred(request: PreferredRequest) -> None:
    _check_ids(request.available, "available_deviceIDs")
    _check_ids(request.must_include, "must_include_deviceIDs")
    if request.size < 1:
        raise AllocationError(Refusal.INVALID, f"allocation_size must be at least 1, got {request.size}")
    must = set(request.must_include)
    if len(must) > request.size:
        raise AllocationError(
            Refusal.INVALID, f"must_include_deviceIDs has {len(must)} IDs, more than allocation_size {request.size}"
        )
    missing = must - set(request.available)
    if missing:
        raise AllocationError(
            Refusal.INVALID, f"must_include_deviceIDs not in available_deviceIDs: {brief(sorted(missing))}"
        )


def _units_of(resource: Resource, devices: list[Device]) -> list[Unit]:
    used = {d.unit.uuid for d in devices}
    return [u for u in resource.units if u.uuid in used]

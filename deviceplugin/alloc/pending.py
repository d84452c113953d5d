"""Held GPUs keep their shape: a new plan is applied to the GPUs nothing holds, the others wait (pure, no transport).

A GPU's *shape* is what it is advertised as: for each of its devices the resource, the device ID, the share count
of its unit and the pool's settings (its GPU selector and place in the file aside). A reload or profile switch that
changes the shape of a GPU on which something holds a device (`Hold`: a container, a prepared DRA claim) would hand
the GPU out a second time — four shares of a GPU a tenant holds whole, or more shares than it has. `reconcile`
applies the new plan to every other GPU and keeps a held GPU in its current shape, *pending*: its devices stay
listed under their old resource (so the kubelet keeps counting them) and the caller advertises them Unhealthy and
refuses them in Allocate, so no new container lands there; once nothing holds it, the next `reconcile` switches it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from ..config.types import GpuSelector, PoolConfig
from ..model.devices import Device, Resource
from ..model.usage import Hold

# (resource, device ID, share count of its unit, pool settings): one advertised device as a GPU's shape sees it
ShapeEntry = tuple[str, str, int, PoolConfig]


@dataclass(frozen=True)
class PendingGpu:
    """A held GPU kept in its current shape until released."""

    uuid: str
    index: int
    holds: tuple[Hold, ...]  # what holds it
    serving: tuple[str, ...]  # the resources its devices stay listed under (empty: left out, shape unknown)
    wanted: tuple[str, ...]  # the resources the new plan gives it
    shape: frozenset[ShapeEntry] = frozenset()  # the shape it keeps (its pool settings as they were)

    def describe(self) -> str:
        """One line for the log and the reload report."""
        holders = sorted({h.holder or f"{h.resource} {h.device}" for h in self.holds})
        shown = ", ".join(holders[:3]) + (f" and {len(holders) - 3} more" if len(holders) > 3 else "")
        keeps = (
            f"keeps {', '.join(self.serving)} (Unhealthy for new containers)" if self.serving else "is not advertised"
        )
        goes = ", ".join(self.wanted) or "no resource"
        return (
            f"GPU {self.index} ({self.uuid}) is held by {len(holders)} holder(s) ({shown}): it {keeps} until "
            f"released, then switches to {goes}"
        )


@dataclass(frozen=True)
class Reconciled:
    resources: list[Resource]  # what to serve now
    pending: dict[str, PendingGpu]  # GPU UUID -> why it waits


def _pool_key(pool: PoolConfig) -> PoolConfig:
    """The pool settings that decide what a GPU's devices are and what Allocate gives for them."""
    return dataclasses.replace(pool, key_path="", gpus=GpuSelector())


def gpu_shapes(resources: Iterable[Resource]) -> dict[str, frozenset[ShapeEntry]]:
    """GPU UUID -> its shape in these resources."""
    shapes: dict[str, set[ShapeEntry]] = {}
    for resource in resources:
        key = _pool_key(resource.pool)
        for device in resource.devices.values():
            shapes.setdefault(device.gpu.uuid, set()).add((resource.name, device.id, device.unit.replicas, key))
    return {uuid: frozenset(entries) for uuid, entries in shapes.items()}


def changing_gpus(
    served: Iterable[Resource], wanted: Iterable[Resource], before: dict[str, PendingGpu] | None = None
) -> frozenset[str]:
    """GPUs whose shape differs between what is served and what is wanted (appearing or going counts); `before` as
    in `reconcile`."""
    old, new = gpu_shapes(served), gpu_shapes(wanted)
    old.update({uuid: p.shape for uuid, p in (before or {}).items() if uuid in old})
    return frozenset(uuid for uuid in old.keys() | new.keys() if old.get(uuid) != new.get(uuid))


def reconcile(
    served: list[Resource], wanted: list[Resource], holds: Iterable[Hold], before: dict[str, PendingGpu] | None = None
) -> Reconciled:
    """The resources to serve: `wanted`, except that a GPU whose shape would change while something holds one of its
    devices keeps its `served` shape (pending). `served` is empty at start-up: a held GPU is then kept only when
    `wanted` has every held device with the share count it was granted in (else it is left out, pending). `before`:
    the previous result's pending GPUs, whose shapes are the ones they keep (their devices may be listed under a
    resource whose pool has changed since)."""
    old, new = gpu_shapes(served), gpu_shapes(wanted)
    old.update({uuid: p.shape for uuid, p in (before or {}).items() if uuid in old})
    gpu_of: dict[str, tuple[str, int]] = {}  # GPU or MIG UUID -> (GPU UUID, GPU index)
    for resource in (*served, *wanted):
        for unit in resource.units:
            gpu_of[unit.uuid] = gpu_of[unit.gpu.uuid] = (unit.gpu.uuid, unit.gpu.index)
    served_devices = {(r.name, d.id): d for r in served for d in r.devices.values()}
    held: dict[str, list[Hold]] = {}
    for hold in holds:
        where = gpu_of.get(hold.unit_uuid)
        if where is not None:
            held.setdefault(where[0], []).append(hold)
    pending: dict[str, PendingGpu] = {}
    for uuid, on_gpu in held.items():
        if not new.get(uuid) or old.get(uuid) == new.get(uuid):
            continue  # the plan grants nothing new on it, or nothing changes
        if uuid not in old and all(_kept(h, served_devices, new.get(uuid, frozenset())) for h in on_gpu):
            continue  # start-up (or a GPU nothing served): the plan keeps every hold as it was granted
        serving = tuple(sorted({entry[0] for entry in old.get(uuid, ())}))
        wants = tuple(sorted({e[0] for e in new[uuid]}))
        pending[uuid] = PendingGpu(uuid, gpu_of[uuid][1], tuple(on_gpu), serving, wants, old.get(uuid, frozenset()))
    if not pending:
        return Reconciled(list(wanted), {})
    resources = []
    kept_names = set()
    for resource in wanted:
        merged = _without(resource, pending)
        old_part = next((r for r in served if r.name == resource.name), None)
        if old_part is not None:
            merged = _with(merged, _only(old_part, pending))
        kept_names.add(resource.name)
        if merged.devices:
            resources.append(merged)
    for resource in served:
        if resource.name not in kept_names:
            part = _only(resource, pending)
            if part.devices:
                resources.append(part)
    return Reconciled(resources, pending)


def _kept(hold: Hold, served: dict[tuple[str, str], Device], shape: frozenset[ShapeEntry]) -> bool:
    """Whether the new shape has this held device, in the share count it was granted in."""
    replicas = hold.replicas
    if replicas is None:
        known = served.get((hold.resource, hold.device))
        replicas = known.unit.replicas if known else (1 if hold.unit_uuid == hold.device else None)
    return replicas is not None and any(
        e[0] == hold.resource and e[1] == hold.device and e[2] == replicas for e in shape
    )


def _without(resource: Resource, pending: dict[str, PendingGpu]) -> Resource:
    units = tuple(u for u in resource.units if u.gpu.uuid not in pending)
    devices = {i: d for i, d in resource.devices.items() if d.gpu.uuid not in pending}
    return dataclasses.replace(resource, units=units, devices=devices)


def _only(resource: Resource, pending: dict[str, PendingGpu]) -> Resource:
    units = tuple(u for u in resource.units if u.gpu.uuid in pending)
    devices = {i: d for i, d in resource.devices.items() if d.gpu.uuid in pending}
    return dataclasses.replace(resource, units=units, devices=devices)


def _with(resource: Resource, part: Resource) -> Resource:
    """`resource` with the (pending) units and devices of `part` added after its own."""
    if not part.devices:
        return resource
    return dataclasses.replace(
        resource, units=resource.units + part.units, devices={**resource.devices, **part.devices}
    )

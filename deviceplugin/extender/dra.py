"""DRA claims for the extender: the gpu-share driver's devices from ResourceSlices, what allocated claims consume,
and what a pod's unallocated claims ask for.

Under DRA, kube-scheduler allocates a claim itself: first fit over pools (sorted by name), slices (by name) and
devices (in slice order), with no scoring. The extender scores nodes for such pods with the same cluster policy
as share pods: each node's gpu-share devices become one resource of units (a device of N `shares` is a unit of
N shares, its free shares N minus what the allocated claims consume), and a claim request of `count` devices with
k shares each becomes `count` containers of k shares, placed first fit as kube-scheduler will place them.

Pure: inputs are the API objects as plain JSON (resource.k8s.io/v1), already decoded. Bounded: at most
`MAX_DEVICES` devices per slice, `MAX_REQUESTS` requests per claim and `MAX_COUNT` devices per request, as the API
allows; anything else is ignored with the reason logged by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kube.dranames import CAPACITY_MEMORY, CAPACITY_SHARES
from ..model.quantity import parse_quantity

MAX_DEVICES = 128  # per slice
MAX_REQUESTS = 32  # per claim
MAX_COUNT = 32  # devices per request
MAX_POD_CLAIMS = 32
FIRST_FIT = "firstfit"  # the unit choice of kube-scheduler's DRA allocator (extender.fit)


@dataclass(frozen=True)
class SliceDevice:
    name: str
    index: int  # the `index` attribute (the GPU), else its position
    shares: int  # the `shares` capacity; 1 for a device without one (exclusive)
    share_bytes: int  # memory of one share (memory capacity / shares), 0 if unknown


@dataclass(frozen=True)
class SliceInfo:
    node: str
    pool: str
    devices: tuple[SliceDevice, ...]


@dataclass(frozen=True)
class ClaimInfo:
    """A ResourceClaim as the extender needs it: what it asks of the driver's classes, and what it holds."""

    uid: str
    requests: tuple[tuple[int, int, int], ...]  # (count, shares, memory bytes) per request of one of our classes
    allocated: bool
    consumed: tuple[tuple[str, str, int, int], ...]  # (pool, device, shares, memory bytes) per result of our driver
    reserved_for: tuple[str, ...]  # pod UIDs


def slice_info(obj: dict, driver: str) -> SliceInfo | None:
    """A ResourceSlice of `driver` on one node; None for another driver's, or one not tied to a node."""
    spec = obj.get("spec") or {}
    if spec.get("driver") != driver or not spec.get("nodeName"):
        return None
    devices = []
    for i, device in enumerate((spec.get("devices") or [])[:MAX_DEVICES]):
        if not isinstance(device, dict) or not device.get("name"):
            continue
        capacity = device.get("capacity") or {}
        shares = _capacity(capacity, CAPACITY_SHARES)
        memory = _capacity(capacity, CAPACITY_MEMORY)
        index = ((device.get("attributes") or {}).get("index") or {}).get("int", i)
        count = shares if shares > 0 and device.get("allowMultipleAllocations") else 1
        devices.append(
            SliceDevice(
                str(device["name"]),
                int(index) if isinstance(index, int) else i,
                count,
                memory // count if memory else 0,
            )
        )
    return SliceInfo(str(spec["nodeName"]), str((spec.get("pool") or {}).get("name", spec["nodeName"])), tuple(devices))


def claim_info(obj: dict, driver: str, classes: frozenset[str]) -> ClaimInfo:
    """A ResourceClaim (or a template's `spec.spec`, with `status` absent)."""
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    allocation = status.get("allocation")
    consumed = []
    if isinstance(allocation, dict):
        for result in ((allocation.get("devices") or {}).get("results") or [])[: MAX_REQUESTS * MAX_COUNT]:
            if not isinstance(result, dict) or result.get("driver") != driver or result.get("adminAccess"):
                continue
            used = result.get("consumedCapacity") or {}
            shared = bool(result.get("shareID"))
            shares = _quantity(used.get(CAPACITY_SHARES)) if shared else -1  # -1: the whole device
            consumed.append(
                (
                    str(result.get("pool", "")),
                    str(result.get("device", "")),
                    shares,
                    _quantity(used.get(CAPACITY_MEMORY)) if shared else 0,
                )
            )
    reserved = tuple(str(r.get("uid", "")) for r in (status.get("reservedFor") or [])[:256] if isinstance(r, dict))
    uid = str((obj.get("metadata") or {}).get("uid", ""))
    return ClaimInfo(uid, claim_requests(spec, classes), isinstance(allocation, dict), tuple(consumed), reserved)


def claim_requests(spec: dict, classes: frozenset[str]) -> tuple[tuple[int, int, int], ...]:
    """(count, shares, memory bytes) of each `exactly` request, ExactCount, for one of `classes` (a claim's spec)."""
    out = []
    for request in ((spec.get("devices") or {}).get("requests") or [])[:MAX_REQUESTS]:
        exactly = request.get("exactly") if isinstance(request, dict) else None
        if not isinstance(exactly, dict) or exactly.get("deviceClassName") not in classes:
            continue
        if exactly.get("allocationMode", "ExactCount") != "ExactCount":
            continue  # All: every device of the node, nothing to choose
        count = exactly.get("count", 1)
        count = count if isinstance(count, int) and 1 <= count <= MAX_COUNT else 1
        wanted = (exactly.get("capacity") or {}).get("requests") or {}
        out.append((count, max(1, _quantity(wanted.get(CAPACITY_SHARES))), _quantity(wanted.get(CAPACITY_MEMORY))))
    return tuple(out)


def shares_of(shares: int, memory: int, share_bytes: int) -> int:
    """The shares one device gives a request or result naming `shares` and/or `memory` (the driver's rule: the
    larger)."""
    by_memory = -(-memory // share_bytes) if memory and share_bytes else 0
    return max(shares, by_memory, 1)


def _capacity(capacity: dict, name: str) -> int:
    entry = capacity.get(name)
    return _quantity(entry.get("value")) if isinstance(entry, dict) else 0


def _quantity(raw: object) -> int:
    if raw is None:
        return 0
    try:
        value = parse_quantity(str(raw))
    except ValueError:
        return 0
    return max(0, int(value.to_integral_value(rounding="ROUND_CEILING")))

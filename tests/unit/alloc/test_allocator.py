"""The allocator of one resource: every refusal with its code and message, the preferred allocation and the grants."""

from __future__ import annotations

from typing import Any

import pytest

from deviceplugin.alloc.allocator import (
    MAX_CONTAINER_REQUESTS,
    MAX_DEVICE_ID_BYTES,
    Allocation,
    AllocationError,
    PreferredRequest,
    Refusal,
    ResourceAllocator,
    ResourceHealth,
)
from deviceplugin.alloc.placement import preferred_allocation
from tests.conftest import node
from tests.support.resources import one_pool, shared

T4 = node("2xT4")
T = [g.uuid for g in T4.gpus]
SHARE = "example.com/gpu-share"


def allocator(pool: dict | None = None, **health: Any) -> ResourceAllocator:
    resource = shared(T4) if pool is None else one_pool(T4, pool)
    return ResourceAllocator(resource, ResourceHealth(**health))


@pytest.mark.parametrize(
    "pool, ids, unhealthy, quarantined, refusal, message",
    [
        ({"name": "s", "mode": "shared", "replicas": 4}, [], (), (), Refusal.INVALID, "no device IDs in the request"),
        ({"name": "s", "mode": "shared", "replicas": 4}, [f"{T[0]}::9"], (), (), Refusal.INVALID, "unknown device IDs"),
        (
            {"name": "s", "mode": "shared", "replicas": 4},
            [f"{T[1]}::0"],
            (T[1],),
            (),
            Refusal.PRECONDITION,
            f"unhealthy GPU .*{T[1]}::0",
        ),
        (
            {"name": "s", "mode": "shared", "replicas": 4},
            [f"{T[1]}::0"],
            (),
            (f"{T[1]}::0",),
            Refusal.PRECONDITION,
            f"devices quarantined for .*{T[1]}::0",
        ),
        ({"name": "e", "mode": "exclusive"}, [T[0]], (T[0],), (), Refusal.PRECONDITION, "unhealthy GPU"),
        ({"name": "e", "mode": "exclusive"}, [T[0]], (), (T[0],), Refusal.PRECONDITION, "devices quarantined for"),
        (
            {"name": "s", "mode": "shared", "replicas": 4},
            [f"{T[0]}::0", f"{T[1]}::0"],
            (),
            (),
            Refusal.INVALID,
            "span 2 GPUs .* must be on one GPU",
        ),
        (
            {"name": "m", "mode": "shared", "backend": "mps", "replicas": 4},
            [f"{T[0]}::0", f"{T[0]}::1"],
            (),
            (),
            Refusal.INVALID,
            "strict limits: one share",
        ),
    ],
)
def test_refusals(pool, ids, unhealthy, quarantined, refusal, message):
    with pytest.raises(AllocationError, match=message) as err:
        allocator(pool, unhealthy=frozenset(unhealthy), quarantined_devices=frozenset(quarantined)).grant(ids)
    assert err.value.code is refusal


@pytest.mark.parametrize("unhealthy, quarantined", [((T[0],), ()), ((), (f"{T[1]}::0",)), ((f"{T[1]}::1",), (T[1],))])
def test_others_health_does_not_refuse(unhealthy, quarantined):
    """Only the requested devices' own health counts: another GPU's, another share's, or a UUID given as an ID."""
    grant = allocator(unhealthy=frozenset(unhealthy), quarantined_devices=frozenset(quarantined)).grant([f"{T[1]}::1"])
    assert grant.envs["CUDA_VISIBLE_DEVICES"] == T[1]


def test_a_device_both_unhealthy_and_quarantined_is_refused_as_unhealthy():
    with pytest.raises(AllocationError, match=f"devices on an unhealthy GPU for {SHARE}: {T[1]}::0"):
        allocator(unhealthy=frozenset({T[1]}), quarantined_devices=frozenset({f"{T[1]}::0"})).grant([f"{T[1]}::0"])


@pytest.mark.parametrize(
    "containers, health, refusal, message",
    [
        ([], {}, Refusal.INVALID, f"AllocateRequest for {SHARE} has no container requests"),
        (
            [[f"{T[0]}::0"]] * (MAX_CONTAINER_REQUESTS + 1),
            {},
            Refusal.INVALID,
            f"{MAX_CONTAINER_REQUESTS + 1} container requests in one call (at most {MAX_CONTAINER_REQUESTS})",
        ),
        ([[f"{T[0]}::0"] * 9], {}, Refusal.INVALID, f"9 device IDs, more than the 8 devices of {SHARE}"),
        (
            [["y" * 300]],
            {},
            Refusal.INVALID,
            f"devices_ids: a device ID of 300 characters (at most {MAX_DEVICE_ID_BYTES}): yyy",
        ),
        ([[f"{T[0]}::0"]], {"mps_ready": False}, Refusal.PRECONDITION, "the MPS control daemon of pool s is not ready"),
        (
            [[f"{T[1]}::0"], [f"{T[0]}::0"]],
            {"pending": frozenset({T[1]}), "unhealthy": frozenset({T[1]})},
            Refusal.PRECONDITION,
            f"devices of {SHARE} on GPU(s) {T[1]} are not granted: those GPUs keep their previous configuration",
        ),
        ([[f"{T[0]}::0"], []], {}, Refusal.INVALID, f"no device IDs in the request for {SHARE}"),
        (
            [[f"{T[0]}::0"], [f"{T[1]}::0"]],
            {"quarantined_devices": frozenset({f"{T[1]}::0"})},
            Refusal.PRECONDITION,
            f"devices quarantined for {SHARE}",
        ),
    ],
)
def test_allocate_refusals(containers, health, refusal, message):
    with pytest.raises(AllocationError) as err:
        allocator(**health).allocate(containers)
    assert err.value.code is refusal and message in err.value.message, err.value.message


def test_bounds_come_before_anything_is_built():
    """An oversized request is refused as such, even when the pool is not ready or its GPUs are pending."""
    with pytest.raises(AllocationError, match="container requests in one call"):
        allocator(mps_ready=False, pending=frozenset({T[0]})).allocate([["GPU-x"]] * (MAX_CONTAINER_REQUESTS + 1))


def test_allocate_grants_each_container_in_request_order():
    a = allocator()
    allocation = a.allocate([[f"{T[1]}::1", f"{T[1]}::0"], [f"{T[0]}::3"]])
    assert allocation == Allocation(
        grants=(a.grant([f"{T[1]}::0", f"{T[1]}::1"]), a.grant([f"{T[0]}::3"])),
        device_ids=(f"{T[1]}::1", f"{T[1]}::0", f"{T[0]}::3"),
        units=tuple(sorted(T)),
    )
    assert (
        allocation.grants[0].envs["CUDA_VISIBLE_DEVICES"] == T[1]
        and allocation.grants[0].envs["GPU_SHARE_COUNT"] == "2"
    )
    assert a.allocate([[f"{T[1]}::1", f"{T[1]}::0"], [f"{T[0]}::3"]]) == allocation  # the same IDs, the same answer


def test_a_pending_gpu_refuses_only_its_own_devices():
    grant = allocator(pending=frozenset({T[1]}), unhealthy=frozenset({T[1]})).allocate([[f"{T[0]}::0"]]).grants[0]
    assert grant.envs["CUDA_VISIBLE_DEVICES"] == T[0]


@pytest.mark.parametrize(
    "request_, message",
    [
        (PreferredRequest([f"{T[0]}::1"], [], 0), "allocation_size must be at least 1, got 0"),
        (
            PreferredRequest([f"{T[0]}::1", f"{T[0]}::2"], [f"{T[0]}::1", f"{T[0]}::2"], 1),
            "must_include_deviceIDs has 2 IDs, more than allocation_size 1",
        ),
        (
            PreferredRequest([f"{T[0]}::1"], [f"{T[0]}::3"], 1),
            f"must_include_deviceIDs not in available_deviceIDs: {T[0]}::3",
        ),
        (PreferredRequest(["x" * 10240], [], 1), "available_deviceIDs: a device ID of 10240 characters (at most 256)"),
        (PreferredRequest([f"{T[0]}::1"], ["x" * 300], 1), "must_include_deviceIDs: a device ID of 300 characters"),
        (PreferredRequest([f"{T[0]}::1"] * 9, [], 1), f"9 device IDs, more than the 8 devices of {SHARE}"),
    ],
)
def test_preferred_refusals(request_, message):
    with pytest.raises(AllocationError) as err:
        allocator().preferred([request_])
    assert err.value.code is Refusal.INVALID and message in err.value.message, err.value.message


def test_preferred_is_the_placement_of_each_container_request():
    resource = shared(T4)
    available = [f"{T[0]}::0", f"{T[1]}::0", f"{T[1]}::1", f"{T[1]}::2"]
    answers = ResourceAllocator(resource).preferred(
        [PreferredRequest(available, [], 2), PreferredRequest(available, [f"{T[0]}::0"], 1)]
    )
    assert answers == [preferred_allocation(resource, available, [], 2), [f"{T[0]}::0"]]
    with pytest.raises(AllocationError, match="container requests in one call"):
        ResourceAllocator(resource).preferred([PreferredRequest(available, [], 1)] * (MAX_CONTAINER_REQUESTS + 1))

"""The DRA device model: one device per unit, capacities that stay proportional, claim results read into shares."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deviceplugin.alloc.allocator import AllocationError
from deviceplugin.dra.devices import ClaimError, claim_share, dra_devices
from deviceplugin.kube.dranames import driver_name
from tests.conftest import node
from tests.support.resources import resources_of


def _devices(pools: list[dict], name: str = "2xT4"):
    info = node(name)
    return info, dra_devices(resources_of({"version": "v1", "pools": pools}, info))


def test_a_shared_gpu_is_one_multi_allocatable_device_with_proportional_capacity() -> None:
    info, devices = _devices([{"name": "s", "mode": "shared", "replicas": 4}])
    assert [d.name for d in devices] == ["gpu-0", "gpu-1"]
    api = devices[0].to_api(driver_name("example.com"), info)
    assert api["allowMultipleAllocations"] is True
    shares, memory = api["capacity"]["shares"], api["capacity"]["memory"]
    assert shares["value"] == "4" and shares["requestPolicy"] == {
        "default": "1",
        "validRange": {"min": "1", "max": "4", "step": "1"},
    }
    one = 15360 // 4 * 1024 * 1024
    assert (
        memory["value"] == str(4 * one)
        and memory["requestPolicy"]["default"] == str(one) == memory["requestPolicy"]["validRange"]["step"]
    )
    assert api["attributes"]["uuid"] == {"string": info.gpus[0].uuid}
    assert api["attributes"]["cudaComputeCapability"] == {"version": "7.5.0"}
    assert api["attributes"]["architecture"] == {"string": "turing"}
    assert api["attributes"]["driverVersion"] == {"version": "550.54.15"}
    assert api["attributes"]["mode"] == {"string": "time-slicing"}


def test_a_driver_version_with_leading_zeros_is_a_semver_and_its_text() -> None:
    info, devices = _devices([{"name": "w", "mode": "exclusive"}])
    info = replace(info, driver_version="570.124.06")
    attributes = devices[0].to_api("gpu-share.example.com", info)["attributes"]
    assert attributes["driverVersion"] == {"version": "570.124.6"}  # semver forbids leading zeros
    assert attributes["driverVersionText"] == {"string": "570.124.06"}  # as nvidia-smi shows it


def test_an_exclusive_gpu_is_not_shared_and_has_no_request_policy() -> None:
    info, devices = _devices([{"name": "w", "mode": "exclusive"}])
    api = devices[1].to_api("gpu-share.example.com", info)
    assert "allowMultipleAllocations" not in api
    assert api["capacity"] == {"memory": {"value": str(15360 * 1024 * 1024)}}


def test_mig_instances_are_devices_named_by_gpu_and_instance() -> None:
    info, devices = _devices([{"name": "m", "mode": "mig"}], name="2xH100-mig-1g")
    assert devices and all(d.name.startswith(f"gpu-{d.unit.gpu.index}-mig-") for d in devices)
    assert len({d.name for d in devices}) == len(devices)
    api = devices[0].to_api("gpu-share.example.com", info)
    assert (
        api["attributes"]["type"] == {"string": "mig"}
        and api["attributes"]["parentUUID"]["string"] == devices[0].unit.gpu.uuid
    )


@pytest.mark.parametrize(
    ("consumed", "shares"),
    [
        ({"shares": "3", "memory": str(3 * 3840 * 1024 * 1024)}, 3),  # both, agreeing
        ({"shares": "1", "memory": "11520Mi"}, 3),  # memory only: 3 shares' worth, shares at its default
        ({"shares": "3", "memory": "3840Mi"}, 3),  # shares only, memory at its default
        ({}, 1),
    ],
)
def test_a_claim_holds_the_larger_of_its_shares_and_its_memory_in_shares(consumed: dict, shares: int) -> None:
    _, devices = _devices([{"name": "s", "mode": "shared", "replicas": 4}])
    held = claim_share(devices[0], consumed, "share-1")
    assert held.shares == shares
    grant = held.grant()
    assert grant.envs["GPU_SHARE_COUNT"] == str(shares) and grant.envs["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(
        3840 * shares
    )


def test_mps_limits_come_from_the_claim() -> None:
    _, devices = _devices(
        [{"name": "p", "mode": "shared", "replicas": 4, "backend": "mps", "mpsLimits": "proportional"}]
    )
    envs = claim_share(devices[0], {"shares": "2"}, "s").grant().envs
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50" and envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=7680M"


def test_a_strict_mps_pool_gives_a_claim_one_share_as_the_device_plugin_does() -> None:
    _, devices = _devices([{"name": "p", "mode": "shared", "replicas": 4, "backend": "mps"}])
    assert claim_share(devices[0], {"shares": "1"}, "s").grant().envs["GPU_SHARE_COUNT"] == "1"
    with pytest.raises(AllocationError, match="uses MPS with strict limits: one share per container, got 2"):
        claim_share(devices[0], {"shares": "2"}, "s").grant()


@pytest.mark.parametrize(
    ("consumed", "share_id", "message"),
    [
        ({"shares": "5"}, "s", "holds 5 shares"),
        ({"memory": "bogus"}, "s", "not a quantity"),
        ({}, None, "no shareID"),
        ({"shares": "-1"}, "s", "negative"),
    ],
)
def test_results_the_driver_cannot_prepare_are_refused_with_a_message(
    consumed: dict, share_id: str | None, message: str
) -> None:
    _, devices = _devices([{"name": "s", "mode": "shared", "replicas": 4}])
    with pytest.raises(ClaimError, match=message):
        claim_share(devices[0], consumed, share_id)

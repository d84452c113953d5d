"""dra.usage: prepared claims (the driver's checkpoint) x pod-resources' dynamic resources -> the agent's usage map."""

from __future__ import annotations

from pathlib import Path

from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.dra import usage as dra_usage
from deviceplugin.dra.prepare import Driver
from deviceplugin.dra.usage import ClaimUsage
from deviceplugin.model.usage import Usage
from tests.conftest import node
from tests.support.dra import DRIVER, claim, make_driver, result

POOL = "2xT4"
T4 = node("2xT4").gpus


def _dynamic(
    name: str, devices: list[tuple[str, str | None]], namespace: str = "default", driver: str = DRIVER, pool: str = POOL
) -> pr.DynamicResource:
    resources = [
        pr.ClaimResource(driver_name=driver, pool_name=pool, device_name=d, share_id=s)
        if s
        else pr.ClaimResource(driver_name=driver, pool_name=pool, device_name=d)
        for d, s in devices
    ]
    return pr.DynamicResource(claim_name=name, claim_namespace=namespace, claim_resources=resources)


def _listing(*pods: tuple[str, dict[str, list[pr.DynamicResource]]]) -> pr.ListPodResourcesResponse:
    return pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name=name,
                namespace="default",
                containers=[pr.ContainerResources(name=c, dynamic_resources=d) for c, d in containers.items()],
            )
            for name, containers in pods
        ]
    )


def _usage(driver: Driver, listing: pr.ListPodResourcesResponse) -> Usage:
    return ClaimUsage(driver.prepared, lambda: driver.devices, DRIVER, POOL)(listing, [])


def test_a_claim_maps_onto_each_container_that_uses_it_with_its_shares_and_memory(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    two = result("gpu-0", shares=2)
    ref, body = claim([two], name="two")
    prepared = driver.prepare(ref, body)
    whole_ref, whole_body = claim(
        [result("gpu-1", shares=1, request="a"), result("gpu-0", shares=1, request="b")], name="mixed"
    )
    mixed = driver.prepare(whole_ref, whole_body)
    listing = _listing(
        (
            "train",
            {
                "main": [_dynamic("two", [("gpu-0", two["shareID"])])],
                "sidecar": [_dynamic("two", [("gpu-0", two["shareID"])])],
                "idle": [],
            },
        ),
        ("multi", {"app": [_dynamic("mixed", [(d.device, d.share_id) for d in mixed.devices])]}),
    )
    usage = _usage(driver, listing)
    by_container = {(s.pod, s.container, s.unit_uuid): s for s in usage.shares}
    main = by_container[("train", "main", T4[0].uuid)]
    assert (main.shares, main.memory_limit_mib, main.resource, main.gpu_uuid) == (
        2,
        prepared.devices[0].memory_mib,
        "example.com/gpu-share",
        T4[0].uuid,
    )
    assert main.time_sliced is False  # an MPS pool enforces memory itself
    assert (
        by_container[("train", "sidecar", T4[0].uuid)].devices == main.devices
    )  # one claim, held once per pod by the meter
    assert {(k[2], s.shares) for k, s in by_container.items() if k[0] == "multi"} == {(T4[0].uuid, 1), (T4[1].uuid, 1)}
    assert len(usage.shares) == 4
    assert usage.active_containers == {
        ("default", "train", "main"),
        ("default", "train", "sidecar"),
        ("default", "train", "idle"),
        ("default", "multi", "app"),
    }


def test_only_claims_both_sides_know_count(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    held = result("gpu-0", shares=1)
    driver.prepare(*claim([held], name="held"))
    driver.prepare(
        *claim([result("gpu-1", shares=3)], name="waiting")
    )  # prepared, its pod not started: holds nothing here
    listing = _listing(
        (
            "p",
            {
                "app": [
                    _dynamic("held", [("gpu-0", held["shareID"])]),
                    _dynamic("unprepared", [("gpu-1", None)]),  # pod-resources knows it, the checkpoint does not
                    _dynamic(
                        "held", [("gpu-0", held["shareID"])], driver="other.example.com/gpu"
                    ),  # another driver's devices
                    _dynamic("held", [("gpu-0", held["shareID"])], namespace="elsewhere"),  # same name, other namespace
                ]
            },
        ),
    )
    usage = _usage(driver, listing)
    assert [(s.container, s.unit_uuid, s.shares) for s in usage.shares] == [("app", T4[0].uuid, 1)]
    assert _usage(driver, _listing()) == Usage()


def test_a_kubelet_without_share_ids_and_admin_access(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    driver.prepare(*claim([result("gpu-0", shares=2)], name="c"))
    admin = result("gpu-1")
    admin["adminAccess"] = True
    driver.prepare(*claim([admin], name="admin"))
    usage = _usage(
        driver,
        _listing(("p", {"app": [_dynamic("c", [("gpu-0", None)]), _dynamic("admin", [("gpu-1", admin["shareID"])])]})),
    )
    assert [(s.unit_uuid, s.shares) for s in usage.shares] == [(T4[0].uuid, 2)]  # admin access holds no share


def test_the_map_is_bounded(tmp_path: Path, monkeypatch) -> None:
    driver = make_driver(tmp_path)
    shared = result("gpu-0", shares=1)
    driver.prepare(*claim([shared], name="c"))
    monkeypatch.setattr(dra_usage, "MAX_SHARES", 3)
    listing = _listing(*((f"p{i}", {"app": [_dynamic("c", [("gpu-0", shared["shareID"])])]}) for i in range(5)))
    assert len(_usage(driver, listing).shares) == 3


def test_a_container_listed_twice_or_a_claim_listed_twice_is_one_holding_counted_once(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    two = result("gpu-0", shares=2)
    driver.prepare(*claim([two], name="two"))
    listed = _dynamic("two", [("gpu-0", two["shareID"])])
    repeated = pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name="train",
                namespace="default",
                containers=[pr.ContainerResources(name="main", dynamic_resources=[listed, listed])] * 2,
            )
        ]
        * 2
    )
    usage = _usage(driver, repeated)
    assert [(s.key, s.unit_uuid, s.shares) for s in usage.shares] == [(("default", "train", "main"), T4[0].uuid, 2)]

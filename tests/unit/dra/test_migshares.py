"""Shares over a dynamic MIG instance (`replicas` on a `strategy: dynamic` pool): published as consumable capacity
beside the counters; the first claim on a device makes its instance, later claims reuse it, each gets its shares'
GPU_SHARE_* facts; the instance is destroyed when the last holder is unprepared, counted from the checkpoint across
restarts, and kept while a damaged record may hold it (fail closed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from deviceplugin.alloc.plan import build_resources
from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.config.parse import parse_config
from deviceplugin.config.types import Config
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.dra.cdi import CdiWriter
from deviceplugin.dra.checkpoint import Checkpoint, MigRecord
from deviceplugin.dra.devices import ClaimError
from deviceplugin.dra.lock import SerialLock
from deviceplugin.dra.migdynamic import MigInstances
from deviceplugin.dra.prepare import ClaimRef, Driver
from deviceplugin.dra.shapes import HeldShapes
from deviceplugin.dra.sharingconfig import api_version
from deviceplugin.dra.usage import ClaimUsage
from deviceplugin.model.devices import Resource
from deviceplugin.model.node import MIB
from deviceplugin.state import NodeState
from tests.support.dra import DRIVER, claim, result
from tests.unit.dra.test_migdynamic import GPU0, POOL, env, h100s

SHARED = parse_config(
    {"version": "v1", "pools": [{"name": "dyn", "mode": "mig", "strategy": "dynamic", "replicas": 4}]}
)
DEVICE = "gpu-0-mig-1g-10gb-6"


def start(tmp_path: Path, inventory: SimulatedInventory, state: NodeState | None = None) -> Driver:
    driver = Driver(
        DRIVER,
        POOL,
        Checkpoint(tmp_path / "claims"),
        CdiWriter(tmp_path / "cdi", DRIVER),
        state or NodeState(),
        SerialLock(tmp_path / "serialize.lock"),
        MigInstances(inventory, inventory.processes),
    )
    driver.on_config(SHARED, build_resources(SHARED, inventory.discover(), dynamic_mig=True))
    driver.sweep_mig()
    return driver


def share(shares: int, device: str = DEVICE, uid: str | None = None, name: str = "c"):
    return claim([result(device, shares=shares, pool=POOL)], uid=uid, name=name)


def test_a_profile_device_is_published_shareable_beside_its_counters(tmp_path: Path) -> None:
    inventory = h100s()
    devices = {d.name: d for d in start(tmp_path, inventory).devices}
    api = devices[DEVICE].to_api(DRIVER, inventory.discover())
    one = 9856 // 4 * MIB  # the 1g.10gb profile's memory, in 4 shares
    assert api["allowMultipleAllocations"] is True and api["consumesCounters"][0]["counterSet"] == "gpu-0-mig"
    assert api["capacity"]["shares"] == {
        "value": "4",
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}},
    }
    assert api["capacity"]["memory"]["value"] == str(4 * one)
    assert api["attributes"]["mode"] == {"string": "time-slicing"}  # as shares of a static MIG instance
    whole = devices["gpu-1"].to_api(DRIVER, inventory.discover())  # MIG mode off: one exclusive GPU, as before
    assert "allowMultipleAllocations" not in whole and set(whole["capacity"]) == {"memory"}
    assert not devices["gpu-1"].shared and devices["gpu-1"].shares == 1


def test_claims_share_the_instance_the_first_made_and_the_last_unprepare_destroys_it(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    (ref_a, body_a), (ref_b, body_b) = share(1, name="a"), share(3, name="b")
    a, b = driver.prepare(ref_a, body_a), driver.prepare(ref_b, body_b)
    (instance,) = inventory.mig_instances(GPU0)
    assert driver.mig.made == 1 and a.devices[0].mig == b.devices[0].mig and a.devices[0].mig.uuid == instance.uuid
    for prepared, shares in ((a, 1), (b, 3)):
        facts = env(prepared.cdi_spec)
        assert facts["NVIDIA_VISIBLE_DEVICES"] == instance.uuid
        assert (facts["GPU_SHARE_COUNT"], facts["GPU_SHARE_TOTAL"]) == (str(shares), "4")
        assert facts["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(9856 * shares // 4) == str(prepared.devices[0].memory_mib)
        assert facts["GPU_SHARE_COMPUTE_PERCENT"] == str(25 * shares)
    with pytest.raises(ClaimError, match=f"device {DEVICE} has 4 shares; prepared claims hold 4"):
        driver.prepare(*share(1, name="over"))  # the ledger: no more than 4 shares, whatever the scheduler did
    assert len(inventory.mig_instances(GPU0)) == 1
    driver.unprepare(ref_a)
    assert inventory.mig_instances(GPU0) == (instance,) and driver.mig.destroyed == 0  # b still holds it
    driver.unprepare(ref_b)
    assert inventory.mig_instances(GPU0) == () and driver.mig.destroyed == 1


def test_the_count_of_holders_survives_a_restart(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    (ref_a, body_a), (ref_b, body_b) = share(2, name="a"), share(2, name="b")
    driver.prepare(ref_a, body_a)
    driver.prepare(ref_b, body_b)
    restarted = start(tmp_path, inventory)  # the sweep: the instance is named by both records
    assert len(inventory.mig_instances(GPU0)) == 1 and restarted.mig.destroyed == 0
    restarted.unprepare(ref_a)
    assert len(inventory.mig_instances(GPU0)) == 1
    start(tmp_path, inventory).unprepare(ref_b)
    assert inventory.mig_instances(GPU0) == ()


def test_a_damaged_record_holds_the_instance_until_it_is_released(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    (ref_a, body_a), (ref_b, body_b) = share(1, name="a"), share(1, name="b")
    driver.prepare(ref_a, body_a)
    driver.prepare(ref_b, body_b)
    (tmp_path / "claims" / f"{ref_b.uid}.json").write_text("{broken")
    restarted = start(tmp_path, inventory)
    restarted.unprepare(ref_a)  # b's record cannot be read: it may hold the instance, which stays
    assert len(inventory.mig_instances(GPU0)) == 1 and restarted.prepared() == []
    restarted.unprepare(ref_b)  # the kubelet unprepares b: released, nothing names the instance any more
    assert len(inventory.mig_instances(GPU0)) == 1 and not restarted.checkpoint.damaged
    start(tmp_path, inventory)  # and the next start-up sweep destroys it (its GPU runs no process)
    assert inventory.mig_instances(GPU0) == ()


def test_an_intent_left_by_a_crash_holds_the_instance_and_is_finished_on_it(tmp_path: Path) -> None:
    """b's prepare wrote its intent on a's instance and crashed: a's unprepare keeps the instance, b's next prepare
    takes it."""
    inventory = h100s()
    driver = start(tmp_path, inventory)
    (ref_a, body_a), (ref_b, body_b) = share(1, name="a"), share(1, name="b")
    a = driver.prepare(ref_a, body_a)
    done = driver.prepare(ref_b, body_b)
    made = a.devices[0].mig
    assert made is not None
    intent = MigRecord(GPU0, made.profile_id, made.start)
    driver.checkpoint.put(
        replace(done, pending=True, cdi_spec="", devices=tuple(replace(d, mig=intent) for d in done.devices))
    )
    restarted = start(tmp_path, inventory)
    restarted.unprepare(ref_a)
    (instance,) = inventory.mig_instances(GPU0)
    again = restarted.prepare(ref_b, body_b)
    assert again.devices[0].mig == made and instance.uuid == made.uuid and restarted.mig.made == 0
    restarted.unprepare(ref_b)
    assert inventory.mig_instances(GPU0) == ()


def test_two_results_of_one_claim_on_one_shared_device_get_one_instance(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    ref, body = claim([result(DEVICE, shares=1, pool=POOL, request=r) for r in ("x", "y")])
    prepared = driver.prepare(ref, body)
    assert len(inventory.mig_instances(GPU0)) == 1 and prepared.devices[0].mig == prepared.devices[1].mig
    driver.unprepare(ref)
    assert inventory.mig_instances(GPU0) == ()


def test_a_failed_prepare_leaves_the_shared_instance_to_its_holders(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    driver.prepare(*share(1, name="a"))
    one = next(p for p in inventory.mig_profiles(GPU0) if p.name == "1g.10gb")
    inventory.create_compute_instance(GPU0, inventory.create_gpu_instance(GPU0, one.id, 0))  # behind the driver's back
    ref, body = claim([result(DEVICE, shares=1, pool=POOL), result("gpu-0-mig-1g-10gb-0", shares=1, pool=POOL)])
    with pytest.raises(ClaimError, match="gpu-0-mig-1g-10gb-0: cannot make MIG instance .* INSUFFICIENT_RESOURCES"):
        driver.prepare(ref, body)  # its first device reused a's instance, its second cannot be made
    assert sorted(i.start for i in inventory.mig_instances(GPU0)) == [0, 6] and ref.uid not in driver.checkpoint


def test_the_agent_meters_each_sharer_on_the_instance_and_the_watchdog_judges_it(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    (ref_a, body_a), (ref_b, body_b) = share(1, name="a"), share(2, name="b")
    made = driver.prepare(ref_a, body_a).devices[0].mig
    driver.prepare(ref_b, body_b)
    assert made is not None

    def pod(ref: ClaimRef) -> pr.PodResources:
        resource = pr.ClaimResource(driver_name=DRIVER, pool_name=POOL, device_name=DEVICE)
        dynamic = pr.DynamicResource(claim_name=ref.name, claim_namespace=ref.namespace, claim_resources=[resource])
        return pr.PodResources(
            name=ref.name,
            namespace=ref.namespace,
            containers=[pr.ContainerResources(name="main", dynamic_resources=[dynamic])],
        )

    listing = pr.ListPodResourcesResponse(pod_resources=[pod(ref_a), pod(ref_b)])
    shares = ClaimUsage(driver.prepared, lambda: driver.devices, DRIVER, POOL)(listing, []).shares
    assert sorted((s.pod, s.unit_uuid, s.shares, s.memory_limit_mib, s.time_sliced) for s in shares) == [
        ("a", made.uuid, 1, 9856 // 4, True),
        ("b", made.uuid, 2, 9856 // 2, True),
    ]


def test_a_reload_changing_the_shares_waits_for_the_instances_holders(tmp_path: Path) -> None:
    """`replicas` 4 -> 2 while a claim holds shares on GPU 0: its devices keep 4 shares until it is unprepared."""
    state, inventory = NodeState(), h100s()
    driver = start(tmp_path, inventory, state)

    def served(replicas: int) -> tuple[Config, list[Resource]]:
        pool = {"name": "dyn", "mode": "mig", "strategy": "dynamic", "replicas": replicas}
        config = parse_config({"version": "v1", "pools": [pool]})
        return config, build_resources(config, inventory.discover(), dynamic_mig=True)

    shapes = HeldShapes(driver, state, [driver], *served(4))
    ref, body = share(1)
    driver.prepare(ref, body)
    shapes.on_config(*served(2))
    assert {d.shares for d in driver.devices if d.partition} == {4} and list(state.snapshot().pending_gpus) == [GPU0]
    driver.unprepare(ref)
    shapes.on_config(*served(2))
    assert {d.shares for d in driver.devices if d.partition} == {2} and not state.snapshot().pending_gpus


def test_a_sharing_config_may_choose_time_slicing_and_its_grant_keeps_the_shares(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)

    def configured(strategy: str, name: str):
        ref, body = share(2, name=name)
        parameters = {"apiVersion": api_version(DRIVER), "kind": "SharingConfig", "sharing": {"strategy": strategy}}
        body["status"]["allocation"]["devices"]["config"] = [
            {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}
        ]
        return ref, body

    with pytest.raises(ClaimError, match=f"sharing.strategy: mps is not offered on device {DEVICE}"):
        driver.prepare(*configured("mps", "mps"))
    assert inventory.mig_instances(GPU0) == ()
    prepared = driver.prepare(*configured("timeSlicing", "ts"))
    facts = env(prepared.cdi_spec)
    assert (facts["GPU_SHARE_COUNT"], facts["GPU_SHARE_TOTAL"]) == ("2", "4") and prepared.devices[0].strategy == ""


def test_a_fault_on_the_instance_taints_its_gpus_devices_and_refuses_new_claims(tmp_path: Path) -> None:
    """A fault (XID) NVML attributes to a dynamic instance is its GPU's on the DRA path (fail closed): the devices
    placed on it, and every other of its GPU, are tainted and refused, until the fault clears."""
    from deviceplugin.dra.health import unhealthy_reason
    from deviceplugin.dra.taints import device_taints
    from deviceplugin.health.monitor import HealthMonitor
    from deviceplugin.model.node import HealthEvent

    inventory, state = h100s(), NodeState()
    driver = start(tmp_path, inventory, state)
    made = driver.prepare(*share(1, name="a")).devices[0].mig
    assert made is not None
    monitor = HealthMonitor(inventory, inventory.discover(), state)
    monitor.handle(HealthEvent(gpu_uuid=GPU0, reason="XID 48", xid=48, mig_uuid=made.uuid))
    view = state.snapshot()
    on_it = next(d for d in driver.devices if d.name == DEVICE)
    assert device_taints(on_it, view, DRIVER) and "XID 48" in (unhealthy_reason(on_it, view) or "")
    other = next(d for d in driver.devices if d.name == "gpu-0-mig-3g-40gb-0")
    assert device_taints(other, view, DRIVER)  # the GPU's: which of its devices the fault spoils is unknown
    with pytest.raises(ClaimError, match=f"device {DEVICE} is Unhealthy: .*MIG instance {made.uuid}.*XID 48"):
        driver.prepare(*share(1, name="b"))
    gpu1 = next(d for d in driver.devices if d.unit.gpu.uuid != GPU0)
    assert not device_taints(gpu1, view, DRIVER)  # another GPU is not touched

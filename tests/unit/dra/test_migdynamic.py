"""Dynamic MIG at prepare and unprepare: instances made and destroyed through the simulated node's NVML model,
recorded before and after, idempotent across restarts, swept at start-up; NVML's refusals are per-claim errors."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from deviceplugin.alloc.plan import build_resources
from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.config.parse import parse_config
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.dra.cdi import CdiWriter
from deviceplugin.dra.checkpoint import Checkpoint, MigRecord
from deviceplugin.dra.claimstatus import device_status
from deviceplugin.dra.devices import ClaimError
from deviceplugin.dra.lock import SerialLock
from deviceplugin.dra.migdynamic import MigInstances, names
from deviceplugin.dra.prepare import ClaimRef, Driver, prepare_claims
from deviceplugin.dra.sharingconfig import api_version
from deviceplugin.dra.usage import ClaimUsage
from deviceplugin.model.mig import MigInstance
from deviceplugin.model.node import Gpu, NodeInfo
from deviceplugin.state import NodeState
from tests.support.dra import DRIVER, MemoryClaims, claim, result

POOL = "h100-node"
GPU0, GPU1 = "GPU-c41e9d27-55a0-4b1f-9e3d-000000000000", "GPU-c41e9d27-55a0-4b1f-9e3d-000000000001"
CONFIG = parse_config({"version": "v1", "pools": [{"name": "dyn", "mode": "mig", "strategy": "dynamic"}]})


def h100s() -> SimulatedInventory:
    """Two H100s: GPU 0 with MIG mode on and no instance, GPU 1 with MIG mode off."""
    gpus = tuple(
        Gpu(
            index=i,
            uuid=u,
            model="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            mig_capable=True,
            mig_enabled=i == 0,
            compute_capability="9.0",
        )
        for i, u in enumerate((GPU0, GPU1))
    )
    return SimulatedInventory(NodeInfo(gpus=gpus, name=POOL))


def start(tmp_path: Path, inventory: SimulatedInventory) -> Driver:
    """The driver as the DRA daemon starts it: configured, then the start-up sweep."""
    driver = Driver(
        DRIVER,
        POOL,
        Checkpoint(tmp_path / "claims"),
        CdiWriter(tmp_path / "cdi", DRIVER),
        NodeState(),
        SerialLock(tmp_path / "serialize.lock"),
        MigInstances(inventory, inventory.processes),
    )
    driver.on_config(CONFIG, build_resources(CONFIG, inventory.discover(), dynamic_mig=True))
    driver.sweep_mig()
    return driver


def mig(device: str, uid: str | None = None):
    return claim([result(device, pool=POOL)], uid=uid)


def env(spec_path: str) -> dict[str, str]:
    spec = json.loads(Path(spec_path).read_text())
    return dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])


def test_prepare_makes_the_instance_the_container_gets_and_unprepare_destroys_it(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    ref, body = mig("gpu-0-mig-3g-40gb-4")
    prepared = driver.prepare(ref, body)
    (instance,) = inventory.mig_instances(GPU0)
    assert (instance.start, instance.size) == (4, 4) and instance.uuid.startswith("MIG-")
    assert env(prepared.cdi_spec)["NVIDIA_VISIBLE_DEVICES"] == instance.uuid
    record = prepared.devices[0].mig
    assert (
        record == MigRecord(GPU0, instance.profile_id, 4, instance.gi_id, instance.ci_id, instance.uuid)
        and not prepared.pending
    )
    assert (
        driver.prepare(ref, body) == prepared and len(inventory.mig_instances(GPU0)) == 1
    )  # idempotent: nothing new made
    assert start(tmp_path, inventory).prepare(ref, body) == prepared  # and after a restart
    driver = start(tmp_path, inventory)
    driver.unprepare(ref)
    driver.unprepare(ref)
    assert inventory.mig_instances(GPU0) == () and driver.prepared() == [] and not Path(prepared.cdi_spec).exists()


def test_the_claims_status_names_the_instance_made_for_it(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    prepared = driver.prepare(*mig("gpu-0-mig-2g-20gb-2"))
    (instance,) = inventory.mig_instances(GPU0)
    (entry,) = device_status(prepared, {d.name: d for d in driver.devices}, DRIVER)
    assert entry["data"] == {
        "version": 1,
        "uuid": instance.uuid,
        "gpu": 0,
        "shares": 1,
        "totalShares": 1,
        "memoryLimitMiB": prepared.devices[0].memory_mib,
    }


@pytest.mark.parametrize(
    ("sharing", "message"),
    [
        ({"strategy": "timeSlicing"}, ""),  # what a MIG instance offers: accepted
        (
            {"strategy": "mps"},
            "sharing.strategy: mps is not offered on device gpu-0-mig-1g-10gb-6: pool dyn is mode mig",
        ),
    ],
)
def test_a_sharing_config_is_checked_before_any_instance_is_made(
    tmp_path: Path, sharing: dict[str, str], message: str
) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    ref, body = mig("gpu-0-mig-1g-10gb-6")
    parameters = {"apiVersion": api_version(DRIVER), "kind": "SharingConfig", "sharing": sharing}
    body["status"]["allocation"]["devices"]["config"] = [
        {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}
    ]
    if not message:
        prepared = driver.prepare(ref, body)
        assert [i.uuid for i in inventory.mig_instances(GPU0)] == [prepared.devices[0].mig.uuid]  # type: ignore[union-attr]
        return
    with pytest.raises(ClaimError, match=message):
        driver.prepare(ref, body)
    assert inventory.mig_instances(GPU0) == () and driver.mig.made == 0 and ref.uid not in driver.checkpoint


def test_a_taken_placement_is_that_claims_error_and_leaves_nothing_behind(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    first = mig("gpu-0-mig-2g-20gb-2")
    driver.prepare(*first)
    taken, free = mig("gpu-0-mig-3g-40gb-0"), mig("gpu-0-mig-3g-40gb-4")
    source = MemoryClaims()
    for ref, body in (taken, free):
        source.api[ref.uid] = body
    outcomes = asyncio.run(prepare_claims(driver, source, [taken[0], free[0]]))
    assert (
        "cannot make MIG instance 3g.40gb at memory slice 0 of GPU 0: NVML INSUFFICIENT_RESOURCES"
        in outcomes[taken[0].uid].error
    )
    assert outcomes[free[0].uid].claim is not None  # the other claim of the batch is prepared
    assert taken[0].uid not in driver.checkpoint and len(inventory.mig_instances(GPU0)) == 2
    assert driver.mig.made == 2


def test_unprepare_while_a_process_runs_is_refused_and_retried(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    ref, body = mig("gpu-0-mig-1g-10gb-6")
    prepared = driver.prepare(ref, body)
    uuid = prepared.devices[0].mig.uuid  # type: ignore[union-attr]
    inventory.add_process(77, GPU0, 500, mig_uuid=uuid)
    with pytest.raises(ClaimError, match="NVML IN_USE .processes still run on it; the kubelet retries"):
        driver.unprepare(ref)
    assert driver.prepared() == [prepared] and Path(prepared.cdi_spec).exists()
    inventory.remove_process(77)
    driver.unprepare(ref)
    assert inventory.mig_instances(GPU0) == () and driver.prepared() == []


@pytest.mark.parametrize("made", ["gpu and compute instance", "gpu instance only"])
def test_a_prepare_cut_short_after_its_intent_is_finished_by_the_next_one(tmp_path: Path, made: str) -> None:
    """A crash after the intent was recorded and the instance (or just its GPU instance) made: the restarted driver's
    sweep keeps it, and the kubelet's next prepare adopts it instead of making another."""
    inventory = h100s()
    driver = start(tmp_path, inventory)
    ref, body = mig("gpu-0-mig-4g-40gb-0")
    done = driver.prepare(ref, body)
    record = done.devices[0].mig
    assert record is not None
    if made == "gpu instance only":
        inventory.destroy_compute_instance(GPU0, record.gi_id or 0, record.ci_id or 0)
    intent = replace(
        done,
        pending=True,
        cdi_spec="",
        devices=tuple(replace(d, cdi_ids=(), mig=MigRecord(GPU0, record.profile_id, 0)) for d in done.devices),
    )
    driver.checkpoint.put(intent)
    restarted = start(tmp_path, inventory)
    assert restarted.mig.destroyed == 0 and len(inventory.mig_instances(GPU0)) == 1
    again = restarted.prepare(ref, body)
    (instance,) = inventory.mig_instances(GPU0)
    assert (
        restarted.mig.made == 0
        and instance.gi_id == record.gi_id
        and again.devices[0].mig == MigRecord(GPU0, record.profile_id, 0, instance.gi_id, instance.ci_id, instance.uuid)
    )
    assert env(again.cdi_spec)["NVIDIA_VISIBLE_DEVICES"] == instance.uuid and not again.pending
    if made == "gpu and compute instance":
        assert instance.uuid == record.uuid


def test_the_start_up_sweep_destroys_instances_of_no_claim_only_on_idle_gpus(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    kept = driver.prepare(*mig("gpu-0-mig-1g-10gb-0"))
    one = next(p for p in inventory.mig_profiles(GPU0) if p.name == "1g.10gb")
    stray = inventory.create_compute_instance(GPU0, inventory.create_gpu_instance(GPU0, one.id, 3))
    inventory.add_process(90, GPU0, 100, mig_uuid=kept.devices[0].mig.uuid)  # type: ignore[union-attr]
    busy = start(tmp_path, inventory)
    assert len(inventory.mig_instances(GPU0)) == 2 and [(u.gi_id, u.why) for u in busy.mig.unclaimed] == [
        (stray.gi_id, "the GPU runs processes")
    ]
    assert busy.mig.kept() == {GPU0: [(one.id, 3)]}  # the slice publisher publishes its slice taken
    inventory.remove_process(90)
    idle = start(tmp_path, inventory)
    assert [i.uuid for i in inventory.mig_instances(GPU0)] == [kept.devices[0].mig.uuid]  # type: ignore[union-attr]
    assert idle.mig.destroyed == 1 and idle.mig.unclaimed == ()


def test_nothing_is_swept_while_a_record_is_damaged(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    ref, _ = mig("gpu-0-mig-1g-10gb-0")
    driver.prepare(ref, mig("gpu-0-mig-1g-10gb-0", uid=ref.uid)[1])
    (tmp_path / "claims" / f"{ref.uid}.json").write_text("{broken")
    restarted = start(tmp_path, inventory)
    assert len(inventory.mig_instances(GPU0)) == 1 and [u.why for u in restarted.mig.unclaimed] == [
        "a checkpoint record is damaged"
    ]


def test_a_gpu_with_mig_off_is_one_whole_exclusive_gpu(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    whole = {d.name: d for d in driver.devices}["gpu-1"]
    assert whole.partition is None and whole.to_api(DRIVER, inventory.discover())["attributes"]["mode"] == {
        "string": "exclusive"
    }
    prepared = driver.prepare(*mig("gpu-1"))
    assert env(prepared.cdi_spec)["NVIDIA_VISIBLE_DEVICES"] == GPU1 and prepared.devices[0].mig is None


def test_the_agent_meters_a_dynamic_claim_on_the_instance_made_for_it(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    ref, body = mig("gpu-0-mig-2g-20gb-4")
    made = driver.prepare(ref, body).devices[0].mig
    assert made is not None
    resource = pr.ClaimResource(driver_name=DRIVER, pool_name=POOL, device_name="gpu-0-mig-2g-20gb-4")
    listing = pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name="p",
                namespace="default",
                containers=[
                    pr.ContainerResources(
                        name="main",
                        dynamic_resources=[
                            pr.DynamicResource(
                                claim_name=ref.name, claim_namespace=ref.namespace, claim_resources=[resource]
                            )
                        ],
                    )
                ],
            )
        ]
    )
    (share,) = ClaimUsage(driver.prepared, lambda: driver.devices, DRIVER, POOL)(listing, []).shares
    assert (share.unit_uuid, share.gpu_uuid, share.memory_limit_mib) == (
        made.uuid,
        GPU0,
        19968,
    )  # the instance, not its GPU


def test_an_instance_made_behind_the_drivers_back_is_noticed_and_published_taken_until_gone(tmp_path: Path) -> None:
    """After start-up (no sweep): `nvidia-smi mig -cgi` makes a 1g at slice 3; the rescan finds it (not a claim's, not
    destroyed), the counters published for GPU 0 take its slice, and once it is gone the placements come back."""
    from deviceplugin.dra.partitions import gpu_counters

    inventory = h100s()
    driver = start(tmp_path, inventory)
    claimed = driver.prepare(*mig("gpu-0-mig-1g-10gb-0"))
    assert driver.rescan_mig() is False and driver.mig.unclaimed == ()  # the claim's instance is named by its record
    one = next(p for p in inventory.mig_profiles(GPU0) if p.name == "1g.10gb")
    behind = inventory.create_compute_instance(GPU0, inventory.create_gpu_instance(GPU0, one.id, 3))
    assert driver.rescan_mig() is True and driver.rescan_mig() is False  # changed once, then steady
    assert [(u.gi_id, u.why) for u in driver.mig.unclaimed] == [(behind.gi_id, "made outside the driver")]
    assert driver.mig.kept() == {GPU0: [(one.id, 3)]}
    gpu = next(g for g in inventory.discover().gpus if g.uuid == GPU0)
    assert gpu_counters(gpu, driver.mig.kept()[GPU0])["memory-slice-3"] == 0  # placements over slice 3 not offered
    assert len(inventory.mig_instances(GPU0)) == 2  # nothing destroyed
    inventory.destroy_compute_instance(GPU0, behind.gi_id, behind.ci_id)
    inventory.destroy_gpu_instance(GPU0, behind.gi_id)
    assert driver.rescan_mig() is True and driver.mig.unclaimed == () and driver.mig.kept() == {}
    assert [i.uuid for i in inventory.mig_instances(GPU0)] == [claimed.devices[0].mig.uuid]  # type: ignore[union-attr]


def _behind(inventory: SimulatedInventory, profile: str, start: int):
    """An instance made behind the driver's back (`nvidia-smi mig -cgi`)."""
    one = next(p for p in inventory.mig_profiles(GPU0) if p.name == profile)
    return inventory.create_compute_instance(GPU0, inventory.create_gpu_instance(GPU0, one.id, start))


def _destroy_behind(inventory: SimulatedInventory, instance) -> None:
    inventory.destroy_compute_instance(GPU0, instance.gi_id, instance.ci_id)
    inventory.destroy_gpu_instance(GPU0, instance.gi_id)


def test_a_stale_record_never_names_the_instance_that_reused_its_gpu_instance_id(tmp_path: Path) -> None:
    """NVML reuses GPU instance IDs: claim A's instance is destroyed outside the driver and claim D's new one, at
    another placement, gets the same ID. A's record names it not (profile, start, MIG UUID differ): unprepare of A
    leaves D's instance, and an instance made behind the driver's back with that ID is noticed by the rescan."""
    inventory = h100s()
    driver = start(tmp_path, inventory)
    a_ref, a_body = mig("gpu-0-mig-1g-10gb-0")
    a = driver.prepare(a_ref, a_body).devices[0].mig
    assert a is not None
    _destroy_behind(inventory, inventory.mig_instances(GPU0)[0])
    d = driver.prepare(*mig("gpu-0-mig-1g-10gb-6")).devices[0].mig
    assert d is not None and (d.gi_id, d.start) == (a.gi_id, 6)  # the ID reused, at another placement
    assert driver.rescan_mig() is False  # D's instance is D's record's, not A's
    driver.unprepare(a_ref)
    assert [i.uuid for i in inventory.mig_instances(GPU0)] == [d.uuid]  # D's instance stands
    driver.unprepare(ClaimRef("default", "c", driver.prepared()[0].uid))
    assert inventory.mig_instances(GPU0) == ()
    # A record whose instance is gone, and an operator's instance with its GPU instance ID elsewhere: not named.
    b_ref, b_body = mig("gpu-0-mig-1g-10gb-0")
    b = driver.prepare(b_ref, b_body).devices[0].mig
    assert b is not None
    _destroy_behind(inventory, inventory.mig_instances(GPU0)[0])
    behind = _behind(inventory, "1g.10gb", 3)
    assert behind.gi_id == b.gi_id
    assert driver.rescan_mig() is True and driver.mig.kept() == {GPU0: [(b.profile_id, 3)]}


def test_a_gpu_whose_instances_cannot_be_listed_is_published_all_taken_until_listed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Unknown is not empty: a failed list (sweep or rescan) publishes the whole GPU taken, logged once while it
    lasts, and nothing on it is swept; a later list brings back what it shows."""
    from deviceplugin.discovery.mig import MigError

    inventory = h100s()
    operator = _behind(inventory, "3g.40gb", 4)  # before start-up, the GPU running a process on it
    inventory.add_process(5, GPU0, 100, mig_uuid=operator.uuid)
    listed, failing = inventory.mig_instances, [True]

    def flaky(uuid: str):
        if failing[0]:
            raise MigError("NVML_ERROR_UNKNOWN", 999)
        return listed(uuid)

    inventory.mig_instances = flaky  # type: ignore[method-assign]
    driver = start(tmp_path, inventory)
    whole = next(p for p in inventory.mig_profiles(GPU0) if p.name == "7g.80gb")
    assert driver.mig.kept() == {GPU0: [(whole.id, 0)]} and driver.mig.unlisted() == [GPU0]
    from deviceplugin.dra.partitions import gpu_counters

    gpu = next(g for g in inventory.discover().gpus if g.uuid == GPU0)
    assert set(gpu_counters(gpu, driver.mig.kept()[GPU0]).values()) == {0}  # nothing of it offered
    assert driver.rescan_mig() is False and driver.mig.kept() == {GPU0: [(whole.id, 0)]}  # still unknown
    assert sum("cannot be listed" in r.message for r in caplog.records) == 1  # said once
    failing[0] = False
    from prometheus_client import CollectorRegistry

    from deviceplugin.obs.drametrics import DraCollector

    registry = CollectorRegistry()
    registry.register(DraCollector(driver, lambda: True))
    gauges = ("gpushare_dra_mig_unlisted_gpus", "gpushare_dra_mig_unclaimed_instances")
    assert [registry.get_sample_value(g) for g in gauges] == [1, 0]
    assert driver.rescan_mig() is True and driver.mig.kept() == {GPU0: [(operator.profile_id, 4)]}
    assert driver.mig.unlisted() == [] and len(listed(GPU0)) == 1  # never swept
    assert [registry.get_sample_value(g) for g in gauges] == [0, 1]
    failing[0] = True
    assert driver.rescan_mig() is True and driver.mig.kept() == {GPU0: [(whole.id, 0)]}


def test_a_gpu_whose_processes_cannot_be_read_keeps_its_stray_instances(tmp_path: Path) -> None:
    """The sweep destroys a stray instance only on a GPU known to run nothing: unreadable processes are busy."""
    inventory = h100s()
    stray = _behind(inventory, "1g.10gb", 6)
    inventory.processes = lambda uuid: None  # type: ignore[method-assign,assignment,return-value]
    driver = start(tmp_path, inventory)
    assert [i.uuid for i in inventory.mig_instances(GPU0)] == [stray.uuid]
    assert [u.why for u in driver.mig.unclaimed] == ["the GPU's processes cannot be read"]


def test_a_failed_reallocation_keeps_the_old_record_without_its_destroyed_instances(tmp_path: Path) -> None:
    """Re-allocated under the same UID to a placement taken behind the driver's back: the old instance was destroyed
    for the new allocation, the old record stays without it (its whole GPU still counted, its CDI spec still
    named), and unprepare then removes everything; nothing leaked, nothing miscounted."""
    inventory = h100s()
    driver = start(tmp_path, inventory)
    ref, body = claim([result("gpu-1", pool=POOL), result("gpu-0-mig-1g-10gb-0", pool=POOL, request="mig")])
    old = driver.prepare(ref, body)
    assert driver.ledger() == {"gpu-1": 1, "gpu-0-mig-1g-10gb-0": 1}
    _behind(inventory, "1g.10gb", 6)
    moved = json.loads(json.dumps(body))
    moved["status"]["allocation"]["devices"]["results"][1]["device"] = "gpu-0-mig-1g-10gb-6"
    with pytest.raises(ClaimError, match="INSUFFICIENT_RESOURCES"):
        driver.prepare(ref, moved)
    kept = driver.checkpoint.get(ref.uid)
    assert kept is not None and not kept.pending and [d.device for d in kept.devices] == ["gpu-1"]
    assert kept.cdi_spec == old.cdi_spec and Path(old.cdi_spec).exists() and driver.ledger() == {"gpu-1": 1}
    assert [i.start for i in inventory.mig_instances(GPU0)] == [6]  # the old one destroyed, none made
    driver.unprepare(ref)
    assert not Path(old.cdi_spec).exists() and driver.prepared() == [] and driver.ledger() == {}
    # With no device left, the old record is released at once.
    ref, body = mig("gpu-0-mig-1g-10gb-0")
    old = driver.prepare(ref, body)
    moved = json.loads(json.dumps(body))
    moved["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-0-mig-1g-10gb-6"
    with pytest.raises(ClaimError, match="INSUFFICIENT_RESOURCES"):
        driver.prepare(ref, moved)
    assert ref.uid not in driver.checkpoint and not Path(old.cdi_spec).exists() and driver.ledger() == {}
    assert [i.start for i in inventory.mig_instances(GPU0)] == [6]


def test_a_refused_destroy_after_another_rewrites_the_record_without_the_dead_instance(tmp_path: Path) -> None:
    inventory = h100s()
    driver = start(tmp_path, inventory)
    ref, body = claim(
        [result("gpu-0-mig-1g-10gb-0", pool=POOL), result("gpu-0-mig-1g-10gb-6", pool=POOL, request="other")]
    )
    prepared = driver.prepare(ref, body)
    busy = prepared.devices[1].mig
    assert busy is not None
    inventory.add_process(7, GPU0, 100, mig_uuid=busy.uuid)
    with pytest.raises(ClaimError, match="IN_USE"):
        driver.unprepare(ref)
    kept = driver.checkpoint.get(ref.uid)
    assert kept is not None and [d.device for d in kept.devices] == ["gpu-0-mig-1g-10gb-6"]
    assert driver.ledger() == {"gpu-0-mig-1g-10gb-6": 1}
    inventory.remove_process(7)
    driver.unprepare(ref)
    assert inventory.mig_instances(GPU0) == () and driver.prepared() == [] and not Path(prepared.cdi_spec).exists()


def test_a_made_record_never_names_a_half_made_instance_at_its_gpu_instance_id() -> None:
    """A GPU instance without a compute instance (no MIG UUID) at a made record's ID, profile and start may be
    another claim's mid-prepare, after NVML gave it the freed ID: the record does not name it, so its unprepare
    destroys nothing (a half-destroyed instance of its own is left to the start-up sweep)."""
    made = MigRecord(gpu="GPU-0", profile_id=19, start=6, gi_id=1, ci_id=0, uuid="MIG-A")
    half_made = MigInstance(gi_id=1, profile_id=19, start=6, size=1, ci_id=None, uuid="")
    assert not names(made, "GPU-0", half_made)
    assert not names(made, "GPU-0", replace(half_made, ci_id=0, uuid="MIG-B"))
    assert names(made, "GPU-0", replace(half_made, ci_id=0, uuid="MIG-A"))
    intent = MigRecord(gpu="GPU-0", profile_id=19, start=6)
    assert names(intent, "GPU-0", half_made)  # an intent names whatever stands at its placement

    class Control:
        destroyed: list[tuple] = []

        def mig_instances(self, gpu: str) -> list[MigInstance]:
            return [half_made]

        def destroy_compute_instance(self, gpu: str, gi: int, ci: int) -> None:
            self.destroyed.append(("ci", gi, ci))

        def destroy_gpu_instance(self, gpu: str, gi: int) -> None:
            self.destroyed.append(("gi", gi))

    control = Control()
    MigInstances(control, lambda _: []).destroy(made)  # type: ignore[arg-type]
    assert control.destroyed == []

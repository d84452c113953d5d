"""The driver's node logic without transport: prepare, repeat, unprepare, the share ledger, health, the checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from deviceplugin.config.parse import parse_config
from deviceplugin.dra.cdi import cdi_kind
from deviceplugin.dra.checkpoint import Checkpoint
from deviceplugin.dra.devices import ClaimError
from deviceplugin.dra.prepare import prepare_claims, unprepare_claims
from deviceplugin.state import NodeState
from tests.support.dra import DRIVER, MemoryClaims, claim, make_driver, node, resources_of, result

T4 = 15360


def _env(spec_path: str, index: int = 0) -> dict[str, str]:
    spec = json.loads(Path(spec_path).read_text())
    return dict(e.split("=", 1) for e in spec["devices"][index]["containerEdits"]["env"])


def test_prepare_writes_a_cdi_spec_with_mps_limits_from_the_consumed_capacity(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    ref, body = claim([result("gpu-1", shares=3, request="gpu/t4")])
    prepared = driver.prepare(ref, body)
    (device,) = prepared.devices
    assert device.request == "gpu" and device.device == "gpu-1" and device.pool == "2xT4" and device.shares == 3
    assert (
        device.cdi_ids == (f"{cdi_kind(DRIVER)}={ref.uid}-0",) and cdi_kind(DRIVER) == "k8s.gpu-share.example.com/claim"
    )
    assert Path(prepared.cdi_spec).name == f"{DRIVER}_{ref.uid}.json"
    env = _env(prepared.cdi_spec)
    assert (
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "75"
        and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={3 * T4 // 4}M"
    )
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == "GPU-8a2f4c1d-3b5e-4f60-a7c8-000000000001"
    assert env["GPU_SHARE_COUNT"] == "3" and env["GPU_SHARE_TOTAL"] == "4" and "CUDA_MPS_PIPE_DIRECTORY" in env
    spec = json.loads(Path(prepared.cdi_spec).read_text())
    assert {m["containerPath"] for m in spec["devices"][0]["containerEdits"]["mounts"]} == {
        env["CUDA_MPS_PIPE_DIRECTORY"],
        "/dev/shm",
    }
    assert driver.ledger() == {"gpu-1": 3}


def test_prepare_again_gives_the_same_answer_and_unprepare_undoes_it_once(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    ref, body = claim([result("gpu-0", shares=2)])
    first = driver.prepare(ref, body)
    assert driver.prepare(ref, body) == first and driver.ledger() == {"gpu-0": 2}
    Path(first.cdi_spec).unlink()  # a reboot emptied the CDI tmpfs; the checkpoint survived
    assert driver.prepare(ref, body) == first and Path(first.cdi_spec).exists()
    Path(first.cdi_spec).write_text("")  # a crash cut it (specs are not fsynced)
    assert driver.prepare(ref, body) == first and _env(first.cdi_spec)["GPU_SHARE_COUNT"] == "2"
    driver.unprepare(ref)
    driver.unprepare(ref)
    assert not Path(first.cdi_spec).exists() and driver.ledger() == {} and driver.prepared() == []


def test_the_ledger_refuses_shares_beyond_the_device_and_a_restart_rebuilds_it(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    driver.prepare(*claim([result("gpu-0", shares=3)]))
    memory_only = claim(
        [result("gpu-0", shares=1, memory=f"{2 * T4 // 4}Mi")]
    )  # names 1 share and 2 shares' memory: gets 2
    with pytest.raises(ClaimError, match="device gpu-0 has 4 shares; prepared claims hold 3 and this claim needs 2"):
        driver.prepare(*memory_only)
    restarted = make_driver(tmp_path)
    assert restarted.ledger() == {"gpu-0": 3}
    with pytest.raises(ClaimError, match="hold 3 and this claim needs 2"):
        restarted.prepare(*memory_only)
    assert restarted.prepare(*claim([result("gpu-0", shares=1)])).devices[0].shares == 1
    assert restarted.ledger() == {"gpu-0": 4}


def test_after_a_reload_to_more_replicas_the_ledger_refuses_by_memory_not_share_counts(tmp_path: Path) -> None:
    """Issue 29's repro: a claim holds 2 of 4 shares (7,680 MiB); a reload to 8 replicas; a claim for 6 of 8
    (11,520 MiB) would put 19,200 MiB on a 15,360 MiB T4. It is refused; 4 of 8 (7,680 MiB) fits and is prepared."""
    shared = [{"name": "s", "mode": "shared", "replicas": 4}]
    driver = make_driver(tmp_path, pools=shared)
    driver.prepare(*claim([result("gpu-0", shares=2)]))
    config = parse_config({"version": "v1", "pools": [{**shared[0], "replicas": 8}]})
    driver.on_config(config, resources_of(config, node("2xT4")))
    with pytest.raises(
        ClaimError,
        match=f"device gpu-0 has {T4} MiB; prepared claims hold {T4 // 2} MiB and this claim needs {6 * T4 // 8} MiB",
    ):
        driver.prepare(*claim([result("gpu-0", shares=6)]))
    assert driver.prepare(*claim([result("gpu-0", shares=4)])).devices[0].memory_mib == T4 // 2
    assert make_driver(tmp_path, pools=[{**shared[0], "replicas": 8}]).prepare(
        *claim([result("gpu-1", shares=8)])
    )  # the other GPU is free
    restarted = make_driver(
        tmp_path, pools=[{**shared[0], "replicas": 8}]
    )  # the memory ledger is rebuilt from the records
    with pytest.raises(ClaimError, match=f"prepared claims hold {T4} MiB"):
        restarted.prepare(*claim([result("gpu-0", shares=1)]))


def test_an_unhealthy_device_is_refused_with_the_monitors_reason(tmp_path: Path) -> None:
    state = NodeState()
    driver = make_driver(tmp_path, state=state)
    gpu1 = driver.devices[1].unit.gpu.uuid
    state.set_health({gpu1: "XID 79 (GPU has fallen off the bus)"})
    with pytest.raises(ClaimError, match=r"device gpu-1 is Unhealthy: GPU 1 .*XID 79"):
        driver.prepare(*claim([result("gpu-1", shares=1)]))
    state.set_quarantine(frozenset({driver.devices[0].unit.gpu.uuid}), frozenset())
    with pytest.raises(ClaimError, match="quarantined by the residue guard"):
        driver.prepare(*claim([result("gpu-0", shares=1)]))
    assert driver.ledger() == {} and not list((tmp_path / "cdi").glob("*.json"))


@pytest.mark.parametrize(
    ("body_change", "message"),
    [
        (lambda b: b["metadata"].update(uid="other"), "got replaced"),
        (lambda b: b["status"].pop("allocation"), "is not allocated"),
        (
            lambda b: b["status"]["allocation"]["devices"]["results"][0].update(pool="node-b"),
            "not on this node's pool 2xT4",
        ),
        (
            lambda b: b["status"]["allocation"]["devices"]["results"][0].update(device="gpu-7"),
            "device gpu-7 is not published",
        ),
        (lambda b: b["status"]["allocation"]["devices"]["results"][0].pop("shareID"), "has no shareID"),
        (
            lambda b: b["status"]["allocation"]["devices"].update(config=[{"opaque": {"driver": DRIVER}}]),
            r"config\[0\] \(no source\): parameters: must be a JSON object",
        ),
        (lambda b: b["status"]["allocation"]["devices"].update(results=[result("gpu-0")] * 33), "more than 32"),
    ],
)
def test_claims_the_driver_cannot_prepare_are_refused_with_a_message(tmp_path: Path, body_change, message: str) -> None:
    driver = make_driver(tmp_path)
    ref, body = claim([result("gpu-0", shares=1)])
    body_change(body)
    with pytest.raises(ClaimError, match=message):
        driver.prepare(ref, body)


def test_a_whole_gpu_is_prepared_for_one_claim_only_and_other_drivers_results_are_left_alone(tmp_path: Path) -> None:
    driver = make_driver(tmp_path, pools=[{"name": "w", "mode": "exclusive"}])
    ref, body = claim([result("gpu-0"), result("gpu-0", driver="other.example.com", pool="x")])
    (device,) = driver.prepare(ref, body).devices
    assert device.shares == 1 and device.share_id is None  # only shares of a multi-allocatable device have one
    with pytest.raises(ClaimError, match="already prepared for another claim"):
        driver.prepare(*claim([result("gpu-0")]))


def test_a_batch_answers_every_claim_and_one_failure_touches_no_other(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    good, bad = claim([result("gpu-0", shares=1)]), claim([result("gpu-9", shares=1)])
    source = MemoryClaims()
    source.put(good[1])
    source.put(bad[1])
    missing = claim([], name="gone")[0]
    outcomes = asyncio.run(prepare_claims(driver, source, [good[0], bad[0], missing, good[0]]))
    assert set(outcomes) == {good[0].uid, bad[0].uid, missing.uid}
    assert outcomes[good[0].uid].claim is not None and not outcomes[good[0].uid].error
    assert "gpu-9 is not published" in outcomes[bad[0].uid].error and "not found" in outcomes[missing.uid].error
    assert unprepare_claims(driver, [good[0], bad[0]]) == {good[0].uid: "", bad[0].uid: ""}


def test_a_corrupt_checkpoint_record_is_moved_aside_and_the_others_load(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    kept, cut = claim([result("gpu-0", shares=1)]), claim([result("gpu-1", shares=2)])
    driver.prepare(*kept)
    driver.prepare(*cut)
    record = tmp_path / "claims" / f"{cut[0].uid}.json"
    record.write_text(record.read_text().replace('"shares":2', '"shares":1'))  # the checksum no longer matches
    checkpoint = Checkpoint(tmp_path / "claims")
    assert [c.uid for c in checkpoint.claims()] == [kept[0].uid]
    assert (tmp_path / "claims" / f"{cut[0].uid}.json.corrupt").exists()


def test_a_rolling_update_twin_sees_the_others_records_under_the_shared_lock(tmp_path: Path) -> None:
    one, two = make_driver(tmp_path), make_driver(tmp_path)
    first = claim([result("gpu-0", shares=3)])
    one.prepare(*first)
    with pytest.raises(ClaimError, match="hold 3 and this claim needs 2"):
        two.prepare(*claim([result("gpu-0", shares=2)]))
    two.unprepare(first[0])
    assert one.prepare(*claim([result("gpu-0", shares=4)])).devices[0].shares == 4


def test_a_twins_write_within_one_mtime_tick_is_still_seen(tmp_path: Path) -> None:
    """The directory's mtime moves in ticks of milliseconds: a twin's record written within the tick after this
    instance last looked leaves the directory's stat unchanged; the record itself is still found."""
    one, two = make_driver(tmp_path), make_driver(tmp_path)
    held = claim([result("gpu-0", shares=1)])
    one.prepare(*held)
    records = tmp_path / "claims"
    seen = os.stat(records)
    late = claim([result("gpu-0", shares=2)])
    two.prepare(*late)
    os.utime(records, ns=(seen.st_atime_ns, seen.st_mtime_ns))  # as if within the same tick
    one.unprepare(late[0])
    assert not (records / f"{late[0].uid}.json").exists() and one.ledger() == {"gpu-0": 1}
    two.prepare(*held)  # the record is the authority for the other instance too
    assert two.ledger() == {"gpu-0": 1}


def test_an_mps_pool_is_held_back_until_its_control_daemon_answers(tmp_path: Path) -> None:
    from deviceplugin.health.mpsready import MpsReadiness

    class Liveness:
        answers = False

        def ready(self, paths) -> bool:
            return self.answers

    state, liveness = NodeState(), Liveness()
    driver = make_driver(tmp_path, state=state)
    readiness = MpsReadiness(state, liveness, [d.resource for d in driver.devices[:1]], interval=1.0)  # type: ignore[arg-type]
    assert state.snapshot().mps_not_ready == {"s"}  # not ready before the first answer
    readiness.check()
    with pytest.raises(ClaimError, match="the MPS control daemon of pool s is not ready"):
        driver.prepare(*claim([result("gpu-0", shares=1)]))
    liveness.answers = True
    readiness.check()
    assert driver.prepare(*claim([result("gpu-0", shares=1)])).devices[0].shares == 1
    readiness.on_config(None, [])  # the pool is gone from the config: no longer held back
    assert state.snapshot().mps_not_ready == frozenset()


def test_claims_not_begun_before_the_deadline_fail_with_a_message(tmp_path: Path) -> None:
    import time

    driver = make_driver(tmp_path)
    ref, body = claim([result("gpu-0", shares=1)])
    source = MemoryClaims()
    source.put(body)
    outcomes = asyncio.run(prepare_claims(driver, source, [ref], deadline=time.monotonic() - 1))
    assert "deadline was near" in outcomes[ref.uid].error and driver.ledger() == {}


def test_two_instances_serialise_on_the_lock_file(tmp_path: Path) -> None:
    import threading

    from deviceplugin.dra.lock import SerialLock

    first, second = (
        SerialLock(tmp_path / "serialize.lock"),
        SerialLock(tmp_path / "serialize.lock"),
    )  # two open file descriptions
    entered = threading.Event()

    def take() -> None:
        with second:
            entered.set()

    with first:
        thread = threading.Thread(target=take)
        thread.start()
        assert not entered.wait(0.3)  # held by the other instance
    assert entered.wait(5)
    thread.join()


def test_rolling_update_socket_names_carry_the_pod_uid() -> None:
    from deviceplugin.dra.registration import PluginPaths

    plain = PluginPaths(Path("/var/lib/kubelet/plugins_registry"), Path("/var/lib/kubelet/plugins"), DRIVER)
    twin = PluginPaths(plain.registrar_dir, plain.plugins_dir, DRIVER, instance="0b9a-uid")
    assert (str(plain.dra_socket), str(plain.registration_socket)) == (
        "/var/lib/kubelet/plugins/gpu-share.example.com/dra.sock",
        "/var/lib/kubelet/plugins_registry/gpu-share.example.com-reg.sock",
    )
    assert (twin.dra_socket.name, twin.registration_socket.name) == (
        "dra-0b9a-uid.sock",
        "gpu-share.example.com-0b9a-uid-reg.sock",
    )
    assert twin.checkpoint == plain.checkpoint  # the records are shared


def test_the_devices_of_one_request_share_one_cdi_device_so_a_container_sees_them_all(tmp_path: Path) -> None:
    driver = make_driver(tmp_path, [{"name": "s", "mode": "shared", "replicas": 4, "allowSpanGPUs": True}])
    gpus = ("GPU-8a2f4c1d-3b5e-4f60-a7c8-000000000000", "GPU-8a2f4c1d-3b5e-4f60-a7c8-000000000001")
    ref, body = claim(
        [
            result("gpu-0", shares=1, request="two"),
            result("gpu-1", shares=2, request="two"),
            result("gpu-1", shares=1, request="one"),
        ]
    )
    prepared = driver.prepare(ref, body)
    kind = cdi_kind(DRIVER)
    assert [d.cdi_ids for d in prepared.devices] == [(f"{kind}={ref.uid}-0",), (), (f"{kind}={ref.uid}-1",)]
    two, one = _env(prepared.cdi_spec, 0), _env(prepared.cdi_spec, 1)
    assert (
        two["NVIDIA_VISIBLE_DEVICES"] == two["CUDA_VISIBLE_DEVICES"] == ",".join(gpus) and two["GPU_SHARE_COUNT"] == "3"
    )
    assert two["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(T4 // 4 + 2 * T4 // 4)
    assert one["NVIDIA_VISIBLE_DEVICES"] == gpus[1] and one["GPU_SHARE_COUNT"] == "1"
    assert driver.ledger() == {"gpu-0": 1, "gpu-1": 3}
    Path(prepared.cdi_spec).unlink()
    assert driver.prepare(ref, body) == prepared and _env(prepared.cdi_spec, 0) == two  # rewritten the same way


def test_a_grant_the_allocator_refuses_is_a_claim_error_with_its_message(tmp_path: Path) -> None:
    """A MIG device whose capability nodes cannot be read (deviceSpecs): the device plugin's AllocationError, as a
    ClaimError naming the claim, never an internal error."""
    from deviceplugin.alloc.plan import build_resources
    from deviceplugin.config.parse import parse_config
    from deviceplugin.dra.cdi import CdiWriter
    from deviceplugin.dra.lock import SerialLock
    from deviceplugin.dra.prepare import Driver
    from tests.conftest import node

    info = node("8xA100-80GB-mig")
    config = parse_config(
        {
            "version": "v1",
            "deviceSpecs": True,
            "deviceRoot": str(tmp_path / "root"),
            "pools": [{"name": "m", "mode": "mig", "gpus": {"indexes": [2]}}],
        }
    )
    driver = Driver(
        DRIVER,
        info.name,
        Checkpoint(tmp_path / "claims"),
        CdiWriter(tmp_path / "cdi", DRIVER),
        NodeState(),
        SerialLock(tmp_path / "serialize.lock"),
    )
    driver.on_config(config, build_resources(config, info))
    ref, body = claim([result(driver.devices[0].name, pool=info.name)])
    with pytest.raises(ClaimError, match=rf"claim {ref}: .*cannot read MIG capability"):
        driver.prepare(ref, body)
    source = MemoryClaims()
    source.put(body)
    outcome = asyncio.run(prepare_claims(driver, source, [ref]))[ref.uid]
    assert (
        outcome.claim is None and outcome.error.startswith(f"claim {ref}: ") and "internal error" not in outcome.error
    )

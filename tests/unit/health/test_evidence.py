"""Reset evidence survives a restart of the health monitor (a new process reads the file the old one wrote), is
cleared only by the driver's evidence of a reset or a reboot, and an unusable file fails closed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.health.evidence import (
    MAX_BYTES,
    MAX_ENTRIES,
    MAX_REASON_CHARS,
    MAX_UUID_CHARS,
    Evidence,
    EvidenceFile,
)
from deviceplugin.health.monitor import HealthMonitor, HealthSettings
from deviceplugin.state import NodeState
from tests.conftest import EXAMPLES
from tests.support.clock import ManualClock

NODE = EXAMPLES / "nodes" / "2xT4.yaml"


class Boot:
    """The kernel's boot ID, as a test sets it."""

    def __init__(self) -> None:
        self.id: str | None = "boot-1"

    def __call__(self) -> str | None:
        return self.id


def monitor(path: Path, boot: Boot, inventory: SimulatedInventory | None = None) -> HealthMonitor:
    """A health monitor as a fresh process builds it: a new NodeState, the evidence file at `path`."""
    inventory = inventory or SimulatedInventory.from_file(NODE)
    settings = HealthSettings(evidence_file=path)
    made = HealthMonitor(inventory, inventory.discover(), NodeState(), settings, clock=ManualClock(), boot_id=boot)
    return made


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "gpu-share" / "reset-evidence.json"


def test_an_xid_79_gpu_stays_unhealthy_after_a_restart_until_the_driver_shows_a_reset(path):
    boot = Boot()
    inventory = SimulatedInventory.from_file(NODE)
    gpu = inventory.discover().gpus[0].uuid
    first = monitor(path, boot, inventory)
    inventory.inject_xid(gpu, 79)
    first.handle(inventory.wait_for_event(1.0))
    assert json.loads(path.read_text())["evidence"][gpu] == {"gpu": gpu, "reason": "XID 79", "resetRequiredSeen": False}

    second = monitor(path, boot, inventory)  # the restart: nothing in memory, the same file
    view = second.state.snapshot()
    assert view.reasons == {gpu: "XID 79"} and view.awaiting_reset == {gpu}
    inventory.set_reset_required(gpu, True)
    second.check(0.0)
    assert json.loads(path.read_text())["evidence"][gpu]["resetRequiredSeen"] is True  # kept for the next restart
    third = monitor(path, boot, inventory)
    inventory.set_reset_required(gpu, False)  # the reset happened while no process watched
    third.check(0.0)
    assert third.state.snapshot().unhealthy == frozenset()
    assert json.loads(path.read_text())["evidence"] == {}
    assert monitor(path, boot, inventory).state.snapshot().unhealthy == frozenset()


def test_a_driver_that_cannot_tell_keeps_the_gpu_held_across_restarts(path):
    boot = Boot()
    inventory = SimulatedInventory.from_file(NODE)
    gpu = inventory.discover().gpus[1].uuid
    first = monitor(path, boot, inventory)
    inventory.inject_xid(gpu, 48)
    first.handle(inventory.wait_for_event(1.0))
    for _ in range(3):
        restarted = monitor(path, boot, inventory)
        restarted.check(10_000.0)  # far past the quiet period: a reset-class fault does not heal by time
        assert restarted.state.snapshot().awaiting_reset == {gpu}


def test_a_reboot_clears_the_evidence(path):
    boot = Boot()
    inventory = SimulatedInventory.from_file(NODE)
    gpu = inventory.discover().gpus[0].uuid
    first = monitor(path, boot, inventory)
    inventory.inject_xid(gpu, 79)
    first.handle(inventory.wait_for_event(1.0))
    boot.id = "boot-2"
    assert monitor(path, boot, inventory).state.snapshot().unhealthy == frozenset()


def test_without_a_boot_id_the_evidence_is_kept(path):
    boot = Boot()
    gpu = SimulatedInventory.from_file(NODE).discover().gpus[0].uuid
    EvidenceFile(path, boot).save({gpu: Evidence(gpu, gpu, "XID 79")})
    boot.id = None  # /proc unreadable: no proof of a reboot
    assert monitor(path, boot).state.snapshot().awaiting_reset == {gpu}


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"version": 2, "evidence": {}}',
        b'{"version": 1, "evidence": {"GPU-x": {"gpu": 7}}}',
        b"\xff\xfe",
        b" " * (MAX_BYTES + 1),
    ],
)
def test_an_unusable_file_holds_every_gpu_and_is_kept_aside(path, content):
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    restarted = monitor(path, Boot())
    view = restarted.state.snapshot()
    gpus = {g.uuid for g in restarted.node.gpus}
    assert view.awaiting_reset == gpus and set(view.reasons.values()) == {"reset evidence unreadable"}
    assert view.evidence_errors == 1
    assert path.with_name(path.name + ".corrupt").read_bytes() == content  # for the operator
    assert set(json.loads(path.read_text())["evidence"]) == gpus  # the hold itself is now on record


def test_the_field_named_in_the_problem():
    from deviceplugin.health.evidence import _parse

    with pytest.raises(ValueError, match=r"evidence\['GPU-x'\]\.resetRequiredSeen: not true or false"):
        _parse({"version": 1, "evidence": {"GPU-x": {"gpu": "GPU-x", "reason": "XID 79", "resetRequiredSeen": "yes"}}})


def test_evidence_of_a_gpu_not_on_the_node_is_carried_not_shown(path):
    boot = Boot()
    EvidenceFile(path, boot).save({"GPU-gone": Evidence("GPU-gone", "GPU-gone", "GPU is lost")})
    inventory = SimulatedInventory.from_file(NODE)
    gpu = inventory.discover().gpus[0].uuid
    restarted = monitor(path, boot, inventory)  # discovery left that GPU out (it was lost at start-up)
    assert restarted.state.snapshot().unhealthy == frozenset()
    inventory.inject_xid(gpu, 79)
    restarted.handle(inventory.wait_for_event(1.0))
    assert set(json.loads(path.read_text())["evidence"]) == {"GPU-gone", gpu}  # the next restart still knows both


def test_evidence_of_an_instance_not_listed_holds_its_gpu_until_a_reset(path):
    """A reset-class fault on a MIG instance discovery does not list after the restart (a dynamic instance, or one
    destroyed since) is still its GPU's: held (NodeView.instance_gpus) until the driver shows the GPU reset."""
    boot = Boot()
    inventory = SimulatedInventory.from_file(NODE)
    gpu = inventory.discover().gpus[0].uuid
    EvidenceFile(path, boot).save({"MIG-gone": Evidence("MIG-gone", gpu, "XID 95")})
    restarted = monitor(path, boot, inventory)
    view = restarted.state.snapshot()
    assert view.awaiting_reset == {"MIG-gone"} and dict(view.instance_gpus) == {"MIG-gone": gpu}
    inventory.set_reset_required(gpu, True)
    restarted.check(0.0)
    inventory.set_reset_required(gpu, False)
    restarted.check(0.0)
    assert restarted.state.snapshot().unhealthy == frozenset() and json.loads(path.read_text())["evidence"] == {}


def test_a_failed_write_is_counted_and_retried(path):
    inventory = SimulatedInventory.from_file(NODE)
    gpu = inventory.discover().gpus[0].uuid
    first = monitor(path, Boot(), inventory)
    path.parent.write_text("")  # a file where the directory should be: every write fails
    inventory.inject_xid(gpu, 79)
    first.handle(inventory.wait_for_event(1.0))
    assert first.state.snapshot().evidence_errors == 1 and first.state.snapshot().awaiting_reset == {gpu}
    path.parent.unlink()  # the operator fixes the host path
    first.check(0.0)
    assert gpu in json.loads(path.read_text())["evidence"]


def test_with_health_checks_off_the_evidence_is_neither_read_nor_written(path):
    gpu = SimulatedInventory.from_file(NODE).discover().gpus[0].uuid
    EvidenceFile(path, Boot()).save({gpu: Evidence(gpu, gpu, "XID 79")})
    inventory = SimulatedInventory.from_file(NODE)
    settings = HealthSettings(enabled=False, evidence_file=path)
    off = HealthMonitor(inventory, inventory.discover(), NodeState(), settings, clock=ManualClock(), boot_id=Boot())
    assert off.state.snapshot().unhealthy == frozenset()  # as --health-checks=false says: every GPU advertised Healthy
    assert gpu in json.loads(path.read_text())["evidence"]  # kept for when checks are on again


def test_the_largest_file_save_writes_loads_back(path):
    """MAX_ENTRIES entries of the longest UUIDs and reasons, every character escaped in JSON: still under MAX_BYTES."""
    boot = Boot()
    uuid = lambda i: f"{i:03d}" + "\u00e9" * (MAX_UUID_CHARS - 3)  # noqa: E731
    entries = {
        uuid(i): Evidence(uuid(i), uuid(i), "\u00e9" * (MAX_REASON_CHARS + 50), True) for i in range(MAX_ENTRIES + 10)
    }
    entries["GPU-" + "x" * MAX_UUID_CHARS] = Evidence(
        "GPU-" + "x" * MAX_UUID_CHARS, "GPU-x", "XID 79"
    )  # cannot be NVML's
    EvidenceFile(path, boot).save(entries)
    assert MAX_BYTES // 2 < path.stat().st_size <= MAX_BYTES
    loaded = EvidenceFile(path, boot).load()
    assert loaded.problem is None and len(loaded.entries) == MAX_ENTRIES
    assert all(len(e.reason) == MAX_REASON_CHARS for e in loaded.entries.values())

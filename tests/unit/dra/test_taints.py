"""Device taints from the node state: reason classes, MIG instances inheriting their GPU's, quarantine, MPS."""

from __future__ import annotations

import pytest

from deviceplugin.config.parse import parse_config
from deviceplugin.dra.devices import dra_devices
from deviceplugin.dra.taints import device_taints
from deviceplugin.state import GPU_LOST, QUERY_FAILED, RESET_REQUIRED, XID, NodeState, fault_kind
from tests.conftest import node
from tests.support.resources import resources_of

DRIVER = "gpu-share.example.com"


@pytest.mark.parametrize(
    ("reason", "awaiting_reset", "value"),
    [
        ("XID 79", True, RESET_REQUIRED),
        ("XID 31", False, XID),
        ("double-bit ECC error", True, RESET_REQUIRED),
        ("GPU is lost", True, GPU_LOST),
        ("query on GPU GPU-1 failed: GPU is lost", False, GPU_LOST),
        ("NVML query on GPU GPU-1 failed: Unknown Error", False, QUERY_FAILED),
        ("the driver requires a GPU reset", True, RESET_REQUIRED),
    ],
)
def test_a_reason_has_one_class(reason: str, awaiting_reset: bool, value: str) -> None:
    assert fault_kind(reason, awaiting_reset) == value


def test_mig_instances_inherit_their_gpus_taint_and_only_the_named_instance_is_tainted_alone() -> None:
    info = node("2xH100-mig-1g")
    devices = dra_devices(resources_of({"version": "v1", "pools": [{"name": "m", "mode": "mig"}]}, info))
    state = NodeState()
    gpu0 = info.gpus[0]
    one = next(d for d in devices if d.unit.gpu.index == 1)
    state.set_health({gpu0.uuid: "XID 79", one.unit.uuid: "XID 94"}, frozenset({gpu0.uuid}))
    view = state.snapshot()
    tainted = {d.name: device_taints(d, view, DRIVER) for d in devices}
    for d in devices:
        if d.unit.gpu.index == 0:
            assert tainted[d.name] == [
                {"key": f"{DRIVER}/unhealthy", "value": "reset-required", "effect": "NoSchedule"}
            ]
        elif d is one:
            assert tainted[d.name] == [{"key": f"{DRIVER}/unhealthy", "value": "xid", "effect": "NoSchedule"}]
        else:
            assert tainted[d.name] == []


def test_quarantine_and_an_unready_mps_pool_are_taints_of_their_own() -> None:
    info = node("2xT4")
    config = parse_config(
        {"version": "v1", "pools": [{"name": "p", "mode": "shared", "replicas": 4, "backend": "mps"}]}
    )
    devices = dra_devices(resources_of(config, info))
    state = NodeState()
    state.set_quarantine(frozenset({info.gpus[1].uuid}), frozenset())
    state.set_mps_ready("p", False)
    view = state.snapshot()
    assert [t["key"] for t in device_taints(devices[0], view, DRIVER)] == [f"{DRIVER}/mps-unavailable"]
    assert [(t["key"], t["value"]) for t in device_taints(devices[1], view, DRIVER)] == [
        (f"{DRIVER}/quarantined", "residue"),
        (f"{DRIVER}/mps-unavailable", "control-daemon"),
    ]

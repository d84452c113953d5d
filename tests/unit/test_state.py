"""state.NodeView.verdict: one answer to "may this unit take new work", and what each consumer shows for it.

Each verdict kind runs through every consumer that maps from it: the device plugin's ResourceHealth, the DRA health
stream, the DRA taints, prepare's refusal and the labels' and annotation's health. The flow tests of NodeState are
in tests/test_state.py.
"""

from __future__ import annotations

import pytest

from deviceplugin.agent.publish import published_unhealthy
from deviceplugin.config.parse import parse_config
from deviceplugin.dra.devices import dra_devices
from deviceplugin.dra.health import device_health
from deviceplugin.dra.taints import device_taints
from deviceplugin.kube.labels import inventory
from deviceplugin.model.usage import Usage
from deviceplugin.state import (
    GPU_LOST,
    KINDS,
    MPS_DOWN,
    QUARANTINED,
    QUERY_FAILED,
    RESET_REQUIRED,
    SHAPE_PENDING,
    XID,
    NodeState,
)
from tests.conftest import node
from tests.support.resources import resources_of

DRIVER = "gpu-share.example.com"
T4 = node("2xT4")
GPU0 = T4.gpus[0].uuid
CONFIG = parse_config({"version": "v1", "pools": [{"name": "p", "mode": "shared", "replicas": 4, "backend": "mps"}]})
RESOURCES = resources_of(CONFIG, T4)


def _state(kind: str) -> NodeState:
    state = NodeState()
    faults = {
        GPU_LOST: ("GPU is lost", True),
        RESET_REQUIRED: ("XID 79", True),
        XID: ("XID 31", False),
        QUERY_FAILED: ("device node /dev/nvidia0 is missing", False),
    }
    if kind in faults:
        reason, reset = faults[kind]
        state.set_health({GPU0: reason}, frozenset({GPU0}) if reset else frozenset())
    elif kind == QUARANTINED:
        state.set_quarantine(frozenset({GPU0}), frozenset(d for d in RESOURCES[0].devices if d.startswith(GPU0)))
    elif kind == MPS_DOWN:
        state.set_mps_ready("p", False)
    elif kind == SHAPE_PENDING:
        state.set_pending({GPU0: "GPU 0 is held by 1 holder(s): it keeps p until released"})
    return state


# kind -> (device plugin Unhealthy, DRA health stream healthy, taint (name, value), prepare refuses, annotation health)
TABLE = {
    "": (False, True, None, False, "Healthy"),
    GPU_LOST: (True, False, ("unhealthy", "gpu-lost"), True, "Unhealthy"),
    RESET_REQUIRED: (True, False, ("unhealthy", "reset-required"), True, "Unhealthy"),
    XID: (True, False, ("unhealthy", "xid"), True, "Unhealthy"),
    QUERY_FAILED: (True, False, ("unhealthy", "query-failed"), True, "Unhealthy"),
    QUARANTINED: (True, False, ("quarantined", "residue"), True, "Quarantined"),
    MPS_DOWN: (True, False, ("mps-unavailable", "control-daemon"), True, "Unhealthy"),
    SHAPE_PENDING: (True, True, None, True, "Unhealthy"),  # DRA: the old shape stays published, prepare refuses
}


def test_the_table_covers_every_kind() -> None:
    assert set(TABLE) - {""} == set(KINDS)


@pytest.mark.parametrize("kind", list(TABLE))
def test_every_consumer_shows_what_the_one_verdict_says(kind: str) -> None:
    dp_unhealthy, dra_healthy, taint, refused, shown = TABLE[kind]
    view = _state(kind).snapshot()
    resource = RESOURCES[0]
    device = next(d for i, d in resource.devices.items() if i.startswith(GPU0))
    dra = next(d for d in dra_devices(RESOURCES) if d.unit.gpu.uuid == GPU0)

    verdict = view.verdict(device.unit, resource.pool)
    assert verdict.kinds() == ((kind,) if kind else ())
    assert verdict.ok == (not refused)  # prepare refuses on any finding (dra.prepare)

    health = view.resource_health(resource)
    assert (device.is_unhealthy(health.unhealthy, health.quarantined_devices) or not health.mps_ready) == dp_unhealthy

    assert device_health([dra], view)[0].healthy == dra_healthy
    taints = [(t["key"].removeprefix(f"{DRIVER}/"), t["value"]) for t in device_taints(dra, view, DRIVER)]
    assert taints == ([taint] if taint else [])

    annotation = inventory(T4, RESOURCES, Usage(), published_unhealthy(view, RESOURCES), view.quarantined_gpus)
    unit = next(u for u in annotation["resources"][resource.name]["units"] if u["uuid"] == GPU0)
    assert unit["health"] == shown

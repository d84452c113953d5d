"""state.NodeView.verdict: one answer to "may this unit take new work", and what each consumer shows for it.

Each verdict kind runs through every consumer that maps from it: the device plugin's ResourceHealth (ListAndWatch
and Allocate), the DRA health stream, the DRA taints, prepare's refusal, the labels' and annotation's health and the
per-GPU metrics. The flow tests of NodeState are in tests/test_state.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from deviceplugin.agent.publish import published_unhealthy
from deviceplugin.agent.residue import quarantined_devices
from deviceplugin.alloc.allocator import AllocationError, Refusal, ResourceAllocator
from deviceplugin.config.parse import parse_config
from deviceplugin.dra.devices import dra_devices
from deviceplugin.dra.health import device_health
from deviceplugin.dra.taints import device_taints
from deviceplugin.kube.labels import inventory
from deviceplugin.model.devices import Device, Resource
from deviceplugin.model.usage import Usage
from deviceplugin.obs.metrics import MetricSources, StateCollector
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
    NodeView,
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


# kind -> (device plugin Unhealthy, DRA health stream healthy, taint (name, value), prepare and Allocate refuse,
# annotation health, the GPU's metrics (gpushare_gpu_healthy, _reset_required, _quarantined, _config_pending)).
# The metrics are the one consumer with series per part: `healthy` is the fault alone, `reset_required` the health
# monitor's wait for a reset (a lost GPU waits for one too), quarantine and a waiting shape their own series, and an
# MPS daemon that is down none (docs/metrics.md).
TABLE = {
    "": (False, True, None, False, "Healthy", (1, 0, 0, 0)),
    GPU_LOST: (True, False, ("unhealthy", "gpu-lost"), True, "Unhealthy", (0, 1, 0, 0)),
    RESET_REQUIRED: (True, False, ("unhealthy", "reset-required"), True, "Unhealthy", (0, 1, 0, 0)),
    XID: (True, False, ("unhealthy", "xid"), True, "Unhealthy", (0, 0, 0, 0)),
    QUERY_FAILED: (True, False, ("unhealthy", "query-failed"), True, "Unhealthy", (0, 0, 0, 0)),
    QUARANTINED: (True, False, ("quarantined", "residue"), True, "Quarantined", (1, 0, 1, 0)),
    MPS_DOWN: (True, False, ("mps-unavailable", "control-daemon"), True, "Unhealthy", (1, 0, 0, 0)),
    SHAPE_PENDING: (True, True, None, True, "Unhealthy", (1, 0, 0, 1)),  # DRA: the old shape stays, prepare refuses
}
GPU_SERIES = ("gpushare_gpu_healthy", "gpushare_gpu_reset_required", "gpushare_gpu_quarantined")
GPU_SERIES += ("gpushare_gpu_config_pending",)


def _gpu_metrics(state: NodeState, gpu_uuid: str) -> tuple[float, ...]:
    samples = {
        s.name: s.value
        for family in StateCollector(MetricSources(T4, state)).collect()
        for s in family.samples
        if s.labels.get("uuid") == gpu_uuid
    }
    return tuple(samples[name] for name in GPU_SERIES)


def _listed_unhealthy(view: NodeView, resource: Resource, device: Device) -> bool:
    """What ListAndWatch advertises for the device (plugin.wire maps ResourceHealth the same way)."""
    health = view.resource_health(resource)
    return device.is_unhealthy(health.unhealthy, health.quarantined_devices) or not health.mps_ready


def _allocate_refused(view: NodeView, resource: Resource, device: Device) -> bool:
    try:
        ResourceAllocator(resource, view.resource_health(resource)).allocate([[device.id]])
    except AllocationError as err:
        assert err.code is Refusal.PRECONDITION, err.message
        return True
    return False


def test_the_table_covers_every_kind() -> None:
    assert set(TABLE) - {""} == set(KINDS)


@pytest.mark.parametrize("kind", list(TABLE))
def test_every_consumer_shows_what_the_one_verdict_says(kind: str) -> None:
    dp_unhealthy, dra_healthy, taint, refused, shown, metrics = TABLE[kind]
    state = _state(kind)
    view = state.snapshot()
    resource = RESOURCES[0]
    device = next(d for i, d in resource.devices.items() if i.startswith(GPU0))
    dra = next(d for d in dra_devices(RESOURCES) if d.unit.gpu.uuid == GPU0)

    verdict = view.verdict(device.unit, resource.pool)
    assert verdict.kinds() == ((kind,) if kind else ())
    assert verdict.ok == (not refused)  # prepare refuses on any finding (dra.prepare)

    assert _listed_unhealthy(view, resource, device) == dp_unhealthy
    assert _allocate_refused(view, resource, device) == refused

    assert device_health([dra], view)[0].healthy == dra_healthy
    taints = [(t["key"].removeprefix(f"{DRIVER}/"), t["value"]) for t in device_taints(dra, view, DRIVER)]
    assert taints == ([taint] if taint else [])

    annotation = inventory(T4, RESOURCES, Usage(), published_unhealthy(view, RESOURCES), view.quarantined_gpus)
    unit = next(u for u in annotation["resources"][resource.name]["units"] if u["uuid"] == GPU0)
    assert unit["health"] == shown
    assert _gpu_metrics(state, GPU0) == metrics
    assert _gpu_metrics(state, T4.gpus[1].uuid) == TABLE[""][-1]  # the other GPU's series show none of it


H100 = node("2xH100-mig-1g")
MIG = resources_of({"version": "v1", "pools": [{"name": "m", "mode": "mig"}]}, H100)
(G0, MIGS0), (G1, MIGS1) = ((g.uuid, [m.uuid for m in g.mig_devices]) for g in H100.gpus)


def _mixed(parts: str, held: frozenset[str]) -> NodeView:
    """Faults: GPU 0 faulted (every instance inherits it), one instance of GPU 1 faulted on its own, another awaiting a
    reset. Quarantine: GPU 1 (`held`: the devices containers hold). All: both, and GPU 1 waiting for a new shape."""
    state = NodeState()
    if parts in ("faults", "all"):
        state.set_health({G0: "XID 31", MIGS1[0]: "XID 43", MIGS1[1]: "XID 48"}, frozenset({MIGS1[1]}))
    if parts in ("quarantine", "all"):
        state.set_quarantine(frozenset({G1}), quarantined_devices(MIG, frozenset({G1}), held))
    if parts == "all":
        state.set_pending({G1: "GPU 1 is held: it keeps its shape until released"})
    return state.snapshot()


@pytest.mark.parametrize("parts", ["faults", "quarantine", "all"])
def test_the_device_plugins_health_of_every_mig_device_is_its_units_verdict(parts: str) -> None:
    """ListAndWatch and Allocate per device agree with the unit's verdict: any finding fences its devices, except that
    quarantine fences only the free ones (a held device takes no new work anyway)."""
    held = frozenset({next(i for r in MIG for i, d in r.devices.items() if d.unit.uuid == MIGS1[3])})
    view = _mixed(parts, held)
    seen = set()
    for resource in MIG:
        for device in resource.devices.values():
            kinds = set(view.verdict(device.unit, resource.pool).kinds())
            fenced = bool(kinds - {QUARANTINED}) or (QUARANTINED in kinds and device.id not in held)
            assert _listed_unhealthy(view, resource, device) == fenced, (device.id, kinds)
            if device.id not in held:
                assert _allocate_refused(view, resource, device) == bool(kinds), (device.id, kinds)
            seen.update(kinds)
    assert (
        seen
        == {
            "faults": {XID, RESET_REQUIRED},
            "quarantine": {QUARANTINED},
            "all": {XID, RESET_REQUIRED, QUARANTINED, SHAPE_PENDING},
        }[parts]
    )


def test_a_gpus_own_unit_takes_its_instances_faults_and_a_static_instance_keeps_its_own() -> None:
    """The whole GPU's unit (a dynamic-MIG device's) has a finding for a fault on any MIG instance of it (fail
    closed); a static MIG unit of the same GPU keeps only its own and its GPU's, and another GPU's unit none."""
    state = NodeState()
    state.set_health({MIGS1[0]: "XID 43"}, instance_gpus={MIGS1[0]: G1, "MIG-gone": G1})
    view = state.snapshot()
    assert dict(view.instance_gpus) == {MIGS1[0]: G1}  # only the unhealthy ones
    pool = MIG[0].pool
    static = next(u for r in MIG for u in r.units if u.uuid == MIGS1[1])
    whole = replace(static, uuid=G1, mig=None)
    (finding,) = view.verdict(whole, pool).findings
    assert finding.kind == XID and finding.reason == f"GPU 1 (MIG instance {MIGS1[0]}): XID 43"
    assert view.verdict(static, pool).ok
    assert view.verdict(replace(whole, uuid=G0, gpu=H100.gpus[0]), pool).ok

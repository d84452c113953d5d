"""The inventory annotation v2: per GPU and per unit (whole GPU or MIG instance), health, pods, generation, size."""

from __future__ import annotations

import json

from deviceplugin.config.parse import parse_config
from deviceplugin.kube.annotation import pod_digest
from deviceplugin.kube.labels import InventoryAnnotation, inventory
from deviceplugin.model.node import Gpu, MigDevice, NodeInfo
from deviceplugin.model.usage import ContainerShare, Usage
from tests.conftest import node
from tests.support.resources import resources_of

MIG_NODE = node("8xA100-80GB-mig")


def eight_by_seven() -> NodeInfo:
    """8 GPUs, each split into seven 1g.10gb MIG instances."""
    gpus = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-5d2e8b41-a1f0-4c3e-8d7a-00000000000{i}",
            model="NVIDIA A100-SXM4-80GB",
            memory_mib=81920,
            mig_enabled=True,
            mig_devices=tuple(
                MigDevice(
                    uuid=f"MIG-0{i}0{k}a0c4-7f3b-5e91-b2d8-6c4f1000{i}{k}00",
                    profile="1g.10gb",
                    memory_mib=9984,
                    gi_id=k + 7,
                    ci_id=0,
                    index=k,
                )
                for k in range(7)
            ),
        )
        for i in range(8)
    )
    return NodeInfo(gpus=gpus, name="8x7")


def share(resource: str, unit, shares: int, pod: str, namespace: str = "team") -> ContainerShare:
    return ContainerShare(
        namespace=namespace,
        pod=pod,
        container="main",
        resource=resource,
        pool="p",
        unit_uuid=unit.uuid,
        gpu_uuid=unit.gpu.uuid,
        devices=tuple(f"{unit.uuid}::{k}" for k in range(shares)),
        shares=shares,
        memory_limit_mib=0,
        time_sliced=True,
    )


def test_mig_instances_are_units_with_their_own_health_and_free_shares():
    config = parse_config(
        {
            "version": "v1",
            "pools": [
                {"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [0, 1]}},
                {"name": "m", "mode": "mig", "gpus": {"indexes": [2]}},
            ],
        }
    )
    resources = resources_of(config, MIG_NODE)
    shared = next(r for r in resources if r.name == "example.com/gpu-share")
    first, second = shared.units[0], shared.units[1]
    usage = Usage(shares=(share(shared.name, first, 3, "a"), share(shared.name, second, 1, "b", namespace="ml")))
    gpu1 = MIG_NODE.gpus[1]
    content = inventory(
        MIG_NODE, resources, usage, unhealthy=frozenset({second.uuid}), quarantined=frozenset({gpu1.uuid})
    )
    units = {u["uuid"]: u for u in content["resources"][shared.name]["units"]}
    assert units[first.uuid] == {
        "uuid": first.uuid,
        "gpu": 0,
        "profile": "1g.10gb",
        "total": 4,
        "used": 3,
        "free": 1,
        "health": "Healthy",
    }
    # A faulty MIG instance is Unhealthy alone; its GPU and the other instances stay Healthy.
    assert units[second.uuid]["health"] == "Unhealthy" and units[second.uuid]["free"] == 0
    assert units[shared.units[2].uuid]["health"] == "Healthy"
    # A quarantined GPU: every unit on it has no free shares, and says why.
    on_gpu1 = [u for u in units.values() if u["gpu"] == 1]
    assert on_gpu1 and all(u["health"] == "Quarantined" and u["free"] == 0 for u in on_gpu1)
    gpus = {g["index"]: g for g in content["gpus"]}
    assert (
        gpus[0]["health"] == "Healthy"
        and gpus[1]["health"] == "Quarantined"
        and gpus[1]["model"] == "NVIDIA A100-SXM4-80GB"
    )
    # The mixed MIG strategy: one resource per profile, one device per instance.
    mig = content["resources"]["example.com/mig-3g.40gb"]
    assert mig["pool"] == "m" and [(u["gpu"], u["total"], u["free"]) for u in mig["units"]] == [(2, 1, 1), (2, 1, 1)]
    assert content["pods"] == sorted([pod_digest("team", "a"), pod_digest("ml", "b")])


def test_generation_increases_only_when_the_content_changes_and_across_restarts():
    resources = resources_of({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 4}]}, node("2xT4"))
    unit = resources[0].units[0]
    clock = iter([1000.0, 1000.5]).__next__
    builder = InventoryAnnotation(clock)
    empty = builder.build(node("2xT4"), resources, Usage(), frozenset())
    assert empty["generation"] == 1_000_000 and empty["version"] == 2
    assert builder.build(node("2xT4"), resources, Usage(), frozenset())["generation"] == 1_000_000
    used = builder.build(node("2xT4"), resources, Usage(shares=(share(resources[0].name, unit, 1, "a"),)), frozenset())
    assert used["generation"] == 1_000_001
    assert (
        builder.build(node("2xT4"), resources, Usage(), frozenset(), frozenset({unit.gpu.uuid}))["generation"]
        == 1_000_002
    )
    restarted = InventoryAnnotation(clock).build(node("2xT4"), resources, Usage(), frozenset())
    assert restarted["generation"] > 1_000_002


def test_size_at_eight_gpus_of_seven_mig_instances_stays_small():
    big = eight_by_seven()
    resources = resources_of({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 4}]}, big)
    units = resources[0].units
    assert len(units) == 56
    usage = Usage(shares=tuple(share(resources[0].name, u, 2, f"pod-{n}") for n, u in enumerate(units)))
    text = json.dumps(
        InventoryAnnotation().build(big, resources, usage, frozenset()), separators=(",", ":"), sort_keys=True
    )
    assert len(text.encode()) < 12 * 1024  # measured by benchmarks/extender.py: see docs/architecture.md

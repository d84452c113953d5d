"""The usage map from pod-resources as kubelet v1.36 writes it: one entry per device ID, one per NUMA node of a device
with topology, in any order; whatever the reply's shape, a container holds one record per unit and each ID counts
once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.agent.usage import build_usage
from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.model.shares import share_memory_mib
from tests.conftest import node
from tests.support.resources import one_pool

T4 = node("2xT4")
SHARE = "example.com/gpu-share"
RESOURCES = [one_pool(T4, {"name": "s", "mode": "shared", "replicas": 10})]  # 1536 MiB a share on a 15360 MiB T4
U0, U1 = T4.gpus[0].uuid, T4.gpus[1].uuid


def entry(device_id: str, *numa: int, resource: str = SHARE) -> pr.ContainerDevices:
    topology = pr.TopologyInfo(nodes=[pr.NUMANode(ID=n) for n in numa]) if numa else None
    return pr.ContainerDevices(resource_name=resource, device_ids=[device_id], topology=topology)


def reply(*containers: tuple[str, str, list[pr.ContainerDevices]]) -> pr.ListPodResourcesResponse:
    return pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(name=pod, namespace="ns", containers=[pr.ContainerResources(name=name, devices=devices)])
            for pod, name, devices in containers
        ]
    )


def test_one_entry_per_id_is_one_record_of_three_shares_with_a_three_share_limit():
    usage = build_usage(reply(("p", "app", [entry(f"{U0}::{k}", 0) for k in (4, 1, 7)])), RESOURCES)
    (share,) = usage.shares
    assert (share.shares, share.devices, share.memory_limit_mib) == (3, (f"{U0}::1", f"{U0}::4", f"{U0}::7"), 4608)
    assert share.memory_limit_mib == share_memory_mib(RESOURCES[0].devices[f"{U0}::1"].unit, 3)


def test_per_numa_duplicates_and_a_container_listed_twice_count_each_id_once():
    ids = [f"{U0}::{k}" for k in range(3)]
    per_numa = [entry(i, n) for i in ids for n in (0, 1)]  # a device on two NUMA nodes: one entry per node
    usage = build_usage(reply(("p", "app", per_numa), ("p", "app", [entry(ids[0])])), RESOURCES)
    assert [(s.key, s.shares, s.memory_limit_mib) for s in usage.shares] == [(("ns", "p", "app"), 3, 4608)]


def test_a_container_on_two_gpus_has_one_record_per_gpu_and_a_second_holder_counts_nothing():
    usage = build_usage(
        reply(
            ("p", "app", [entry(f"{U0}::0"), entry(f"{U1}::0"), entry(f"{U1}::1")]), ("q", "app", [entry(f"{U0}::0")])
        ),
        RESOURCES,
    )
    assert sorted((s.pod, s.unit_uuid, s.shares) for s in usage.shares) == [("p", U0, 1), ("p", U1, 2)]
    assert usage.active_containers == {("ns", "p", "app"), ("ns", "q", "app")}


IDS = [f"{u}::{k}" for u in (U0, U1) for k in range(10)] + ["GPU-unknown::0", ""]
NAMES = st.sampled_from(["a", "b"])


@st.composite
def hostile(draw) -> pr.ListPodResourcesResponse:
    """Any reply: pods and containers repeated, IDs split or joined across entries, repeated, on any NUMA nodes, of
    other resources, unknown."""
    pods = []
    for _ in range(draw(st.integers(0, 4))):
        containers = []
        for _ in range(draw(st.integers(0, 3))):
            devices = [
                pr.ContainerDevices(
                    resource_name=draw(st.sampled_from([SHARE, SHARE, "other.com/gpu"])),
                    device_ids=draw(st.lists(st.sampled_from(IDS), max_size=4)),
                    topology=pr.TopologyInfo(
                        nodes=[pr.NUMANode(ID=n) for n in draw(st.lists(st.integers(-1, 3), max_size=2))]
                    ),
                )
                for _ in range(draw(st.integers(0, 4)))
            ]
            containers.append(pr.ContainerResources(name=draw(NAMES), devices=devices))
        pods.append(pr.PodResources(name=draw(NAMES), namespace=draw(NAMES), containers=containers))
    return pr.ListPodResourcesResponse(pod_resources=pods)


@settings(max_examples=300, deadline=None)
@given(hostile())
def test_any_reply_gives_one_record_per_container_resource_and_unit_and_each_device_once(response):
    usage = build_usage(response, RESOURCES)
    labels = [(s.key, s.resource, s.unit_uuid) for s in usage.shares]
    assert len(labels) == len(set(labels))  # the metrics' label sets
    devices = [d for s in usage.shares for d in s.devices]
    assert len(devices) == len(set(devices)) and set(devices) <= set(RESOURCES[0].devices)
    for share in usage.shares:
        unit = RESOURCES[0].devices[share.devices[0]].unit
        assert share.shares == len(share.devices) and share.memory_limit_mib == share_memory_mib(unit, share.shares)
        assert all(RESOURCES[0].devices[d].unit.uuid == share.unit_uuid for d in share.devices)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(IDS[:20]), min_size=1, max_size=20, unique=True), st.randoms(use_true_random=False))
def test_the_kubelets_entry_shape_and_order_do_not_change_the_map(ids, rng):
    """One entry holding every ID (the old built-in kubelet) and one entry per ID and NUMA node, shuffled (v1.36)."""
    joined = build_usage(reply(("p", "app", [pr.ContainerDevices(resource_name=SHARE, device_ids=ids)])), RESOURCES)
    split = [entry(i, n) for i in ids for n in (0, 1)]
    rng.shuffle(split)
    assert set(build_usage(reply(("p", "app", split)), RESOURCES).shares) == set(joined.shares)

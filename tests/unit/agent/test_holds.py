"""agent.holds.holds_in: a pod-resources List as kubelet v1.36 writes it (one entry per device ID and per NUMA node)
gives each held device once, with the share count the checkpoint knows; over the bound it is unknown, not cut short."""

from __future__ import annotations

import pytest

from deviceplugin.agent import holds
from deviceplugin.agent.holds import HoldsUnknown, holds_in
from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.model.usage import Hold

SHARE = "example.com/gpu-share"
OURS = {"GPU-a", "GPU-b"}.__contains__


def _listed(*ids_per_entry: list[str]) -> pr.ListPodResourcesResponse:
    entries = [
        pr.ContainerDevices(resource_name=SHARE, device_ids=ids, topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=n)]))
        for ids in ids_per_entry
        for n in (0, 1)
    ]  # each ID once per NUMA node, as the kubelet lists it
    return pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(name="p", namespace="ns", containers=[pr.ContainerResources(name="c", devices=entries)])
        ]
    )


def test_one_entry_per_device_id_and_numa_node_gives_each_device_once():
    granted = {(SHARE, f"GPU-a::{k}"): Hold(SHARE, f"GPU-a::{k}", 4) for k in range(3)}
    found = holds_in(_listed(["GPU-a::0"], ["GPU-a::1"], ["GPU-a::2"], ["GPU-elsewhere::0"]), granted, OURS)
    assert sorted((h.device, h.replicas, h.holder) for h in found) == [(f"GPU-a::{k}", 4, "ns/p/c") for k in range(3)]


def test_a_share_the_checkpoint_does_not_know_is_held_in_an_unknown_shape_and_a_whole_gpu_in_one():
    found = holds_in(_listed(["GPU-a::0"], ["GPU-b"]), {}, OURS)
    assert {(h.device, h.replicas) for h in found} == {("GPU-a::0", None), ("GPU-b", 1)}


def test_more_holds_than_the_bound_are_unknown(monkeypatch):
    monkeypatch.setattr(holds, "MAX_HOLDS", 2)
    with pytest.raises(HoldsUnknown, match="over 2 of our devices"):
        holds_in(_listed(["GPU-a::0"], ["GPU-a::1"], ["GPU-a::2"]), {}, OURS)

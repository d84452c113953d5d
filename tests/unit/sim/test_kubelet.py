"""The built-in kubelet's pod-resources entries, as kubelet v1.36 builds them from an allocation's IDs per NUMA node."""

from __future__ import annotations

from deviceplugin.sim.kubelet import NO_TOPOLOGY, KubeletSimulator

SHARE = "example.com/gpu-share"


def test_one_entry_per_id_and_numa_node_and_no_topology_field_without_one():
    entries = KubeletSimulator._entries(SHARE, {NO_TOPOLOGY: ["a"], 0: ["b", "c"], 1: ["b"]})
    shape = sorted(
        (list(e.device_ids), [n.ID for n in e.topology.nodes] if e.HasField("topology") else None) for e in entries
    )
    assert shape == [(["a"], None), (["b"], [0]), (["b"], [1]), (["c"], [0])]
    assert all(e.resource_name == SHARE for e in entries)

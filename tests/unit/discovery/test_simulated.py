"""The node description file behind the simulated GPU node."""

from __future__ import annotations

import pytest

from deviceplugin.discovery.inventory import InventoryError
from deviceplugin.discovery.simulated import SimulatedInventory, parse_node
from tests.conftest import node

GPU = {"index": 0, "uuid": "GPU-a", "model": "Tesla T4", "memoryMiB": 15360}


def test_example_nodes_describe_their_gpus():
    t4 = node("2xT4")
    assert [g.index for g in t4.gpus] == [0, 1] and {g.model for g in t4.gpus} == {"Tesla T4"}
    h100 = node("8xH100-80GB")
    assert len(h100.gpus) == 8 and {g.memory_mib for g in h100.gpus} == {81559}
    assert [g.numa_node for g in h100.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert h100.driver_version == "570.124.06"


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "(top level): must be a mapping"),
        ({}, "gpus: is required"),
        ({"gpus": [{**GPU, "memoryMiB": 0}]}, "gpus[0].memoryMiB: must be > 0, got 0"),
        ({"gpus": [{**GPU, "uuid": "abc"}]}, "gpus[0].uuid: must start with 'GPU-', got 'abc'"),
        ({"gpus": [{k: v for k, v in GPU.items() if k != "model"}]}, "gpus[0].model: is required"),
        ({"gpus": [{**GPU, "memory": 1}]}, "gpus[0].memory: unknown key"),
        ({"gpus": [GPU, {**GPU, "uuid": "GPU-b"}]}, "gpus[1].index: duplicate value 0"),
        ({"gpus": [GPU, {**GPU, "index": 1}]}, "gpus[1].uuid: duplicate value 'GPU-a'"),
    ],
)
def test_bad_node_file_names_key_and_reason(data, message):
    with pytest.raises(InventoryError) as err:
        parse_node(data, "n.yaml")
    assert f"n.yaml: {message}" in str(err.value)


def test_missing_node_file(tmp_path):
    with pytest.raises(InventoryError, match="node file .*nope.yaml: file: cannot read: no such file"):
        SimulatedInventory.from_file(tmp_path / "nope.yaml")


def test_negative_numa_means_none():
    info, _ = parse_node({"gpus": [{**GPU, "numaNode": -1}]})
    assert info.gpus[0].numa_node is None

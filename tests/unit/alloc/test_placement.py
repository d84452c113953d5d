"""The placement policy (GetPreferredAllocation) as a plain function on plain data: tables of free devices -> choice."""

from __future__ import annotations

import pytest

from deviceplugin.alloc.placement import choose_unit, preferred_allocation
from deviceplugin.model.node import Gpu, Link, NodeInfo
from tests.conftest import node
from tests.support.resources import free_shares, gpus_of, one_pool, shared

H100 = node("8xH100-80GB")  # NVSwitch: 18 NVLinks between every pair; GPUs 0-3 on NUMA node 0, 4-7 on 1
U = [g.uuid for g in H100.gpus]


@pytest.mark.parametrize(
    "policy, replicas, free, size, gpus",
    [
        # binpack: the fullest GPU (fewest free shares) that still fits
        ("binpack", 4, {0: 4, 1: 1, 2: 2, 3: 3}, 2, {2}),
        ("binpack", 4, {0: 4, 1: 1, 2: 2, 3: 3}, 1, {1}),
        ("binpack", 4, {0: 4, 1: 1, 2: 2, 3: 3}, 4, {0}),
        ("binpack", 4, {0: 3, 1: 2}, 3, {0}),  # only one fits
        ("binpack", 4, {6: 2, 5: 2}, 2, {5}),  # a tie: the lowest index
        # spread: the emptiest GPU
        ("spread", 4, {0: 2, 1: 4, 2: 3}, 1, {1}),
        ("spread", 4, {0: 2, 1: 4, 2: 3}, 3, {1}),
        ("spread", 4, {1: 4, 0: 4}, 1, {0}),  # a tie: the lowest index
        # fgdstrand: the cluster policy's GPU, where binpack would take the fullest
        ("fgdstrand", 8, {0: 0, 1: 3, 2: 2}, 1, {1}),
        ("binpack", 8, {0: 0, 1: 3, 2: 2}, 1, {2}),
        # nothing fits on one GPU: the largest pieces first, whatever the policy
        ("binpack", 4, {0: 2, 1: 3, 2: 1}, 5, {0, 1}),
        ("spread", 4, {0: 2, 1: 3, 2: 1}, 5, {0, 1}),
    ],
)
def test_shares_go_to_the_policys_gpu(policy, replicas, free, size, gpus):
    ids = preferred_allocation(shared(H100, policy, replicas), free_shares(H100, free, replicas), [], size)
    assert gpus_of(H100, ids) == gpus and len(ids) == size == len(set(ids))


@pytest.mark.parametrize(
    "policy, free, totals, wanted, unit",
    [
        ("binpack", [4, 1, 2, 3], [4] * 4, 2, 2),
        ("binpack", [4, 1, 2, 3], [4] * 4, 5, None),  # no unit has room
        ("binpack", [0, 2, 2], [4] * 3, 2, 1),  # a tie: the lowest index
        ("spread", [2, 4, 3], [4] * 3, 1, 1),
        ("spread", [4, 2, 4], [4] * 3, 1, 0),
        ("fgdstrand", [0, 3, 2, 0, 0, 0, 0, 0], [8] * 8, 1, 1),  # where binpack takes 2
        ("binpack", [0, 3, 2, 0, 0, 0, 0, 0], [8] * 8, 1, 2),
        ("fgdstrand", [4, 2, 1], [4, 2, 1], 1, 2),  # unequal share counts: binpack
        ("fgdstrand", [0, 0], [4, 4], 1, None),
    ],
)
def test_choose_unit(policy, free, totals, wanted, unit):
    """On plain counts: what the node plugin and the scheduler extender both call."""
    assert choose_unit(policy, free, totals, wanted) == unit


@pytest.mark.parametrize(
    "available, must, size, expected",
    [
        # a tie goes to the lowest index, shares in order
        (free_shares(H100, {3: 4, 1: 4}, 4), [], 2, [f"{U[1]}::0", f"{U[1]}::1"]),
        # must_include is kept first and completed on its GPU
        (free_shares(H100, {0: 4, 1: 3}, 4), [f"{U[0]}::2"], 3, [f"{U[0]}::2", f"{U[0]}::0", f"{U[0]}::1"]),
        # ... and elsewhere when its GPU has nothing else free (Allocate then refuses the span)
        (free_shares(H100, {0: 4, 1: 1}, 4), [f"{U[1]}::3"], 2, [f"{U[1]}::3", f"{U[0]}::0"]),
        # as many as must_include asks for: exactly those, in their order, once each
        (free_shares(H100, {2: 4}, 4), [f"{U[2]}::3", f"{U[2]}::1", f"{U[2]}::3"], 2, [f"{U[2]}::3", f"{U[2]}::1"]),
        # unknown and repeated IDs are ignored
        (
            free_shares(H100, {0: 4}, 4) + ["GPU-unknown::0", f"{U[0]}::0"],
            [],
            3,
            [f"{U[0]}::0", f"{U[0]}::1", f"{U[0]}::2"],
        ),
        # short supply: what there is
        ([f"{U[4]}::3"], [], 2, [f"{U[4]}::3"]),
    ],
)
def test_shared_choice(available, must, size, expected):
    assert preferred_allocation(shared(H100), available, must, size) == expected


def _node(gpus: int, nvlinks: dict[tuple[int, int], int], numa=lambda i: 0) -> NodeInfo:
    """`gpus` A100s named GPU-<index>; NVLink counts by index pair (none elsewhere)."""
    units = tuple(Gpu(index=i, uuid=f"GPU-{i}", model="A100", memory_mib=40960, numa_node=numa(i)) for i in range(gpus))
    links = {
        (a.uuid, b.uuid): Link(nvlinks=nvlinks.get((a.index, b.index), 0), pcie="system")
        for a in units
        for b in units
        if a.index < b.index
    }
    return NodeInfo(gpus=units, links=links)


NV4_1_3 = _node(4, {(1, 3): 4})  # one NV4 pair, GPUs 1 and 3
SIXTEEN = _node(16, {}, numa=lambda i: i % 2)  # 16 choose 8 is over the exhaustive search's limit: greedy


@pytest.mark.parametrize(
    "node_info, available, must, size, expected",
    [
        # equal NVLinks everywhere: GPU 5 shares GPU 7's NUMA node, GPU 2 does not
        (H100, [U[5], U[2], U[7]], [U[7]], 2, [U[7], U[5]]),
        (H100, [U[0], U[4], U[5]], [], 2, [U[4], U[5]]),  # one NUMA node beats low indexes
        (H100, [U[3], U[1], U[2]], [], 2, [U[1], U[2]]),  # then the lowest indexes
        (H100, [U[6]], [], 2, [U[6]]),  # short supply
        # NVLink decides even when one GPU is left to choose
        (NV4_1_3, ["GPU-0", "GPU-1", "GPU-2", "GPU-3"], ["GPU-1"], 2, ["GPU-1", "GPU-3"]),
        (NV4_1_3, ["GPU-0", "GPU-1", "GPU-2", "GPU-3"], [], 2, ["GPU-1", "GPU-3"]),
        (NV4_1_3, ["GPU-0", "GPU-2", "GPU-3"], [], 2, ["GPU-0", "GPU-2"]),  # no link left: low indexes
        # large nodes: greedy, still one NUMA node and low indexes
        (SIXTEEN, [f"GPU-{i}" for i in range(16)], [], 8, [f"GPU-{i}" for i in range(0, 16, 2)]),
        (SIXTEEN, [f"GPU-{i}" for i in range(16)], ["GPU-1"], 3, ["GPU-1", "GPU-3", "GPU-5"]),
    ],
)
def test_whole_gpus_go_to_the_best_connected_set(node_info, available, must, size, expected):
    resource = one_pool(node_info, {"name": "e", "mode": "exclusive"})
    assert preferred_allocation(resource, available, must, size) == expected


def test_mig_instances_of_unequal_share_counts_fall_back_to_binpack_under_fgdstrand():
    """Instances of 3g and 1g with memoryPerShare have 4 and 1 shares: no common measure, so the fullest that fits."""
    a100 = node("8xA100-80GB-mig")
    resource = one_pool(
        a100,
        {"name": "s", "mode": "shared", "memoryPerShare": "9984Mi", "gpus": {"indexes": [1]}},
        allocationPolicy="fgdstrand",
    )
    assert sorted({u.replicas for u in resource.units}) == [1, 2, 4]
    big, medium = a100.gpus[1].mig_devices[0].uuid, a100.gpus[1].mig_devices[1].uuid
    available = [f"{big}::{k}" for k in range(4)] + [f"{medium}::{k}" for k in range(2)]
    assert preferred_allocation(resource, available, [], 1) == [f"{medium}::0"]

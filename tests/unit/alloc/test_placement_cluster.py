"""The node plugin's share placement (GetPreferredAllocation) calls the cluster policy: same state, same GPU."""

from __future__ import annotations

import random

import pytest

from deviceplugin.alloc.placement import preferred_allocation
from deviceplugin.cluster import MILLI, Node, PodDemand, TaskShapes, make_policy
from deviceplugin.config.parse import parse_config
from deviceplugin.config.types import ConfigError
from tests.conftest import node
from tests.support.resources import free_shares, gpus_of, shared

H100 = node("8xH100-80GB")


def plugin_gpu(policy: str, free: list[int], replicas: int, wanted: int) -> int:
    ids = preferred_allocation(
        shared(H100, policy, replicas), free_shares(H100, dict(enumerate(free)), replicas), [], wanted
    )
    gpus = gpus_of(H100, ids)
    assert len(gpus) == 1 and len(ids) == wanted
    return gpus.pop()


def cluster_gpu(free: list[int], replicas: int, wanted: int) -> int:
    """What the cluster policy picks on the same node: k of N shares = k/N of a GPU."""
    policy = make_policy("fgdstrand", shapes=TaskShapes.shares(replicas))
    state = Node("n", 0, 0, "", [f * MILLI // replicas for f in free])
    return policy.score(PodDemand(0, 0, 1, wanted * MILLI // replicas), state).gpus[0]


def test_the_plugin_picks_the_cluster_policys_gpu_where_binpack_would_not():
    free = [0, 3, 2, 0, 0, 0, 0, 0]  # 8 shares per GPU, 1 wanted
    assert plugin_gpu("binpack", free, 8, 1) == 2  # the fullest that fits
    assert plugin_gpu("fgdstrand", free, 8, 1) == cluster_gpu(free, 8, 1) == 1


def test_same_state_same_gpu_on_random_states():
    rng = random.Random(11)
    for _ in range(300):
        replicas = rng.choice([2, 4, 8, 10])
        free = [rng.randint(0, replicas) for _ in range(8)]
        wanted = rng.randint(1, replicas)
        if max(free) < wanted:
            continue
        assert plugin_gpu("fgdstrand", free, replicas, wanted) == cluster_gpu(free, replicas, wanted), (
            free,
            replicas,
            wanted,
        )


def test_a_whole_gpu_of_shares_takes_the_first_fully_free_gpu():
    assert plugin_gpu("fgdstrand", [3, 4, 1, 4, 0, 0, 0, 0], 4, 4) == 1


def test_the_policy_is_a_valid_allocation_policy_and_others_are_refused():
    assert shared(H100, "fgdstrand", 4).allocation_policy == "fgdstrand"
    with pytest.raises(ConfigError, match="allocationPolicy"):
        parse_config({"version": "v1", "allocationPolicy": "fgd", "pools": [{"name": "s", "mode": "shared"}]})

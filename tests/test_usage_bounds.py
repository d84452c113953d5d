"""A hostile pod-resources reply cannot inflate the usage map: duplicate IDs count once, and a reply listing 100,000
pods costs a bounded amount of memory."""

from __future__ import annotations

import tracemalloc

from deviceplugin.agent.usage import MAX_ACTIVE_CONTAINERS, build_usage
from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.config.types import default_config
from tests.support.resources import resources_of

from .conftest import node

T4 = node("2xT4")
SHARE = "example.com/gpu-share"


def reply(pods: int, ids: list[str]) -> pr.ListPodResourcesResponse:
    return pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name=f"p{i}",
                namespace="ns",
                containers=[
                    pr.ContainerResources(name="c", devices=[pr.ContainerDevices(resource_name=SHARE, device_ids=ids)])
                ],
            )
            for i in range(pods)
        ]
    )


def test_duplicate_ids_count_once():
    resources = resources_of(default_config(), T4)  # 10 shares per GPU
    gpu = T4.gpus[0].uuid
    every = [f"{gpu}::{k}" for k in range(10)]
    usage = build_usage(reply(2, every + every), resources)  # two pods claim the same ten IDs, each twice
    assert sum(s.shares for s in usage.shares) == 10 and len(usage.allocated()) == 10


def test_a_reply_of_100k_pods_costs_a_bounded_amount_of_memory():
    resources = resources_of(default_config(), T4)
    message = reply(100_000, [f"{T4.gpus[0].uuid}::0"])
    tracemalloc.start()
    usage = build_usage(message, resources)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(usage.shares) == 1 and len(usage.active_containers) == MAX_ACTIVE_CONTAINERS
    assert peak < 16 * 1024 * 1024, peak

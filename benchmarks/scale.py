"""ListAndWatch at scale: message size and build + serialise time for 1k, 10k and 60k devices, and the budget check."""

from __future__ import annotations

import statistics

from deviceplugin.alloc.plan import LIST_BUDGET_BYTES, build_resources
from deviceplugin.config.parse import parse_config
from deviceplugin.config.types import ConfigError
from deviceplugin.model.node import Gpu, NodeInfo
from deviceplugin.plugin.wire import EncodedDeviceList

from .common import timed

KUBELET_LIMIT = 4 * 1024 * 1024


def _node(gpus: int) -> NodeInfo:
    return NodeInfo(
        gpus=tuple(
            Gpu(index=i, uuid=f"GPU-bench000-0000-4000-8000-{i:012d}", model="H100", memory_mib=81559, numa_node=i % 2)
            for i in range(gpus)
        )
    )


def run(smoke: bool = False) -> dict:
    sizes = [(8, 125), (10, 1000)] if smoke else [(8, 125), (10, 1000), (60, 1000)]  # replicas are at most 1024 per GPU
    repeats = 3 if smoke else 20
    rows = []
    for gpus, replicas in sizes:
        config = parse_config({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": replicas}]})
        resource = build_resources(config, _node(gpus), budget_bytes=KUBELET_LIMIT)[0]  # measure past our own budget
        device_list = EncodedDeviceList(resource)  # as a server holds it: entries encoded on the first list
        times = [timed(lambda: device_list.response().SerializeToString()) for _ in range(repeats)]
        size = len(device_list.response().SerializeToString())
        rows.append(
            {
                "devices": len(resource.devices),
                "bytes": size,
                "bytes_per_device": round(size / len(resource.devices), 1),
                "build_and_serialise_ms_median": round(statistics.median(times) * 1000, 2),
                "share_of_kubelet_limit": round(size / KUBELET_LIMIT, 3),
                "within_budget": size <= LIST_BUDGET_BYTES,
            }
        )
    over = parse_config({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 1000}]})
    try:
        build_resources(over, _node(60))
        refusal = "not refused"
    except ConfigError as err:
        refusal = str(err)
    return {
        "budget_bytes": LIST_BUDGET_BYTES,
        "kubelet_limit_bytes": KUBELET_LIMIT,
        "lists": rows,
        "60000_devices_refused_with": refusal,
    }

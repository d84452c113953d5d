"""Footprint: resident memory after start and after 10,000 allocations, and CPU used while idle."""

from __future__ import annotations

import time

from deviceplugin.api import deviceplugin_pb2 as pb

from .common import cpu_seconds, plugin_process, rss_mib

RESOURCE = "example.com/gpu-share"


def run(smoke: bool = False) -> dict:
    allocations = 200 if smoke else 10_000
    idle_seconds = 1.0 if smoke else 60.0
    with plugin_process(gpus=8, replicas=64) as (kubelet, process, _):
        time.sleep(1.0)  # let start-up settle
        after_start = rss_mib(process.pid)
        stub = kubelet.stub(RESOURCE)
        ids = kubelet.resources()[RESOURCE].healthy
        for i in range(allocations):
            k = 1 + i % 4
            first = (i * 4) % (len(ids) - 4)
            gpu_ids = [x for x in ids[first : first + 8] if x.split("::")[0] == ids[first].split("::")[0]][:k]
            stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=gpu_ids)]))
        after_allocations = rss_mib(process.pid)
        cpu_before = cpu_seconds(process.pid)
        time.sleep(idle_seconds)
        idle_cpu = cpu_seconds(process.pid) - cpu_before
    return {
        "rss_after_start_mib": round(after_start, 1),
        "rss_after_allocations_mib": round(after_allocations, 1),
        "allocations": allocations,
        "rss_growth_mib": round(after_allocations - after_start, 1),
        "idle_seconds": idle_seconds,
        "idle_cpu_percent_of_a_core": round(100 * idle_cpu / idle_seconds, 2),
        "note": "defaults: kubelet watch every 0.2 s, health checks every 1 s, pod-resources poll every 10 s",
    }

"""Admission latency: GetPreferredAllocation + Allocate over real gRPC on a Unix socket, 8 GPUs x 64 shares,
with the kubelet's ListAndWatch stream open; the floor is an empty unary call (PreStartContainer) on the same
channel."""

from __future__ import annotations

import random

from deviceplugin.api import deviceplugin_pb2 as pb

from .common import plugin_process, summary_ms, timed

RESOURCE = "example.com/gpu-share"


def run(smoke: bool = False) -> dict:
    rounds = 50 if smoke else 2000
    rng = random.Random(1)
    with plugin_process(gpus=8, replicas=64) as (kubelet, _, _):
        stub = kubelet.stub(RESOURCE)
        available = kubelet.resources()[RESOURCE].healthy
        floor, preferred, allocate, admission = [], [], [], []
        for _ in range(50):  # warm up the channel and the server's threads
            stub.PreStartContainer(pb.PreStartContainerRequest())
        for _ in range(rounds):
            size = rng.randint(1, 4)
            request = pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=size)
                ]
            )
            floor.append(timed(lambda: stub.PreStartContainer(pb.PreStartContainerRequest())))
            ids: list[str] = []
            preferred.append(
                timed(lambda: ids.extend(stub.GetPreferredAllocation(request).container_responses[0].deviceIDs))
            )
            alloc = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
            allocate.append(timed(lambda: stub.Allocate(alloc)))
            admission.append(preferred[-1] + allocate[-1])
        assert kubelet.resources()[RESOURCE].messages == 1  # the stream stayed open and quiet
    result = {
        "devices": len(available),
        "floor_empty_call": summary_ms(floor),
        "get_preferred_allocation": summary_ms(preferred),
        "allocate": summary_ms(allocate),
        "admission_total": summary_ms(admission),
    }
    result["allocate_p99_over_floor_p99"] = round(
        result["allocate"]["p99_ms"] / result["floor_empty_call"]["p99_ms"], 2
    )
    result["allocate_p50_over_floor_p50"] = round(
        result["allocate"]["p50_ms"] / result["floor_empty_call"]["p50_ms"], 2
    )
    return result

"""The model on the wire: the device list (and the budget's size formula) against protobuf itself, grants, codes (a
refusal's status code included)."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from deviceplugin.alloc.allocator import AllocationError, ContainerGrant, Refusal, ResourceAllocator
from deviceplugin.alloc.devicenodes import DeviceNode
from deviceplugin.alloc.modes import Mount
from deviceplugin.alloc.plan import list_entry_bytes
from deviceplugin.api import deviceplugin_pb2 as pb
from deviceplugin.model.devices import HEALTHY, UNHEALTHY
from deviceplugin.plugin import wire
from tests.conftest import node
from tests.support.resources import one_pool, shared


def _entry(device_id: str, numa_node: int | None, health: str) -> pb.ListAndWatchResponse:
    item = pb.Device(ID=device_id, health=health)
    if numa_node is not None:
        item.topology.nodes.add(ID=numa_node)
    return pb.ListAndWatchResponse(devices=[item])


@pytest.mark.parametrize("length", [1, 40, 45, 116, 117, 127, 128, 300, 16_383, 16_384, 20_000])
@pytest.mark.parametrize("numa_node", [None, 0, 1, 127, 128, 2**31, -1])
@pytest.mark.parametrize("health", [HEALTHY, UNHEALTHY])
def test_the_size_formula_is_protobufs(length, numa_node, health):
    """Around every varint boundary of the ID, the device message and the entry; proto3 drops NUMA node 0's ID."""
    device_id = ("GPU-é" * length)[:length]  # a non-ASCII character: lengths are in bytes
    assert list_entry_bytes(device_id, numa_node, health) == _entry(device_id, numa_node, health).ByteSize()


@pytest.mark.parametrize("name", ["2xT4", "8xA100-80GB-mig"])
def test_the_encoded_list_is_the_message_built_device_by_device(name):
    node_info = node(name)
    resource = one_pool(node_info, {"name": "s", "mode": "shared", "replicas": 3})
    devices = list(resource.devices.values())
    sick_gpu, sick_id = devices[0].gpu.uuid, devices[-1].id
    device_list = wire.EncodedDeviceList(resource)

    def built(health) -> pb.ListAndWatchResponse:
        return pb.ListAndWatchResponse(devices=[_entry(d.id, d.gpu.numa_node, health(d)).devices[0] for d in devices])

    assert device_list.response() == built(lambda d: HEALTHY)
    assert device_list.response(all_unhealthy=True) == built(lambda d: UNHEALTHY)
    expected = built(lambda d: UNHEALTHY if d.gpu.uuid == sick_gpu or d.id == sick_id else HEALTHY)
    assert device_list.response(frozenset({sick_gpu}), quarantined_devices=frozenset({sick_id})) == expected
    assert device_list.response() == built(lambda d: HEALTHY)  # the caches are per health, never mixed


def test_no_topology_unless_every_gpu_reports_it():
    node_info = node("2xT4")
    bare = replace(node_info, gpus=tuple(replace(g, numa_node=None) for g in node_info.gpus))
    message = wire.EncodedDeviceList(shared(bare)).response()
    assert len(message.devices) == 8 and not any(d.HasField("topology") for d in message.devices)


def test_a_grant_becomes_the_kubelets_message():
    grant = ContainerGrant(
        envs={"CUDA_VISIBLE_DEVICES": "GPU-1", "GPU_SHARE_COUNT": "1"},
        mounts=(Mount("/dev/shm", "/run/mps/shm"), Mount("/ro", "/host/ro", read_only=True)),
        device_specs=(DeviceNode("/dev/nvidia1", "/host/dev/nvidia1"),),
        cdi_devices=("nvidia.com/gpu=GPU-1",),
    )
    assert wire.container_response(grant) == pb.ContainerAllocateResponse(
        envs={"CUDA_VISIBLE_DEVICES": "GPU-1", "GPU_SHARE_COUNT": "1"},
        mounts=[
            pb.Mount(container_path="/dev/shm", host_path="/run/mps/shm"),
            pb.Mount(container_path="/ro", host_path="/host/ro", read_only=True),
        ],
        devices=[pb.DeviceSpec(container_path="/dev/nvidia1", host_path="/host/dev/nvidia1", permissions="rw")],
        cdi_devices=[pb.CDIDevice(name="nvidia.com/gpu=GPU-1")],
    )


@pytest.mark.parametrize(
    "refusal, code",
    [(Refusal.INVALID, grpc.StatusCode.INVALID_ARGUMENT), (Refusal.PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION)],
)
def test_every_refusal_has_its_status_code(refusal, code):
    assert wire.status_code(refusal) == code
    assert set(wire.STATUS_CODES) == set(Refusal)


def test_unknown_ids_are_listed_with_a_limit():
    H100 = node("8xH100-80GB")
    ids = [f"GPU-x::{k}" for k in range(12)]
    with pytest.raises(AllocationError) as err:
        ResourceAllocator(shared(H100)).grant(ids)
    assert err.value.code is Refusal.INVALID and err.value.message.endswith("and 4 more")
    assert wire.status_code(err.value.code) == grpc.StatusCode.INVALID_ARGUMENT

"""The model on the wire: device lists, container grants and refusals as the kubelet's protobuf messages and gRPC codes.

The one place that builds these messages; alloc/ and model/ stay transport-free. (The list budget in alloc/plan.py
computes sizes from the same wire format without protobuf; tests/test_wire.py holds the two together.)
"""

from __future__ import annotations

from functools import cached_property

import grpc

from ..alloc.allocator import Allocation, ContainerGrant, Refusal
from ..api import deviceplugin_pb2 as pb
from ..model.devices import HEALTHY, UNHEALTHY, Resource

OPTIONS = pb.DevicePluginOptions(
    pre_start_required=False, get_preferred_allocation_available=True
)  # Register's and GetDevicePluginOptions' answer
STATUS_CODES = {
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_code(refusal: Refusal) -> grpc.StatusCode:
    return STATUS_CODES[refusal]


class EncodedDeviceList:
    """A resource's ListAndWatch message, built from each device's encoded entry (a repeated field encodes as the
    concatenation of its elements), cached per health: a 10k-device list takes milliseconds instead of building
    10k messages. One per resource, held by its server."""

    def __init__(self, resource: Resource) -> None:
        self.resource = resource

    def response(
        self,
        unhealthy: frozenset[str] = frozenset(),
        all_unhealthy: bool = False,
        quarantined_devices: frozenset[str] = frozenset(),
    ) -> pb.ListAndWatchResponse:
        """The full device list; a device is unhealthy when its unit or GPU is in `unhealthy`, or its ID in
        `quarantined_devices`."""
        healthy = self._healthy
        if not (unhealthy or all_unhealthy or quarantined_devices):
            return pb.ListAndWatchResponse.FromString(b"".join(healthy))
        sick = self._unhealthy
        parts = [
            sick[i] if all_unhealthy or d.is_unhealthy(unhealthy, quarantined_devices) else healthy[i]
            for i, d in enumerate(self.resource.devices.values())
        ]
        return pb.ListAndWatchResponse.FromString(b"".join(parts))

    @cached_property
    def _healthy(self) -> list[bytes]:
        return self._encode(HEALTHY)

    @cached_property
    def _unhealthy(self) -> list[bytes]:  # built on the first health problem only
        return self._encode(UNHEALTHY)

    def _encode(self, health: str) -> list[bytes]:
        """Per device, its encoded ListAndWatchResponse entry with this health."""
        topology = self.resource.with_topology
        encoded = []
        for device in self.resource.devices.values():
            item = pb.Device(ID=device.id, health=health)
            if topology:
                item.topology.nodes.add(ID=device.gpu.numa_node)
            encoded.append(pb.ListAndWatchResponse(devices=[item]).SerializeToString())
        return encoded


def container_response(grant: ContainerGrant) -> pb.ContainerAllocateResponse:
    """The kubelet's message for what one container receives."""
    response = pb.ContainerAllocateResponse(envs=grant.envs)
    for mount in grant.mounts:
        response.mounts.add(container_path=mount.container_path, host_path=mount.host_path, read_only=mount.read_only)
    for node in grant.device_specs:
        response.devices.add(container_path=node.container_path, host_path=node.host_path, permissions=node.permissions)
    for name in grant.cdi_devices:
        response.cdi_devices.add(name=name)
    return response


def allocate_response(allocation: Allocation) -> pb.AllocateResponse:
    return pb.AllocateResponse(container_responses=[container_response(g) for g in allocation.grants])


def preferred_response(answers: list[list[str]]) -> pb.PreferredAllocationResponse:
    return pb.PreferredAllocationResponse(
        container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in answers]
    )

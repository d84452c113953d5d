"""Who holds which device: the kubelet's pod-resources API, the only source of truth for usage.

No bookkeeping happens in Allocate (the kubelet never says when a pod goes away); the usage map is rebuilt
from `List` on every poll, so a plugin restart or a deleted pod can never leave a share miscounted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc

from .. import defaults
from ..alloc.modes import TIME_SLICED, mode_of
from ..api import podresources_pb2 as pr
from ..api import podresources_pb2_grpc as pr_grpc
from ..model.devices import Resource, Unit
from ..model.shares import share_memory_mib
from ..model.usage import ContainerShare, Usage

DEFAULT_SOCKET = defaults.POD_RESOURCES_SOCKET
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the kubelet's server has no send cap; its own clients use 16 MiB
MAX_ACTIVE_CONTAINERS = 8192  # a node runs at most a few hundred pods; a reply listing more is not a kubelet's

UsageBuilder = Callable[[pr.ListPodResourcesResponse, list[Resource]], Usage]  # one List -> the usage map


def build_usage(response: pr.ListPodResourcesResponse, resources: list[Resource]) -> Usage:
    """Map each active container's device IDs onto our resources' GPUs; IDs of other plugins are ignored.

    The kubelet lists a container's devices as one `ContainerDevices` entry per device ID, and one per NUMA node of a
    device with topology, in no particular order. So entries are grouped per (container, resource, unit) and each ID
    counts once: a container holds one record per GPU or MIG instance, whatever the reply's shape (a container or pod
    listed twice merges into one record too).

    Bounded whatever the reply holds: a device is counted once and for its first holder only (a second holder of the
    same ID is not a second share), so the records and shares are at most our devices; at most MAX_ACTIVE_CONTAINERS
    containers are kept as active (the attribution of processes only reports what it cannot place, never
    quarantines it).
    """
    by_name = {r.name: r for r in resources}
    held: dict[
        tuple[tuple[str, str, str], str, str], dict[str, None]
    ] = {}  # (container, resource, unit) -> IDs, ordered
    holder: dict[tuple[str, str], tuple[str, str, str]] = {}  # (resource, ID) -> the container counted for it
    active: set[tuple[str, str, str]] = set()
    for pod in response.pod_resources:
        for container in pod.containers:
            key = (pod.namespace, pod.name, container.name)
            if len(active) < MAX_ACTIVE_CONTAINERS:
                active.add(key)
            for devices in container.devices:
                resource = by_name.get(devices.resource_name)
                if resource is None:
                    continue
                for device_id in devices.device_ids:
                    device = resource.devices.get(device_id)
                    if device is None or holder.setdefault((resource.name, device_id), key) != key:
                        continue
                    held.setdefault((key, resource.name, device.unit.uuid), {})[device_id] = None
    shares = []
    for (key, name, _), ids in held.items():
        resource = by_name[name]
        unit = resource.devices[next(iter(ids))].unit
        # a whole device is one replica
        shares.append(container_share(key, resource, unit, list(ids), len(ids), share_memory_mib(unit, len(ids))))
    return Usage(shares=tuple(shares), active_containers=frozenset(active))


class PodResourcesClient:
    """A client of the kubelet's pod-resources socket (the channel reconnects when the kubelet restarts)."""

    def __init__(self, socket: str | Path = DEFAULT_SOCKET, timeout: float = 5.0) -> None:
        self.socket = Path(socket)
        self.timeout = timeout
        # No gRPC retries: against a kubelet that is going away they repeat without limit (docs/performance.md
        # #kubelet-restart-storms); a failed read is unknown and the caller reads again.
        self._channel = grpc.insecure_channel(
            f"unix:{self.socket}",
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.enable_retries", 0)],
        )
        self._stub = pr_grpc.PodResourcesListerStub(self._channel)

    def list(self) -> pr.ListPodResourcesResponse:
        return self._stub.List(pr.ListPodResourcesRequest(), timeout=self.timeout)

    def allocatable(self) -> pr.AllocatableResourcesResponse:
        return self._stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=self.timeout)

    def close(self) -> None:
        self._channel.close()


def container_share(
    key: tuple[str, str, str],
    resource: Resource,
    unit: Unit,
    devices: list[str],
    shares: int,
    memory_limit_mib: int,
    time_sliced: bool = False,
) -> ContainerShare:
    """One container's (namespace, pod, container) holding on one unit: both node APIs' usage maps build it here.
    `time_sliced`: it runs time-sliced whatever its pool's mode (a DRA claim's SharingConfig chose timeSlicing)."""
    return ContainerShare(
        namespace=key[0],
        pod=key[1],
        container=key[2],
        resource=resource.name,
        pool=resource.pool.name,
        unit_uuid=unit.uuid,
        gpu_uuid=unit.gpu.uuid,
        devices=tuple(sorted(devices)),
        shares=shares,
        memory_limit_mib=memory_limit_mib,
        time_sliced=time_sliced or mode_of(resource.pool) is TIME_SLICED,
    )

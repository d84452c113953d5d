"""A built-in kubelet for the demo and the tests: the device-manager side of the contract.

It serves Registration on kubelet.sock and validates like the kubelet; inside Register
it dials the plugin back, calls GetDevicePluginOptions and starts ListAndWatch; it keeps
capacity/allocatable per resource; it admits pods with the kubelet's device choice
(GetPreferredAllocation as a hint, shortfall filled in random order, one Allocate per
container and resource, init containers first); and it restarts like the kubelet (every
socket deleted, kubelet.sock recreated, allocations kept). Pod-resources answers as
kubelet v1.36's does: one `ContainerDevices` per device ID, one per NUMA node when the
device has topology (none when it has not), in no set order; restartable (sidecar) init
containers, then app containers, and no ordinary init container; CPU and memory left empty
(no CPU or memory manager policy). It writes its allocations to
`kubelet_internal_checkpoint` in the kubelet's JSON (IDs per NUMA node, -1 without
topology) once per admitted container, on every ListAndWatch message and on pod deletion.
Simplifications: no Topology Manager alignment, no reuse of init-container devices, no
checksum (0). docs/kubelet.md lists which facts were read from the kubelet's code.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import stat
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ..api import deviceplugin_pb2 as pb
from ..api import deviceplugin_pb2_grpc as pb_grpc
from ..api import podresources_pb2 as pr
from ..api import podresources_pb2_grpc as pr_grpc
from ..config.names import resource_name_problem
from ..model.devices import HEALTHY
from ..model.pods import PodRef, bare_container_id
from ..plugin.server import API_VERSION, KUBELET_SOCKET

log = logging.getLogger(__name__)

DIAL_TIMEOUT = 10.0  # the kubelet's blocking dial in Register


class AdmissionError(Exception):
    """Pod admission failed, with the message the kubelet would put on the pod."""


NO_TOPOLOGY = -1  # the checkpoint's NUMA key of devices without topology


@dataclass
class Container:
    name: str
    requests: dict[str, int]
    claims: list[pr.DynamicResource] = field(default_factory=list)  # DRA claims, listed as the kubelet prepared them
    restartable: bool = False  # an init container with restartPolicy Always (a sidecar); only in init_containers


@dataclass
class Pod:
    name: str
    containers: list[Container]
    namespace: str = "default"
    init_containers: list[Container] = field(
        default_factory=list
    )  # admitted first; pod-resources lists the sidecars only
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    container_ids: dict[str, str] = field(default_factory=dict)  # container name -> runtime ID, set at admission
    active: bool = True  # False once the pod reached a terminal phase


class TokenBucket:
    """The kubelet's pod-resources rate limit: `rate` per second, bursts of `burst`."""

    def __init__(self, rate: float = 100.0, burst: int = 10) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens < 1:
                return False
            self.tokens -= 1
            return True


@dataclass
class ResourceStatus:
    """The kubelet's view of one resource."""

    capacity: int
    allocatable: int
    healthy: list[str]
    unhealthy: list[str]
    registered: bool
    messages: int  # ListAndWatch messages received since registration
    topology: dict[str, list[int]]
    endpoint: str = ""  # the socket (file name) of the registration it holds


class _Endpoint:
    """A registered plugin as the kubelet holds it."""

    def __init__(self, resource: str, socket: Path, channel: grpc.Channel, options: pb.DevicePluginOptions) -> None:
        self.resource = resource
        self.socket = socket
        self.channel = channel
        self.stub = pb_grpc.DevicePluginStub(channel)
        self.options = options
        self.devices: dict[str, pb.Device] = {}
        self.messages = 0
        self.stopped = False


class KubeletSimulator(pb_grpc.RegistrationServicer):
    def __init__(
        self,
        plugin_dir: Path,
        seed: int | None = None,
        pod_resources_socket: Path | None = None,
        rate_limit: TokenBucket | None = None,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.socket = self.plugin_dir / KUBELET_SOCKET
        # The real socket is <kubelet root>/pod-resources/kubelet.sock, beside (not in) device-plugins.
        self.pod_resources_socket = Path(pod_resources_socket or self.plugin_dir / "pod-resources" / KUBELET_SOCKET)
        self.rate_limit = rate_limit or TokenBucket()
        self.register_requests: list[pb.RegisterRequest] = []
        self.register_times: list[float] = []  # time.time() at which each Register arrived
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._endpoints: dict[str, _Endpoint] = {}
        self._pods: dict[str, Pod] = {}
        self._allocated: dict[tuple[str, str, str], list[str]] = {}  # (pod uid, container, resource) -> IDs
        self._numa: dict[
            tuple[str, str, str], dict[int, list[str]]
        ] = {}  # the same, per NUMA node (-1: none), as checkpointed
        self._responses: dict[tuple[str, str, str], pb.ContainerAllocateResponse] = {}
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = (
            None  # the server's; shut down with it, not one per start kept
        )
        self._running = False
        self._generation = 0  # one per start: a Register that outlives its kubelet is refused
        self._accepted: dict[tuple[int, str], int] = {}  # (generation, resource) -> accepted Register calls
        self.started_at: dict[int, float] = {}  # generation -> time.monotonic() once it listens
        self.first_accepted_at: dict[tuple[int, str], float] = {}  # (generation, resource) -> time.monotonic()

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
        self.pod_resources_socket.unlink(missing_ok=True)
        self._executor = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubelet")
        self._server = grpc.server(self._executor)
        pb_grpc.add_RegistrationServicer_to_server(self, self._server)
        pr_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), self._server)
        self._server.add_insecure_port(f"unix:{self.socket}")
        self._server.add_insecure_port(f"unix:{self.pod_resources_socket}")
        self._running = True
        self._generation += 1
        self._server.start()
        self.started_at[self._generation] = time.monotonic()
        log.info("kubelet simulator listening on %s", self.socket)

    def stop(self) -> None:
        with self._cond:
            self._running = False
            endpoints = list(self._endpoints.values())
            for endpoint in endpoints:
                endpoint.stopped = True
            self._cond.notify_all()
        for endpoint in endpoints:
            endpoint.channel.close()
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        self.socket.unlink(missing_ok=True)
        self.pod_resources_socket.unlink(missing_ok=True)

    def restart(self) -> None:
        """Like a kubelet restart: connections drop, every socket in the directory is deleted, kubelet.sock comes back.

        Allocations survive (the real kubelet keeps them in its checkpoint); device lists do not.
        """
        self.stop()
        for (
            entry
        ) in self.plugin_dir.iterdir():  # as CleanupPluginDirectory: a link is followed, one that fails is skipped
            try:
                if entry.name != "kubelet_internal_checkpoint" and stat.S_ISSOCK(entry.stat().st_mode):
                    entry.unlink(missing_ok=True)
            except OSError as err:
                log.warning("cannot remove %s: %s", entry, err)
        with self._cond:
            for endpoint in self._endpoints.values():
                endpoint.devices = {}
        self.start()

    # --- Registration service -------------------------------------------------------------
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.register_times.append(time.time())
        self.register_requests.append(request)
        generation = self._generation
        if request.version != API_VERSION:
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f'requested API version "{request.version}" is not supported by kubelet. Supported version is '
                f'["{API_VERSION}"]',
            )
        if resource_name_problem(request.resource_name) is not None:
            context.abort(grpc.StatusCode.UNKNOWN, f'the ResourceName "{request.resource_name}" is invalid')
        # The kubelet joins the endpoint to its directory; anything but a bare file name fails to dial.
        socket = self.plugin_dir / request.endpoint.lstrip("/")
        channel = grpc.insecure_channel(f"unix:{socket}")
        try:
            grpc.channel_ready_future(channel).result(timeout=DIAL_TIMEOUT)
            options = pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty())
        except (grpc.FutureTimeoutError, grpc.RpcError) as err:
            channel.close()
            context.abort(grpc.StatusCode.UNKNOWN, f"failed to dial device plugin: {err!r}")
        endpoint = _Endpoint(request.resource_name, socket, channel, options)
        with self._cond:
            if not self._running or self._generation != generation:
                channel.close()
                context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is shutting down")
            old = self._endpoints.get(request.resource_name)
            self._endpoints[request.resource_name] = endpoint  # newest registration wins
            key = (generation, request.resource_name)
            self._accepted[key] = self._accepted.get(key, 0) + 1
            self.first_accepted_at.setdefault(key, time.monotonic())
            self._cond.notify_all()
        if old is not None:
            old.stopped = True  # replaced; its connection is left open, as the kubelet does
        threading.Thread(
            target=self._consume, args=(endpoint,), name=f"lw-{request.resource_name}", daemon=True
        ).start()
        log.info("registered %s at %s", request.resource_name, request.endpoint)
        return pb.Empty()

    def _write_checkpoint(self) -> None:
        """The kubelet's checkpoint of allocations, as Go's encoding/json writes it (struct fields in order, map keys
        sorted, no spaces; no entries is `null`), written whole, then renamed, as the kubelet's checkpoint manager
        does."""
        with self._cond:
            entries = [
                {
                    "PodUID": uid,
                    "ContainerName": container,
                    "ResourceName": resource,
                    "DeviceIDs": {
                        str(n): list(ids)
                        for n, ids in sorted(self._numa[(uid, container, resource)].items(), key=lambda i: str(i[0]))
                    },
                    "AllocResp": base64.b64encode(
                        self._responses[(uid, container, resource)].SerializeToString()
                    ).decode(),
                }
                for (uid, container, resource) in self._allocated
                if (uid, container, resource) in self._responses
            ]
            registered = {name: self._status(self._endpoints[name]).healthy for name in sorted(self._endpoints)}
            text = json.dumps(
                {"Data": {"PodDeviceEntries": entries or None, "RegisteredDevices": registered}, "Checksum": 0},
                separators=(",", ":"),
                ensure_ascii=False,
            )
            text = (
                text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            )  # Go's HTML-safe escaping
            path = self.plugin_dir / "kubelet_internal_checkpoint"
            temporary = path.with_name(path.name + ".tmp")
            temporary.write_text(text)
            os.replace(temporary, path)

    def _consume(self, endpoint: _Endpoint) -> None:
        try:
            for message in endpoint.stub.ListAndWatch(pb.Empty()):
                with self._cond:
                    endpoint.devices = {d.ID: d for d in message.devices}
                    endpoint.messages += 1
                    self._cond.notify_all()
                try:
                    self._write_checkpoint()  # every message rewrites the checkpoint (its healthy IDs)
                except OSError as err:  # the kubelet logs a failed write and goes on
                    log.warning("cannot write the checkpoint: %s", err)
        except grpc.RpcError as err:
            log.info("ListAndWatch of %s ended: %s", endpoint.resource, err.code().name)
        except ValueError:  # the channel was closed before the stream began
            log.info("ListAndWatch of %s not started: connection closed", endpoint.resource)
        with self._cond:
            # Keyed by resource name, as in the kubelet: the current endpoint is the one disconnected.
            current = self._endpoints.get(endpoint.resource)
            if self._running and current is not None and not current.stopped:
                current.stopped = True
                current.channel.close()
            self._cond.notify_all()

    # --- the kubelet's view -----------------------------------------------------------------
    def accepted_registrations(self) -> dict[tuple[int, str], int]:
        """Accepted Register calls per (kubelet generation, resource): more than 1 is a needless re-registration."""
        with self._cond:
            return dict(self._accepted)

    def resources(self) -> dict[str, ResourceStatus]:
        with self._cond:
            return {name: self._status(e) for name, e in self._endpoints.items()}

    def _status(self, endpoint: _Endpoint) -> ResourceStatus:
        healthy = [i for i, d in endpoint.devices.items() if d.health == HEALTHY and not endpoint.stopped]
        unhealthy = [i for i in endpoint.devices if i not in healthy]
        return ResourceStatus(
            capacity=len(endpoint.devices),
            allocatable=len(healthy),
            healthy=healthy,
            unhealthy=unhealthy,
            registered=not endpoint.stopped,
            messages=endpoint.messages,
            topology={i: [n.ID for n in d.topology.nodes] for i, d in endpoint.devices.items()},
            endpoint=endpoint.socket.name,
        )

    def wait_for(self, predicate: Callable[[dict[str, ResourceStatus]], bool], timeout: float = 10.0) -> bool:
        """Block until predicate(resources()) holds; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: predicate({n: self._status(e) for n, e in self._endpoints.items()}), timeout
            )

    def endpoint_options(self, resource: str) -> pb.DevicePluginOptions:
        with self._cond:
            return self._endpoints[resource].options

    def drop_connection(self, resource: str) -> None:
        """Close the kubelet's connection to a registered resource's plugin (a broken transport, as tests make it)."""
        with self._cond:
            self._endpoints[resource].channel.close()

    def stub(self, resource: str) -> pb_grpc.DevicePluginStub:
        """The kubelet's client for a registered resource (tests call it directly)."""
        with self._cond:
            return self._endpoints[resource].stub

    # --- admission ------------------------------------------------------------------------
    def admit(self, pod: Pod) -> dict[str, dict[str, pb.ContainerAllocateResponse]]:
        """Allocate devices for every container; on failure roll back and raise AdmissionError."""
        results: dict[str, dict[str, pb.ContainerAllocateResponse]] = {}
        with self._cond:
            self._pods[pod.uid] = pod
        pod.container_ids = {
            c.name: f"containerd://{uuid.uuid4().hex}{uuid.uuid4().hex}"
            for c in [*pod.init_containers, *pod.containers]
        }
        try:
            for container in [*pod.init_containers, *pod.containers]:
                results[container.name] = {}
                for resource, count in container.requests.items():
                    key = (pod.uid, container.name, resource)
                    ids = self._devices_to_allocate(resource, count)
                    with self._cond:
                        self._allocated[key] = ids  # held while Allocate runs, as the kubelet does
                    response = self._allocate(resource, ids)
                    with self._cond:
                        self._responses[key] = response
                        self._numa[key] = self._per_numa(resource, ids)
                    results[container.name][resource] = response
                if container.requests:
                    self._write_checkpoint()  # once per container, after all its resources
        except AdmissionError:
            self.delete_pod(pod.uid)
            raise
        return results

    def grants(self) -> list[tuple[str, str, str, list[str], pb.ContainerAllocateResponse]]:
        """Every allocation the kubelet holds now: (pod UID, container, resource, device IDs, the plugin's answer)."""
        with self._cond:
            return [
                (*key, list(ids), self._responses[key])
                for key, ids in self._allocated.items()
                if key in self._responses
            ]

    def allocated(self, pod: Pod) -> dict[str, dict[str, list[str]]]:
        """Device IDs per container and resource of an admitted pod."""
        with self._cond:
            out: dict[str, dict[str, list[str]]] = {}
            for (uid, container, resource), ids in self._allocated.items():
                if uid == pod.uid:
                    out.setdefault(container, {})[resource] = ids
            return out

    def pods(self) -> list[Pod]:
        """Pods the kubelet knows (for the simulated pod directory)."""
        with self._cond:
            return list(self._pods.values())

    def pod_resources(self, name: str | None = None, namespace: str | None = None) -> list[pr.PodResources]:
        """What pod-resources lists: the active pods (those named, when given) with their devices."""
        with self._cond:
            return [
                self._pod_resources(p)
                for p in self._pods.values()
                if p.active and (name is None or (p.name, p.namespace) == (name, namespace))
            ]

    def allocatable_devices(self) -> list[pr.ContainerDevices]:
        """What pod-resources' GetAllocatableResources lists: every healthy device, one entry per ID and NUMA node."""
        with self._cond:
            return [
                entry
                for name, endpoint in self._endpoints.items()
                for entry in self._entries(name, self._per_numa(name, self._status(endpoint).healthy))
            ]

    def _pod_resources(self, pod: Pod) -> pr.PodResources:
        """One pod as v1.36's List has it: sidecars, then app containers; CPU and memory left empty."""
        listed = [c for c in pod.init_containers if c.restartable] + pod.containers
        containers = []
        for container in listed:
            devices = []
            for resource in container.requests:
                per_numa = self._numa.get((pod.uid, container.name, resource))
                if per_numa:
                    devices.extend(self._entries(resource, per_numa))
            self._rng.shuffle(devices)  # Go map iteration: effectively random
            containers.append(
                pr.ContainerResources(name=container.name, devices=devices, dynamic_resources=container.claims)
            )
        return pr.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)

    def _per_numa(self, resource: str, ids: list[str]) -> dict[int, list[str]]:
        """IDs per NUMA node as the kubelet records an allocation: a device under each of its nodes, or under -1."""
        endpoint = self._endpoints.get(resource)
        out: dict[int, list[str]] = {}
        for i in ids:
            device = endpoint.devices.get(i) if endpoint else None
            nodes = [n.ID for n in device.topology.nodes] if device is not None and device.HasField("topology") else []
            for node in nodes or [NO_TOPOLOGY]:
                out.setdefault(node, []).append(i)
        return out

    @staticmethod
    def _entries(resource: str, per_numa: dict[int, list[str]]) -> list[pr.ContainerDevices]:
        """Pod-resources' entries for IDs per NUMA node: one per ID and node; no topology field for a device without."""
        entries = []
        for node, ids in per_numa.items():
            for i in ids:
                if node == NO_TOPOLOGY:
                    entries.append(pr.ContainerDevices(resource_name=resource, device_ids=[i]))
                else:
                    entries.append(
                        pr.ContainerDevices(
                            resource_name=resource,
                            device_ids=[i],
                            topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=node)]),
                        )
                    )
        return entries

    def pod_directory(self) -> SimulatedPodDirectory:
        return SimulatedPodDirectory(self)

    def finish_pod(self, uid: str) -> None:
        """The pod reached a terminal phase: it is no longer active (pod-resources stops listing it)."""
        with self._cond:
            self._pods[uid].active = False

    def delete_pod(self, uid: str) -> None:
        with self._cond:
            self._pods.pop(uid, None)
            for key in [k for k in self._allocated if k[0] == uid]:
                del self._allocated[key]
                self._responses.pop(key, None)
                self._numa.pop(key, None)
        self._write_checkpoint()

    def _devices_to_allocate(self, resource: str, needed: int) -> list[str]:
        with self._cond:
            endpoint = self._endpoints.get(resource)
            if endpoint is None:
                raise AdmissionError(f"cannot allocate unregistered device {resource}")
            if endpoint.stopped:
                raise AdmissionError(
                    f"Allocate failed due to endpoint {endpoint.socket} has been stopped, which is unexpected"
                )
            status = self._status(endpoint)
            if not status.healthy:
                raise AdmissionError(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
            in_use = {i for (_, _, r), ids in self._allocated.items() if r == resource for i in ids}
            available = [i for i in status.healthy if i not in in_use]
            if len(available) < needed:
                raise AdmissionError(
                    f"requested number of devices unavailable for {resource}. Requested: {needed}, "
                    f"Available: {len(available)}"
                )
            stub, options = endpoint.stub, endpoint.options
        chosen: list[str] = []
        if options.get_preferred_allocation_available:
            request = pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=needed)
                ]
            )
            try:
                response = stub.GetPreferredAllocation(request)
            except grpc.RpcError as err:
                raise AdmissionError(
                    f"device plugin GetPreferredAllocation rpc failed with err: {_rpc_text(err)}"
                ) from None
            except ValueError:  # the endpoint was replaced (its channel closed) since it was looked up
                raise AdmissionError(
                    f"Allocate failed due to endpoint {resource} has been stopped, which is unexpected"
                ) from None
            if response.container_responses:
                preferred = response.container_responses[0].deviceIDs
                chosen = [i for i in dict.fromkeys(preferred) if i in available][:needed]
        rest = [i for i in available if i not in chosen]
        self._rng.shuffle(rest)  # Go set iteration: effectively random
        return chosen + rest[: needed - len(chosen)]

    def _allocate(self, resource: str, ids: list[str]) -> pb.ContainerAllocateResponse:
        stub = self.stub(resource)
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        try:
            response = stub.Allocate(request)
        except grpc.RpcError as err:
            raise AdmissionError(f"Allocate failed due to {_rpc_text(err)}, which is unexpected") from None
        except ValueError:  # the endpoint was replaced (its channel closed) since it was looked up
            raise AdmissionError(
                f"Allocate failed due to endpoint {resource} has been stopped, which is unexpected"
            ) from None
        if not response.container_responses:
            raise AdmissionError(
                "Allocate failed due to no containers return in allocation response, which is unexpected"
            )
        return response.container_responses[0]


class SimulatedPodDirectory:
    """The pods the built-in kubelet runs, as the Kubernetes API would list them (UIDs and container IDs)."""

    def __init__(self, kubelet: KubeletSimulator) -> None:
        self.kubelet = kubelet

    def pods(self) -> list[PodRef]:
        return [
            PodRef(
                uid=p.uid,
                namespace=p.namespace,
                name=p.name,
                containers={bare_container_id(cid): name for name, cid in p.container_ids.items()},
                finished=not p.active,
            )
            for p in self.kubelet.pods()
        ]


class _PodResources(pr_grpc.PodResourcesListerServicer):
    """The pod-resources API v1 as the kubelet serves it: active pods only, rate-limited."""

    def __init__(self, kubelet: KubeletSimulator) -> None:
        self.kubelet = kubelet

    def _limit(self, context: grpc.ServicerContext) -> None:
        if not self.kubelet.rate_limit.take():
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")

    def List(self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
        self._limit(context)
        return pr.ListPodResourcesResponse(pod_resources=self.kubelet.pod_resources())

    def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        self._limit(context)
        return pr.AllocatableResourcesResponse(devices=self.kubelet.allocatable_devices())

    def Get(self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext) -> pr.GetPodResourcesResponse:
        self._limit(context)
        found = self.kubelet.pod_resources(name=request.pod_name, namespace=request.pod_namespace)
        if found:
            return pr.GetPodResourcesResponse(pod_resources=found[0])
        # a plain Go error in the kubelet: gRPC UNKNOWN with its text
        context.abort(grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found")
        raise AssertionError("context.abort raises")


def _rpc_text(err: grpc.RpcError) -> str:
    code = "".join(part.capitalize() for part in err.code().name.split("_"))
    return f"rpc error: code = {code} desc = {err.details()}"

"""One gRPC DevicePlugin server per resource, and its registration with the kubelet."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from .allocator import AllocationError, container_response, preferred_allocation
from .api import deviceplugin_pb2 as pb
from .api import deviceplugin_pb2_grpc as pb_grpc
from .resources import Resource

if TYPE_CHECKING:
    from .metrics import PluginMetrics

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
SOCKET_PREFIX = "gpu-share-"
# GetPreferredAllocation carries every available ID: allow far more than grpc's 4 MiB default.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
_instance_counter = itertools.count()


@dataclass(frozen=True)
class Timings:
    """Intervals and deadlines; tests shorten them."""

    register_timeout: float = 30.0  # above the kubelet's own 10 s dial timeout
    backoff_initial: float = 0.1
    backoff_max: float = 5.0
    watch_interval: float = 0.2
    stop_grace: float = 1.0


def kubelet_identity(path: Path) -> tuple[int, int] | None:
    """(inode, ctime) of kubelet.sock, or None while it is absent: a change means the kubelet restarted."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_ctime_ns)


class _Instance:
    """One serving instance: its own socket, gRPC server and stop signal. A restart makes a new one."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.stopped = threading.Event()
        self.wake = threading.Event()
        self.server: grpc.Server | None = None
        self.registered_with: tuple[int, int] | None = None
        # Registration requests: at most one loop runs; a request while it runs makes it go round again.
        self.state = threading.Lock()
        self.pending = False
        self.loop_running = False


class DevicePluginServer:
    """Serves one resource on its own socket, registers it, and re-serves on kubelet restarts."""

    def __init__(self, resource: Resource, plugin_dir: Path, timings: Timings = Timings(), metrics: "PluginMetrics | None" = None) -> None:
        self.resource = resource
        self.metrics = metrics
        self.plugin_dir = Path(plugin_dir)
        self.timings = timings
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self.registered = threading.Event()
        self._changed = threading.Condition()
        self._unhealthy: frozenset[str] = frozenset()
        self._available = True  # False: every device Unhealthy (an MPS pool whose daemon is down)
        self._quarantined: frozenset[str] = frozenset()  # device IDs held back by the residue guard
        self._health_keys = resource.health_keys()
        self._version = 0
        self._instance: _Instance | None = None
        self._lifecycle = threading.Lock()

    # --- state -----------------------------------------------------------------------------
    @property
    def socket_path(self) -> Path | None:
        return self._instance.socket_path if self._instance else None

    @property
    def registered_with(self) -> tuple[int, int] | None:
        return self._instance.registered_with if self._instance else None

    @property
    def unhealthy(self) -> frozenset[str]:
        return self._unhealthy

    @property
    def available(self) -> bool:
        return self._available

    def set_unhealthy(self, uuids: frozenset[str]) -> None:
        """Mark GPUs or MIG instances unhealthy (with every device on them); streams get a new list only on change."""
        self._update(unhealthy=uuids & self._health_keys)

    def set_available(self, available: bool) -> None:
        """Mark every device Unhealthy (False) or back to its own health (True)."""
        self._update(available=available)

    def set_quarantined(self, device_ids: frozenset[str]) -> None:
        """Advertise these devices Unhealthy (free devices on a GPU that holds a finished tenant's memory)."""
        self._update(quarantined=device_ids & self.resource.devices.keys())

    def _update(self, unhealthy: frozenset[str] | None = None, available: bool | None = None, quarantined: frozenset[str] | None = None) -> None:
        with self._changed:
            new = (
                self._unhealthy if unhealthy is None else unhealthy,
                self._available if available is None else available,
                self._quarantined if quarantined is None else quarantined,
            )
            if new == (self._unhealthy, self._available, self._quarantined):
                return
            self._unhealthy, self._available, self._quarantined = new
            self._version += 1
            self._changed.notify_all()

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Serve on a fresh socket, then register in the background (retrying with backoff)."""
        with self._lifecycle:
            self._start_locked()

    def stop(self) -> None:
        """End the streams, stop serving and remove the socket."""
        with self._lifecycle:
            self._stop_locked()

    def restart(self, reason: str, only: _Instance | None = None) -> None:
        """Stop, then serve and register anew; with `only`, skip unless that instance is still current."""
        with self._lifecycle:
            if only is not None and self._instance is not only:
                return
            log.info("restarting %s: %s", self.resource.name, reason)
            self._stop_locked()
            self._start_locked()

    def _start_locked(self) -> None:
        name = f"{SOCKET_PREFIX}{self.resource.label}-{os.getpid()}-{next(_instance_counter)}.sock"
        instance = _Instance(self.plugin_dir / name)
        instance.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"dp-{self.resource.label}"),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
        )
        pb_grpc.add_DevicePluginServicer_to_server(_Servicer(self, instance), instance.server)
        instance.server.add_insecure_port(f"unix:{instance.socket_path}")
        instance.server.start()
        self._instance = instance
        log.info("serving %s on %s", self.resource.name, instance.socket_path)
        self._start_registering(instance)

    def _start_registering(self, instance: _Instance) -> None:
        with instance.state:
            instance.pending = True
            if instance.loop_running:
                return
            instance.loop_running = True
        threading.Thread(target=self._register_loop, args=(instance,), name=f"register-{self.resource.label}", daemon=True).start()

    def _stop_locked(self) -> None:
        instance, self._instance = self._instance, None
        if instance is None:
            return
        self.registered.clear()
        instance.stopped.set()
        instance.wake.set()
        with self._changed:
            self._changed.notify_all()
        if instance.server is not None:
            instance.server.stop(self.timings.stop_grace).wait()
        instance.socket_path.unlink(missing_ok=True)

    def stream_lost(self, instance: _Instance) -> None:
        """The kubelet ended a ListAndWatch stream we did not end: it never redials, so register again."""
        if instance is not self._instance or instance.stopped.is_set():
            return
        log.warning("the kubelet ended the ListAndWatch stream of %s; registering again", self.resource.name)
        with instance.state:
            self.registered.clear()
            instance.registered_with = None
        self._start_registering(instance)

    def wake(self) -> None:
        """Cut a registration backoff short (kubelet.sock just appeared)."""
        if self._instance:
            self._instance.wake.set()

    def _register_loop(self, instance: _Instance) -> None:
        while True:
            with instance.state:
                if not instance.pending or instance.stopped.is_set():
                    instance.loop_running = False
                    return
                instance.pending = False
            self._register_until_done(instance)

    def _register_until_done(self, instance: _Instance) -> None:
        delay = self.timings.backoff_initial
        while not instance.stopped.is_set():
            identity = kubelet_identity(self.kubelet_socket)
            if identity is None:
                reason = f"{self.kubelet_socket} does not exist yet"
            else:
                try:
                    self._register_once(instance)
                    with instance.state:
                        instance.registered_with = identity
                        if not instance.pending:
                            self.registered.set()
                    if self.metrics:
                        self.metrics.registered(self.resource.name)
                    log.info("registered %s with the kubelet (endpoint %s)", self.resource.name, instance.socket_path.name)
                    return
                except grpc.RpcError as err:
                    reason = f"Register failed: {err.code().name}: {err.details()}"
            log.warning("cannot register %s (%s); retrying in %.1fs", self.resource.name, reason, delay)
            instance.wake.wait(delay)
            if instance.wake.is_set():
                instance.wake.clear()
                delay = self.timings.backoff_initial
            else:
                delay = min(delay * 2, self.timings.backoff_max)

    def _register_once(self, instance: _Instance) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=instance.socket_path.name,
            resource_name=self.resource.name,
            options=OPTIONS,
        )
        with grpc.insecure_channel(f"unix:{self.kubelet_socket}") as channel:
            pb_grpc.RegistrationStub(channel).Register(request, timeout=self.timings.register_timeout)


class _Servicer(pb_grpc.DevicePluginServicer):
    """The DevicePlugin RPCs for one serving instance."""

    def __init__(self, plugin: DevicePluginServer, instance: _Instance) -> None:
        self.plugin = plugin
        self.instance = instance
        self.resource = plugin.resource

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return OPTIONS

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext):
        plugin, stopped = self.plugin, self.instance.stopped
        if not context.add_callback(self._stream_ended):
            return
        sent = None
        while True:
            with plugin._changed:
                while sent == plugin._version and not stopped.is_set() and context.is_active():
                    plugin._changed.wait()
                if stopped.is_set() or not context.is_active():
                    return
                sent, unhealthy, available, held = plugin._version, plugin._unhealthy, plugin._available, plugin._quarantined
            yield self.resource.list_response(unhealthy, all_unhealthy=not available, unhealthy_ids=held)
            log.debug("sent %d devices of %s (%d GPUs unhealthy)", len(self.resource.devices), self.resource.name, len(unhealthy))

    def _stream_ended(self) -> None:
        """Runs when the stream terminates for any reason (gRPC may never resume the generator)."""
        with self.plugin._changed:
            self.plugin._changed.notify_all()
        if not self.instance.stopped.is_set():
            self.plugin.stream_lost(self.instance)

    def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext) -> pb.PreferredAllocationResponse:
        responses = [
            pb.ContainerPreferredAllocationResponse(
                deviceIDs=preferred_allocation(self.resource, req.available_deviceIDs, req.must_include_deviceIDs, req.allocation_size)
            )
            for req in request.container_requests
        ]
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        if not request.container_requests:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"AllocateRequest for {self.resource.name} has no container requests")
        if not self.plugin.available:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the MPS control daemon of pool {self.resource.pool.name} is not ready")
        started = time.perf_counter()
        metrics = self.plugin.metrics
        try:
            responses = [container_response(self.resource, req.devices_ids, self.plugin.unhealthy | self.plugin._quarantined) for req in request.container_requests]
        except AllocationError as err:
            log.warning("refused Allocate of %s: %s", self.resource.name, err.message)
            if metrics:
                metrics.allocated(self.resource.name, False, time.perf_counter() - started)
            context.abort(err.code, err.message)
        if metrics:
            metrics.allocated(self.resource.name, True, time.perf_counter() - started)
        for req, resp in zip(request.container_requests, responses):
            log.info("allocated %s: %s -> %s", self.resource.name, ",".join(req.devices_ids), resp.envs.get("CUDA_VISIBLE_DEVICES", ""))
        return pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

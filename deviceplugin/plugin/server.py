"""One gRPC DevicePlugin server per resource, and its registration with the kubelet.

Everything here runs on the plugin's one asyncio loop (`aioloop.shared_loop()`) with `grpc.aio`: a
ListAndWatch stream is a coroutine, so any number of open streams costs Allocate nothing. The manager
drives the lifecycle (`serve`, `shutdown`, `request_registration`); while serving, a server follows the
node's runtime state (state.NodeState, written from other threads) and keeps its resource's part of it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from .. import defaults
from ..alloc.container import AllocationError, Refusal, container_grant
from ..alloc.placement import preferred_allocation
from ..api import deviceplugin_pb2 as pb
from ..api import deviceplugin_pb2_grpc as pb_grpc
from ..errors import StartupError
from ..logs import brief, safe_text
from ..model.devices import Resource
from ..state import NodeState, NodeView
from . import wire

if TYPE_CHECKING:
    from ..obs.metrics import PluginMetrics

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
SOCKET_PREFIX = "gpu-share-"
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the terminating NUL
MAX_DEVICE_ID_BYTES = 256  # share IDs are ~45 bytes; anything far longer is not ours
MAX_CONTAINER_REQUESTS = 64  # the kubelet sends one per call; far more is not a kubelet
MAX_OTHER_STREAMS = 64  # ListAndWatch streams beside the kubelet's own (debugging clients, monitors): bounded memory
MAX_ERROR_CHARS = 1000  # gRPC refuses status details over 8 KiB of metadata; ours stay far below
MAX_PREFERRED_WAITING = 8  # GetPreferredAllocation calls of one resource queued (the kubelet sends one at a time)
INLINE_PREFERRED_IDS = 1024  # a request with more available IDs (a few ms of placement) is placed off the event loop
MAX_RECENT_GRANTS = 1024  # Allocate answers remembered for `Timings.grant_window` (the kubelet admits one pod at a time)
OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
_instance_counter = itertools.count()


@dataclass(frozen=True)
class Timings:
    """Intervals and deadlines; tests shorten them."""

    register_timeout: float = defaults.REGISTER_TIMEOUT
    backoff_initial: float = 0.1
    backoff_max: float = defaults.BACKOFF_MAX
    watch_interval: float = defaults.WATCH_INTERVAL  # MPS markers and sockets are polled; kubelet.sock by inotify too
    stop_grace: float = 1.0
    pending_interval: float = defaults.PENDING_INTERVAL  # how often a GPU waiting for its holders to leave is looked at
    # A grant counts as a hold this long after Allocate answered, covering the moment before the kubelet records it.
    grant_window: float = 1.0


class SocketPathError(StartupError):
    """A socket path the kernel cannot bind."""


def kubelet_identity(path: Path) -> tuple[int, int] | None:
    """(inode, ctime) of kubelet.sock, or None while it is absent: a change means the kubelet restarted."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_ctime_ns)


def socket_path_for(plugin_dir: Path, resource: Resource, serial: int | None = None) -> Path:
    """A fresh socket path per serving instance (docs/kubelet.md#re-registration), of the same length for every instance of
    the resource (the serial is three digits, modulo 1000), so a path that fits once fits always; SocketPathError
    when it does not."""
    serial = next(_instance_counter) if serial is None else serial
    path = plugin_dir / f"{SOCKET_PREFIX}{resource.label}-{os.getpid()}-{serial % 1000:03d}.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise SocketPathError(
            f"pool {resource.pool.name}: socket path {path} is {len(os.fsencode(path))} bytes, over the kernel's "
            f"limit of {MAX_SOCKET_PATH}; use a shorter --plugin-dir or pool name"
        )
    return path


class DeviceHealth(NamedTuple):
    """One resource's part of the node state, as its ListAndWatch and Allocate use it."""

    version: int  # +1 whenever the rest changes: a stream sends a new list only then
    unhealthy: frozenset[str]  # GPU or MIG UUIDs of this resource's devices (pending GPUs included)
    available: bool  # False: every device Unhealthy (an MPS pool whose daemon is down)
    held_back: frozenset[str]  # device IDs quarantined by the residue guard
    pending: frozenset[str]  # GPUs kept in their old shape until their holders leave (alloc.pending)


class _Instance:
    """One serving instance: its own socket, gRPC server and registration. A restart makes a new one."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.stopped = asyncio.Event()
        self.wake = asyncio.Event()
        self.server: grpc.aio.Server | None = None
        self.registered_with: tuple[int, int] | None = None
        self.register_task: asyncio.Task[None] | None = None
        self.pending = False  # asked to register again while a registration runs
        self.registering = False  # a Register call is in flight
        # The kubelet calls GetDevicePluginOptions inside our Register, then opens ListAndWatch on the same
        # connection: the first stream after that call is the kubelet's own (docs/kubelet.md#registration).
        self.expect_kubelet_stream = False
        self.kubelet_stream: object | None = None  # the latest kubelet stream; an older one ending is no signal
        self.other_streams = 0


class DevicePluginServer:
    """Serves one resource on its own socket and registers it with the kubelet."""

    def __init__(
        self,
        resource: Resource,
        plugin_dir: Path,
        timings: Timings = Timings(),
        metrics: Callable[[], PluginMetrics | None] = lambda: None,
        state: NodeState | None = None,
    ) -> None:
        self.resource = resource
        self.device_list = wire.EncodedDeviceList(resource)
        self.state = state or NodeState()
        self.metrics = metrics
        self.plugin_dir = Path(plugin_dir)
        self.timings = timings
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self.registered = threading.Event()  # set only by the current instance's successful Register
        self.register_calls = 0
        self.registrations = 0  # accepted by the kubelet
        self.recent_grants: deque[tuple[float, tuple[str, ...]]] = deque(maxlen=MAX_RECENT_GRANTS)  # (monotonic time, IDs)
        self.preferred_waiting = 0  # GetPreferredAllocation calls queued or running
        self._preferred_turn: asyncio.Semaphore | None = None  # one large placement at a time, made on the loop
        self._state = threading.Lock()
        self._health = DeviceHealth(0, frozenset(), True, frozenset(), frozenset())
        self._followed = 0  # the NodeState version the health was taken from
        self._unsubscribe: Callable[[], None] | None = None
        self._health_keys = resource.health_keys()
        self._changed: asyncio.Event | None = None  # replaced on every change; streams wait on it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._instance: _Instance | None = None

    # --- state (any thread) ------------------------------------------------------------------
    @property
    def socket_path(self) -> Path | None:
        instance = self._instance
        return instance.socket_path if instance else None

    @property
    def registered_with(self) -> tuple[int, int] | None:
        instance = self._instance
        return instance.registered_with if instance else None

    @property
    def serving(self) -> bool:
        return self._instance is not None

    def health(self) -> DeviceHealth:
        """This resource's health now (any thread)."""
        with self._state:
            return self._health

    async def health_changed(self, version: int) -> None:
        """On the loop: return once the health is newer than `version`, or the serving instance stops."""
        changed = self._changed
        if self._health.version == version and changed is not None:
            await changed.wait()

    def _follow(self, view: NodeView) -> None:
        """A NodeState subscriber: keep this resource's part; streams get a new list only when that part changed."""
        with self._state:
            if view.version <= self._followed:
                return
            self._followed = view.version
            current = self._health
            pending = frozenset(view.pending_gpus.keys() & self._health_keys)
            new = DeviceHealth(
                current.version,
                (view.unhealthy & self._health_keys) | pending,
                self.resource.pool.name not in view.unavailable_pools,
                frozenset(view.quarantined_devices & self.resource.devices.keys()),
                pending,
            )
            if new == current:
                return
            self._health = new._replace(version=current.version + 1)
            loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._wake_streams)

    def _wake_streams(self) -> None:
        """On the loop: every waiting ListAndWatch looks at the state again."""
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    # --- lifecycle (on the loop, driven by the manager) ---------------------------------------
    async def serve(self) -> None:
        """Serve on a fresh socket, then register in the background (retrying with backoff)."""
        self._loop = asyncio.get_running_loop()
        if self._changed is None:
            self._changed = asyncio.Event()
        if self._unsubscribe is None:
            self._unsubscribe = self.state.subscribe(self._follow)
            self._follow(self.state.snapshot())
        instance = _Instance(socket_path_for(self.plugin_dir, self.resource))
        instance.server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes(self.resource))])
        _add_servicer(_Servicer(self, instance), instance.server)
        instance.server.add_insecure_port(f"unix:{instance.socket_path}")
        await instance.server.start()
        self._instance = instance
        log.info("serving %s on %s", self.resource.name, instance.socket_path)
        self.request_registration()

    async def shutdown(self) -> None:
        """End the streams, cancel any Register in flight, stop serving and remove the socket."""
        instance, self._instance = self._instance, None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if instance is None:
            return
        self.registered.clear()
        instance.stopped.set()
        self._wake_streams()
        if instance.register_task is not None:
            instance.register_task.cancel()
        if instance.server is not None:
            await instance.server.stop(self.timings.stop_grace)
        instance.socket_path.unlink(missing_ok=True)

    def request_registration(self) -> None:
        """Register the current instance (again); a request while one runs makes it go round once more."""
        instance = self._instance
        if instance is None:
            return
        self.registered.clear()
        instance.registered_with = None
        if instance.register_task is not None and not instance.register_task.done():
            instance.pending = True
            instance.wake.set()
            return
        instance.register_task = asyncio.get_running_loop().create_task(self._register_loop(instance), name=f"register-{self.resource.label}")

    def wake(self) -> None:
        """Cut a registration backoff short (kubelet.sock just appeared)."""
        if self._instance:
            self._instance.wake.set()

    def kubelet_stream_ended(self, instance: _Instance) -> None:
        """The stream the kubelet opened for our registration ended: the kubelet never redials, so register again."""
        if instance is not self._instance or instance.stopped.is_set():
            return
        log.warning("the kubelet ended the ListAndWatch stream of %s; registering again", self.resource.name)
        self.request_registration()

    async def _register_loop(self, instance: _Instance) -> None:
        try:
            while True:
                instance.pending = False
                await self._register_until_done(instance)
                if not instance.pending or instance.stopped.is_set():
                    return
        except asyncio.CancelledError:
            log.debug("registration of %s cancelled (instance stopped)", self.resource.name)
            raise

    async def _register_until_done(self, instance: _Instance) -> None:
        delay = self.timings.backoff_initial
        failures = 0
        while not instance.stopped.is_set():
            identity = kubelet_identity(self.kubelet_socket)
            if identity is None:
                reason = f"{self.kubelet_socket} does not exist yet"
            else:
                try:
                    instance.registering = True
                    self.register_calls += 1
                    await self._register_once(instance)
                except grpc.aio.AioRpcError as err:
                    instance.expect_kubelet_stream = False
                    reason = f"Register failed: {err.code().name}: {safe_text(err.details() or '', 300)}"
                except (OSError, RuntimeError, ValueError) as err:  # never let the registration task die
                    instance.expect_kubelet_stream = False
                    reason = f"Register failed: {safe_text(str(err), 300)}"
                else:
                    # The kubelet this Register reached: read again, kubelet.sock may have been replaced meanwhile.
                    instance.registered_with = kubelet_identity(self.kubelet_socket) or identity
                    self.registrations += 1
                    if not instance.pending and instance is self._instance:
                        self.registered.set()
                    metrics = self.metrics()
                    if metrics:
                        metrics.registered(self.resource.name)
                    log.info("registered %s with the kubelet (endpoint %s)", self.resource.name, instance.socket_path.name)
                    return
                finally:
                    instance.registering = False
            failures += 1
            # The first failure and then every tenth: a kubelet that stays away does not flood the log.
            if failures == 1 or failures % 10 == 0:
                log.warning("cannot register %s (%s); retrying in %.1fs (attempt %d)", self.resource.name, reason, delay, failures)
            try:
                await asyncio.wait_for(instance.wake.wait(), delay)
                delay = self.timings.backoff_initial
            except TimeoutError:
                delay = min(delay * 2, self.timings.backoff_max)
            instance.wake.clear()

    async def _register_once(self, instance: _Instance) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=instance.socket_path.name,
            resource_name=self.resource.name,
            options=OPTIONS,
        )
        # A channel of its own subchannel pool: gRPC would otherwise reuse the process-wide subchannel of
        # kubelet.sock, still in its reconnect backoff from the dead kubelet, and fail fast for up to seconds.
        async with grpc.aio.insecure_channel(f"unix:{self.kubelet_socket}", options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            await pb_grpc.RegistrationStub(channel).Register(request, timeout=self.timings.register_timeout)


class _Undecodable:
    """A request whose bytes are not the message its method takes (the handler refuses it with INVALID_ARGUMENT)."""

    def __init__(self, kind: type[Message], size: int) -> None:
        self.message = f"the request is not a valid {kind.DESCRIPTOR.full_name} ({size} bytes that do not decode as one)"


def _decoder(kind: type[Message]) -> Callable[[bytes], object]:
    def decode(data: bytes) -> object:
        try:
            return kind.FromString(data)
        except DecodeError:
            return _Undecodable(kind, len(data))

    return decode


def _add_servicer(servicer: _Servicer, server: grpc.aio.Server) -> None:
    """The DevicePlugin service, as the generated `add_DevicePluginServicer_to_server` adds it, but with requests that
    do not decode handed to the handler as `_Undecodable` (refused with INVALID_ARGUMENT and a message) instead of
    gRPC's UNKNOWN naming a Python exception."""
    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    handlers = {
        "GetDevicePluginOptions": unary(servicer.GetDevicePluginOptions, _decoder(pb.Empty), pb.DevicePluginOptions.SerializeToString),
        "ListAndWatch": stream(servicer.ListAndWatch, _decoder(pb.Empty), pb.ListAndWatchResponse.SerializeToString),
        "GetPreferredAllocation": unary(servicer.GetPreferredAllocation, _decoder(pb.PreferredAllocationRequest), pb.PreferredAllocationResponse.SerializeToString),
        "Allocate": unary(servicer.Allocate, _decoder(pb.AllocateRequest), pb.AllocateResponse.SerializeToString),
        "PreStartContainer": unary(servicer.PreStartContainer, _decoder(pb.PreStartContainerRequest), pb.PreStartContainerResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", handlers),))
    server.add_registered_method_handlers("v1beta1.DevicePlugin", handlers)


def _on_pending(resource: Resource, request: pb.AllocateRequest, pending: frozenset[str]) -> list[str]:
    """The pending GPUs the request's devices are on (unknown IDs are container_grant's to refuse)."""
    devices = resource.devices
    return sorted({d.gpu.uuid for req in request.container_requests for i in req.devices_ids if (d := devices.get(i)) is not None and d.gpu.uuid in pending})


def max_message_bytes(resource: Resource) -> int:
    """What the largest legal request for this resource can weigh (every device ID at its longest), plus slack."""
    return 64 * 1024 + len(resource.devices) * (MAX_DEVICE_ID_BYTES + 8)


def _check_ids(ids: list[str], what: str) -> None:
    """INVALID_ARGUMENT for an ID no device of ours could have: error messages stay small and printable."""
    if max(map(len, ids), default=0) <= MAX_DEVICE_ID_BYTES:  # one pass in C: the common case
        return
    device_id = next(i for i in ids if len(i) > MAX_DEVICE_ID_BYTES)
    raise AllocationError(
        Refusal.INVALID, f"{what}: a device ID of {len(device_id)} characters (at most {MAX_DEVICE_ID_BYTES}): {safe_text(device_id)}"
    )


def _check_preferred(req: pb.ContainerPreferredAllocationRequest) -> None:
    available, must = list(req.available_deviceIDs), list(req.must_include_deviceIDs)
    _check_ids(available, "available_deviceIDs")
    _check_ids(must, "must_include_deviceIDs")
    if req.allocation_size < 1:
        raise AllocationError(Refusal.INVALID, f"allocation_size must be at least 1, got {req.allocation_size}")
    if len(set(must)) > req.allocation_size:
        raise AllocationError(Refusal.INVALID, f"must_include_deviceIDs has {len(set(must))} IDs, more than allocation_size {req.allocation_size}")
    missing = set(must) - set(available)
    if missing:
        raise AllocationError(Refusal.INVALID, f"must_include_deviceIDs not in available_deviceIDs: {brief(sorted(missing))}")


class _Servicer(pb_grpc.DevicePluginServicer):
    """The DevicePlugin RPCs for one serving instance."""

    def __init__(self, plugin: DevicePluginServer, instance: _Instance) -> None:
        self.plugin = plugin
        self.instance = instance
        self.resource = plugin.resource

    async def _refuse_undecodable(self, request: object, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, _Undecodable):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)

    async def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.DevicePluginOptions:
        await self._refuse_undecodable(request, context)
        if self.instance.registering:
            self.instance.expect_kubelet_stream = True
        return OPTIONS

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        await context.abort(code, message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "...")

    async def ListAndWatch(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ListAndWatchResponse]:
        await self._refuse_undecodable(request, context)
        plugin, instance = self.plugin, self.instance
        from_kubelet, instance.expect_kubelet_stream = instance.expect_kubelet_stream, False
        token = object()
        if from_kubelet:
            instance.kubelet_stream = token
        else:
            if instance.other_streams >= MAX_OTHER_STREAMS:
                await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_OTHER_STREAMS} ListAndWatch streams of {self.resource.name} are open already")
            instance.other_streams += 1
        sent = None
        try:
            while not instance.stopped.is_set():
                version, unhealthy, available, held, _ = plugin.health()
                if version != sent:
                    sent = version
                    yield plugin.device_list.response(unhealthy, all_unhealthy=not available, unhealthy_ids=held)
                    log.debug("sent %d devices of %s (%d GPUs unhealthy)", len(self.resource.devices), self.resource.name, len(unhealthy))
                else:
                    await plugin.health_changed(version)
        finally:
            if from_kubelet:
                if instance.kubelet_stream is token:
                    plugin.kubelet_stream_ended(instance)
            else:
                instance.other_streams -= 1

    def _check_request_size(self, containers: int, ids: int) -> None:
        """Refuse what no kubelet sends before building anything from it: the loop serves every resource."""
        if containers > MAX_CONTAINER_REQUESTS:
            raise AllocationError(Refusal.INVALID, f"{containers} container requests in one call (at most {MAX_CONTAINER_REQUESTS})")
        if ids > len(self.resource.devices):
            raise AllocationError(Refusal.INVALID, f"{ids} device IDs, more than the {len(self.resource.devices)} devices of {self.resource.name}")

    async def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext) -> pb.PreferredAllocationResponse:
        await self._refuse_undecodable(request, context)
        try:
            for req in request.container_requests:
                self._check_request_size(len(request.container_requests), len(req.available_deviceIDs))
            if sum(len(req.available_deviceIDs) for req in request.container_requests) <= INLINE_PREFERRED_IDS:
                return self._preferred(request)
        except AllocationError as err:
            await self._abort(context, wire.status_code(err.code), err.message)
        # A large request is checked and placed off the loop, one per resource at a time, so a flood of them cannot
        # delay the Allocate calls of any resource; beyond a few queued, a flood is refused (the kubelet sends one
        # at a time).
        plugin = self.plugin
        if plugin.preferred_waiting >= MAX_PREFERRED_WAITING:
            await self._abort(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_PREFERRED_WAITING} GetPreferredAllocation calls of {self.resource.name} are in flight already"
            )
        if plugin._preferred_turn is None:
            plugin._preferred_turn = asyncio.Semaphore(1)
        plugin.preferred_waiting += 1
        try:
            async with plugin._preferred_turn:
                return await asyncio.to_thread(self._preferred, request)
        except AllocationError as err:
            await self._abort(context, wire.status_code(err.code), err.message)
            raise  # abort raises; this line is never reached
        finally:
            plugin.preferred_waiting -= 1

    def _preferred(self, request: pb.PreferredAllocationRequest) -> pb.PreferredAllocationResponse:
        """Check and place every container request (pure: on the loop or a worker thread); AllocationError."""
        responses = []
        for req in request.container_requests:
            _check_preferred(req)
            ids = preferred_allocation(self.resource, req.available_deviceIDs, req.must_include_deviceIDs, req.allocation_size)
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        await self._refuse_undecodable(request, context)
        plugin = self.plugin
        if not request.container_requests:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"AllocateRequest for {self.resource.name} has no container requests")
        _, unhealthy, available, held, pending = plugin.health()
        if not available:
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"the MPS control daemon of pool {self.resource.pool.name} is not ready")
        if pending:
            waiting = _on_pending(self.resource, request, pending)
            if waiting:
                await self._abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"devices of {self.resource.name} on GPU(s) {brief(waiting, 4)} are not granted: those GPUs keep their previous "
                    "configuration for the containers that hold them and switch to the new one once released",
                )
        started = time.perf_counter()
        metrics = plugin.metrics()
        try:
            responses = []
            for req in request.container_requests:
                self._check_request_size(len(request.container_requests), len(req.devices_ids))
                _check_ids(list(req.devices_ids), "devices_ids")
                responses.append(wire.container_response(container_grant(self.resource, req.devices_ids, unhealthy, held)))
        except AllocationError as err:
            log.warning("refused Allocate of %s: %s", self.resource.name, err.message)
            if metrics:
                metrics.allocated(self.resource.name, False, time.perf_counter() - started)
            await self._abort(context, wire.status_code(err.code), err.message)
        plugin.recent_grants.append((time.monotonic(), tuple(i for req in request.container_requests for i in req.devices_ids)))
        if metrics:
            metrics.allocated(self.resource.name, True, time.perf_counter() - started)
        if log.isEnabledFor(logging.INFO):  # one line per call, whatever it holds
            ids = [i for req in request.container_requests for i in req.devices_ids]
            gpus = sorted({self.resource.devices[i].unit.uuid for i in ids})  # every ID is known: the grant checked them
            log.info("allocated %s: %s -> %s", self.resource.name, brief(ids), brief(gpus, 3))
        return pb.AllocateResponse(container_responses=responses)

    async def PreStartContainer(self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext) -> pb.PreStartContainerResponse:
        await self._refuse_undecodable(request, context)
        return pb.PreStartContainerResponse()

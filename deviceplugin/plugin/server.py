"""One gRPC DevicePlugin server per resource: its serving instances and their registration with the kubelet.

Everything here runs on the plugin's one asyncio loop (`aioloop.shared_loop()`) with `grpc.aio`: a
ListAndWatch stream is a coroutine, so any number of open streams costs Allocate nothing. The manager
drives the lifecycle (`serve`, `shutdown`, `request_registration`); while serving, a server follows the
node's runtime state (state.NodeState, written from other threads) and holds its resource's allocator, built
anew from the resource's part of that state whenever it changes. The RPCs themselves are servicer.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from .. import defaults
from ..alloc.allocator import MAX_DEVICE_ID_BYTES, ResourceAllocator
from ..api import deviceplugin_pb2 as pb
from ..errors import StartupError
from ..logs import safe_text
from ..model.devices import Resource
from ..state import NodeState, NodeView
from . import wire
from .registration import RegistrationChannel
from .servicer import Servicer, add_servicer

if TYPE_CHECKING:
    from ..obs.metrics import PluginMetrics

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
SOCKET_PREFIX = "gpu-share-"
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the terminating NUL
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
    """A fresh socket path per serving instance (docs/kubelet.md#re-registration), of the same length for every instance
    of the resource (the serial is three digits, modulo 1000), so a path that fits once fits always; SocketPathError
    when it does not."""
    serial = next(_instance_counter) if serial is None else serial
    path = plugin_dir / f"{SOCKET_PREFIX}{resource.label}-{os.getpid()}-{serial % 1000:03d}.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise SocketPathError(
            f"pool {resource.pool.name}: socket path {path} is {len(os.fsencode(path))} bytes, over the kernel's "
            f"limit of {MAX_SOCKET_PATH}; use a shorter --plugin-dir or pool name"
        )
    return path


class Instance:
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
        metrics: PluginMetrics | None = None,
        state: NodeState | None = None,
        *,
        kubelet_channel: RegistrationChannel,
    ) -> None:
        """`kubelet_channel`: the registration channel to kubelet.sock, shared by the manager's servers; the manager
        closes it."""
        self.resource = resource
        self.device_list = wire.EncodedDeviceList(resource)
        self.state = state or NodeState()
        self.metrics = metrics
        self.plugin_dir = Path(plugin_dir)
        self.timings = timings
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self.kubelet_channel = kubelet_channel
        self.registered = threading.Event()  # set only by the current instance's successful Register
        self.register_calls = 0  # Register calls made (kubelet.sock existed)
        self.register_failures = 0  # attempts that did not register, a missing kubelet.sock included
        self.registrations = 0  # accepted by the kubelet
        # (monotonic time, IDs) of the Allocate answers of the last `timings.grant_window`: kept by time, not count
        self.recent_grants: deque[tuple[float, tuple[str, ...]]] = deque()
        self.preferred_waiting = 0  # GetPreferredAllocation calls queued or running
        self.preferred_turn: asyncio.Semaphore | None = None  # one large placement at a time, made on the loop
        self._state = threading.Lock()
        # (version, allocator): the version grows whenever the resource's health changes; a stream sends a new
        # list only then
        self._current = (0, ResourceAllocator(resource))
        self._followed = 0  # the NodeState version the health was taken from
        self._unsubscribe: Callable[[], None] | None = None
        self._health_keys = resource.health_keys()
        self._changed: asyncio.Event | None = None  # replaced on every change; streams wait on it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._instance: Instance | None = None

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

    def current(self) -> tuple[int, ResourceAllocator]:
        """The health version and the allocator built from this resource's health now (any thread)."""
        return self._current

    async def health_changed(self, version: int) -> None:
        """On the loop: return once the health is newer than `version`, or the serving instance stops."""
        changed = self._changed
        if self._current[0] == version and changed is not None:
            await changed.wait()

    def _follow(self, view: NodeView) -> None:
        """A NodeState subscriber: a new allocator when this resource's part changed (and only then a new list)."""
        with self._state:
            if view.version <= self._followed:
                return
            self._followed = view.version
            version, allocator = self._current
            health = view.resource_health(self.resource, self._health_keys)
            if health == allocator.health:
                return
            self._current = (version + 1, ResourceAllocator(self.resource, health))
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
        instance = Instance(socket_path_for(self.plugin_dir, self.resource))
        instance.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", max_message_bytes(self.resource))]
        )
        add_servicer(Servicer(self, instance), instance.server)
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
        instance.register_task = asyncio.get_running_loop().create_task(
            self._register_loop(instance), name=f"register-{self.resource.label}"
        )

    def wake(self) -> None:
        """Cut a registration backoff short (kubelet.sock just appeared)."""
        if self._instance:
            self._instance.wake.set()

    def kubelet_stream_ended(self, instance: Instance) -> None:
        """The stream the kubelet opened for our registration ended: the kubelet never redials, so register again."""
        if instance is not self._instance or instance.stopped.is_set():
            return
        log.warning("the kubelet ended the ListAndWatch stream of %s; registering again", self.resource.name)
        self.request_registration()

    async def _register_loop(self, instance: Instance) -> None:
        try:
            while True:
                instance.pending = False
                await self._register_until_done(instance)
                if not instance.pending or instance.stopped.is_set():
                    return
        except asyncio.CancelledError:
            log.debug("registration of %s cancelled (instance stopped)", self.resource.name)
            raise

    async def _register_until_done(self, instance: Instance) -> None:
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
                    await self._register_once(instance, identity)
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
                    if self.metrics:
                        self.metrics.registered(self.resource.name)
                    log.info(
                        "registered %s with the kubelet (endpoint %s)", self.resource.name, instance.socket_path.name
                    )
                    return
                finally:
                    instance.registering = False
            failures += 1
            self.register_failures += 1
            # The first failure and then every tenth: a kubelet that stays away does not flood the log.
            if failures == 1 or failures % 10 == 0:
                log.warning(
                    "cannot register %s (%s); retrying in %.1fs (attempt %d)",
                    self.resource.name,
                    reason,
                    delay,
                    failures,
                )
            try:
                await asyncio.wait_for(instance.wake.wait(), delay)
                delay = self.timings.backoff_initial
            except TimeoutError:
                delay = min(delay * 2, self.timings.backoff_max)
            instance.wake.clear()

    async def _register_once(self, instance: Instance, identity: tuple[int, int]) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=instance.socket_path.name,
            resource_name=self.resource.name,
            options=wire.OPTIONS,
        )
        await self.kubelet_channel.register(request, identity, self.timings.register_timeout)


def max_message_bytes(resource: Resource) -> int:
    """What the largest legal request for this resource can weigh (every device ID at its longest), plus slack."""
    return 64 * 1024 + len(resource.devices) * (MAX_DEVICE_ID_BYTES + 8)

"""The DRA kubelet plugin on the wire: the DRAPlugin services (v1 and v1beta1) and DRAResourceHealth on the DRA
socket, then plugin registration on the registration socket (the kubelet may call as soon as it sees it).

Everything gRPC runs on the plugin's one asyncio loop (`aioloop`); prepare and unprepare run the driver
(`dra.prepare`, blocking) in thread pools: claims' API reads in one (`READ_WORKERS`), the driver's file work in
another, so a claim the cache answers never waits for another claim's read, and a slow API server never blocks the
health streams. A health stream is a coroutine: it sends the full device list at once, on every change of the
node's state or devices, and at least every `health_interval` seconds (below the `health_timeout` it declares,
after which the kubelet reads a device as Unknown). Streams and batch sizes are bounded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from .. import defaults
from ..aioloop import EventLoopThread, shared_loop
from ..api import dra_health_v1alpha1_pb2 as health_pb
from ..api import dra_health_v1alpha1_pb2_grpc as health_grpc
from ..api import dra_v1_pb2 as v1
from ..api import dra_v1_pb2_grpc as v1_grpc
from ..api import dra_v1beta1_pb2 as v1beta1
from ..api import dra_v1beta1_pb2_grpc as v1beta1_grpc
from ..api import pluginregistration_v1_pb2_grpc as reg_grpc
from ..config.types import Config
from ..model.devices import Resource
from ..state import NodeState, NodeView
from .checkpoint import PreparedClaim
from .claims import GET_TIMEOUT
from .health import device_health
from .prepare import MAX_CLAIMS_PER_CALL, ClaimRef, ClaimSource, Driver, Outcome, prepare_claims, unprepare_claims
from .registration import PluginPaths, Registration

if TYPE_CHECKING:
    from ..obs.drametrics import DraMetrics

log = logging.getLogger(__name__)

MAX_HEALTH_STREAMS = 8  # the kubelet opens one per connection; the rest are debugging clients
READ_WORKERS = 16  # claims read from the API at once, across calls
WRITE_WORKERS = 2  # prepares and unprepares (serialised by the driver's lock; a second one queues on it, not here)
# Seconds before the kubelet's deadline (45 s) at which every claim not yet prepared has its own answer: each read's
# budget ends there (retries included), so the kubelet gets an answer (failed claims named), not DeadlineExceeded.
DEADLINE_MARGIN = 2.0


@dataclass(frozen=True)
class PluginSettings:
    health_interval: float = defaults.DRA_HEALTH_INTERVAL  # seconds between full health lists when nothing changes
    health_timeout: int = defaults.DRA_HEALTH_TIMEOUT  # health_check_timeout_seconds sent per device
    stop_grace: float = 1.0


class KubeletPlugin:
    """Serve, then register; `stop` removes only this instance's sockets."""

    def __init__(
        self,
        driver: Driver,
        claims: ClaimSource,
        state: NodeState,
        paths: PluginPaths,
        settings: PluginSettings = PluginSettings(),
        metrics: DraMetrics | None = None,
        loop: EventLoopThread | None = None,
    ) -> None:
        paths.check()
        self.driver = driver
        self.claims = claims
        self.state = state
        self.paths = paths
        self.settings = settings
        self.metrics = metrics
        self.registration = Registration(driver.name, paths.dra_socket)
        self._loop = loop or shared_loop()
        self._pool = ThreadPoolExecutor(max_workers=WRITE_WORKERS, thread_name_prefix="dra-prepare")
        self._reads = ThreadPoolExecutor(max_workers=READ_WORKERS, thread_name_prefix="dra-claims")
        self._dra_server: grpc.aio.Server | None = None
        self._reg_server: grpc.aio.Server | None = None
        self._streams: set[asyncio.Event] = set()
        self._closing = False
        self._unsubscribe = state.subscribe(self._state_changed)
        self.started = False
        self.after_unprepare: Callable[[], None] = lambda: None  # a held GPU may switch shape now (dra.shapes)
        self.after_prepare: Callable[[list[PreparedClaim]], None] = lambda claims: None  # must not block (claimstatus)

    # --- lifecycle (any thread but the loop's) ----------------------------------------------------
    def start(self) -> None:
        self.paths.data_dir.mkdir(parents=True, exist_ok=True)
        self.paths.registrar_dir.mkdir(parents=True, exist_ok=True)
        self._loop.run(self._start())
        self.started = True
        log.info(
            "DRA driver %s serving on %s, registration socket %s",
            self.driver.name,
            self.paths.dra_socket,
            self.paths.registration_socket,
        )

    def stop(self) -> None:
        self._unsubscribe()
        if self._dra_server is not None or self._reg_server is not None:  # also after a start that failed halfway
            self._loop.run(self._stop())
        self.started = False
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._reads.shutdown(wait=False, cancel_futures=True)

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload: the driver prepares against the new devices; health streams send the new list."""
        self.driver.on_config(config, resources)
        self._loop.call(self._wake_streams)

    @property
    def registered(self) -> bool:
        return self.registration.registered.is_set()

    async def _start(self) -> None:
        dra = grpc.aio.server()
        v1_grpc.add_DRAPluginServicer_to_server(_DraService(self, v1, share_ids=True), dra)
        v1beta1_grpc.add_DRAPluginServicer_to_server(_DraService(self, v1beta1, share_ids=False), dra)
        health_grpc.add_DRAResourceHealthServicer_to_server(_HealthService(self), dra)
        _remove_socket(self.paths.dra_socket)
        dra.add_insecure_port(f"unix://{self.paths.dra_socket}")
        self._dra_server = dra
        await dra.start()
        registration = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(self.registration, registration)
        _remove_socket(self.paths.registration_socket)
        registration.add_insecure_port(f"unix://{self.paths.registration_socket}")
        self._reg_server = registration
        await registration.start()  # only now may the kubelet see us: the DRA socket already answers

    async def _stop(self) -> None:
        if self._reg_server is not None:  # the kubelet deregisters on the socket's removal
            await self._reg_server.stop(self.settings.stop_grace)
            _remove_socket(self.paths.registration_socket)
            self._reg_server = None
        self._closing = True
        self._wake_streams()
        if self._dra_server is not None:
            await self._dra_server.stop(self.settings.stop_grace)
            _remove_socket(self.paths.dra_socket)
            self._dra_server = None

    # --- prepare / unprepare ------------------------------------------------------------------------
    async def prepare(self, refs: list[ClaimRef], time_remaining: float | None = None) -> dict[str, Outcome]:
        """`time_remaining`: seconds to the call's deadline; claims not begun DEADLINE_MARGIN before it fail."""
        started = time.perf_counter()
        deadline = None if time_remaining is None else time.monotonic() + time_remaining - DEADLINE_MARGIN
        outcomes = await prepare_claims(self.driver, self.claims, refs, deadline, GET_TIMEOUT, self._reads, self._pool)
        if self.metrics:
            self.metrics.called(
                "prepare",
                time.perf_counter() - started,
                sum(1 for o in outcomes.values() if not o.error),
                sum(1 for o in outcomes.values() if o.error),
            )
        for outcome in outcomes.values():
            if outcome.error:
                log.warning("prepare: %s", outcome.error)
        prepared = [o.claim for o in outcomes.values() if o.claim is not None and not o.error]
        if prepared:
            try:
                self.after_prepare(prepared)
            except Exception:  # the claims are prepared: whatever the hook does, the kubelet gets that answer
                log.exception("after prepare")
        return outcomes

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        started = time.perf_counter()
        errors = await asyncio.get_running_loop().run_in_executor(self._pool, unprepare_claims, self.driver, refs)
        if self.metrics:
            self.metrics.called(
                "unprepare",
                time.perf_counter() - started,
                sum(1 for e in errors.values() if not e),
                sum(1 for e in errors.values() if e),
            )
        for error in errors.values():
            if error:
                log.warning("unprepare: %s", error)
        await asyncio.get_running_loop().run_in_executor(self._pool, self.after_unprepare)
        return errors

    # --- health -----------------------------------------------------------------------------------
    def _state_changed(self, view: NodeView) -> None:
        self._loop.call(self._wake_streams)

    def _wake_streams(self) -> None:
        for event in self._streams:
            event.set()

    def health_message(self) -> health_pb.NodeWatchResourcesResponse:
        now = int(time.time())
        return health_pb.NodeWatchResourcesResponse(
            devices=[
                health_pb.DeviceHealth(
                    device=health_pb.DeviceIdentifier(pool_name=self.driver.pool, device_name=h.name),
                    health=health_pb.HEALTHY if h.healthy else health_pb.UNHEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=self.settings.health_timeout,
                    message=h.message,
                )
                for h in device_health(self.driver.devices, self.state.snapshot())
            ]
        )

    async def watch_health(
        self, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:
        if len(self._streams) >= MAX_HEALTH_STREAMS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {MAX_HEALTH_STREAMS} health streams at once"
            )
        changed = asyncio.Event()
        self._streams.add(changed)
        try:
            last = None
            sent_at = 0.0
            while not self._closing:
                message = self.health_message()
                key = [(d.device.device_name, d.health, d.message) for d in message.devices]
                if key != last or time.monotonic() - sent_at >= self.settings.health_interval:
                    yield message
                    last, sent_at = key, time.monotonic()
                changed.clear()
                try:
                    await asyncio.wait_for(
                        changed.wait(), max(0.0, self.settings.health_interval - (time.monotonic() - sent_at))
                    )
                except TimeoutError:
                    pass
        finally:
            self._streams.discard(changed)


class _DraService:
    """DRAPlugin for one API version (v1 or v1beta1: the same messages, v1beta1 without share_id)."""

    def __init__(self, plugin: KubeletPlugin, api: ModuleType, share_ids: bool) -> None:
        self.plugin = plugin
        self.api = api
        self.share_ids = share_ids

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        refs = await self._refs(request, context)
        outcomes = await self.plugin.prepare(refs, context.time_remaining())
        api = self.api
        response = api.NodePrepareResourcesResponse()
        for ref in {ref.uid: ref for ref in refs}.values():  # a claim named twice is answered once
            outcome = outcomes[ref.uid]
            entry = response.claims[ref.uid]
            if outcome.error or outcome.claim is None:
                entry.error = outcome.error or "not prepared"
                continue
            for device in outcome.claim.devices:
                fields: dict[str, Any] = dict(
                    request_names=[device.request] if device.request else [],
                    pool_name=device.pool,
                    device_name=device.device,
                    cdi_device_ids=list(device.cdi_ids),
                )
                if self.share_ids and device.share_id:
                    fields["share_id"] = device.share_id
                entry.devices.append(api.Device(**fields))
        return response

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        refs = await self._refs(request, context)
        errors = await self.plugin.unprepare(refs)
        response = self.api.NodeUnprepareResourcesResponse()
        for ref in refs:
            response.claims[ref.uid].error = errors[ref.uid]
        return response

    async def _refs(self, request: Any, context: grpc.aio.ServicerContext) -> list[ClaimRef]:
        if len(request.claims) > MAX_CLAIMS_PER_CALL:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.claims)} claims in one call, at most {MAX_CLAIMS_PER_CALL}",
            )
        return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in request.claims]


class _HealthService(health_grpc.DRAResourceHealthServicer):
    def __init__(self, plugin: KubeletPlugin) -> None:
        self.plugin = plugin

    async def NodeWatchResources(
        self, request: Any, context: Any
    ) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:  # type: ignore[override]
        async for message in self.plugin.watch_health(context):  # an async generator function: grpc.aio streams it
            yield message


def _remove_socket(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

"""The DevicePlugin RPCs of one serving instance: decode the request, call the resource's allocator, encode the answer.

Every check of a request is the allocator's (alloc/allocator.py); a refusal becomes its gRPC code through
`wire.status_code`. What is decided here is transport: requests that do not decode, the ListAndWatch streams and
where a large GetPreferredAllocation runs (off the event loop, one per resource at a time).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, NoReturn

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from ..alloc.allocator import AllocationError, PreferredRequest
from ..api import deviceplugin_pb2 as pb
from ..api import deviceplugin_pb2_grpc as pb_grpc
from ..logs import brief
from . import wire

if TYPE_CHECKING:
    from .server import DevicePluginServer, Instance

log = logging.getLogger(__name__)

MAX_OTHER_STREAMS = 64  # ListAndWatch streams beside the kubelet's own (debugging clients, monitors): bounded memory
MAX_ERROR_CHARS = 1000  # gRPC refuses status details over 8 KiB of metadata; ours stay far below
MAX_PREFERRED_WAITING = 8  # GetPreferredAllocation calls of one resource queued (the kubelet sends one at a time)
INLINE_PREFERRED_IDS = 1024  # a request with more available IDs (a few ms of placement) is placed off the event loop


class _Undecodable:
    """A request whose bytes are not the message its method takes (the handler refuses it with INVALID_ARGUMENT)."""

    def __init__(self, kind: type[Message], size: int) -> None:
        self.message = (
            f"the request is not a valid {kind.DESCRIPTOR.full_name} ({size} bytes that do not decode as one)"
        )


def _decoder(kind: type[Message]) -> Callable[[bytes], object]:
    def decode(data: bytes) -> object:
        try:
            return kind.FromString(data)
        except DecodeError:
            return _Undecodable(kind, len(data))

    return decode


def add_servicer(servicer: Servicer, server: grpc.aio.Server) -> None:
    """The DevicePlugin service, as the generated `add_DevicePluginServicer_to_server` adds it, but with requests that
    do not decode handed to the handler as `_Undecodable` (refused with INVALID_ARGUMENT and a message) instead of
    gRPC's UNKNOWN naming a Python exception."""
    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    handlers = {
        "GetDevicePluginOptions": unary(
            servicer.GetDevicePluginOptions, _decoder(pb.Empty), pb.DevicePluginOptions.SerializeToString
        ),
        "ListAndWatch": stream(servicer.ListAndWatch, _decoder(pb.Empty), pb.ListAndWatchResponse.SerializeToString),
        "GetPreferredAllocation": unary(
            servicer.GetPreferredAllocation,
            _decoder(pb.PreferredAllocationRequest),
            pb.PreferredAllocationResponse.SerializeToString,
        ),
        "Allocate": unary(servicer.Allocate, _decoder(pb.AllocateRequest), pb.AllocateResponse.SerializeToString),
        "PreStartContainer": unary(
            servicer.PreStartContainer,
            _decoder(pb.PreStartContainerRequest),
            pb.PreStartContainerResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", handlers),))
    server.add_registered_method_handlers("v1beta1.DevicePlugin", handlers)


def _preferred_requests(request: pb.PreferredAllocationRequest) -> list[PreferredRequest]:
    return [
        PreferredRequest(r.available_deviceIDs, r.must_include_deviceIDs, r.allocation_size)
        for r in request.container_requests
    ]


class Servicer(pb_grpc.DevicePluginServicer):
    """The DevicePlugin RPCs for one serving instance."""

    def __init__(self, plugin: DevicePluginServer, instance: Instance) -> None:
        self.plugin = plugin
        self.instance = instance
        self.resource = plugin.resource

    async def _refuse_undecodable(self, request: object, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, _Undecodable):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
        await context.abort(code, message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "...")

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        await self._refuse_undecodable(request, context)
        if self.instance.registering:
            self.instance.expect_kubelet_stream = True
        return wire.OPTIONS

    async def ListAndWatch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        await self._refuse_undecodable(request, context)
        plugin, instance = self.plugin, self.instance
        from_kubelet, instance.expect_kubelet_stream = instance.expect_kubelet_stream, False
        token = object()
        if from_kubelet:
            instance.kubelet_stream = token
        else:
            if instance.other_streams >= MAX_OTHER_STREAMS:
                await self._abort(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{MAX_OTHER_STREAMS} ListAndWatch streams of {self.resource.name} are open already",
                )
            instance.other_streams += 1
        sent = None
        try:
            while not instance.stopped.is_set():
                version, allocator = plugin.current()
                if version != sent:
                    sent = version
                    health = allocator.health
                    yield plugin.device_list.response(
                        health.unhealthy,
                        all_unhealthy=not health.mps_ready,
                        quarantined_devices=health.quarantined_devices,
                    )
                    log.debug(
                        "sent %d devices of %s (%d GPUs unhealthy)",
                        len(self.resource.devices),
                        self.resource.name,
                        len(health.unhealthy),
                    )
                else:
                    await plugin.health_changed(version)
        finally:
            if from_kubelet:
                if instance.kubelet_stream is token:
                    plugin.kubelet_stream_ended(instance)
            else:
                instance.other_streams -= 1

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        await self._refuse_undecodable(request, context)
        plugin, requests = self.plugin, _preferred_requests(request)
        allocator = plugin.current()[1]
        try:
            allocator.check_size([r.available for r in requests])
            if sum(len(r.available) for r in requests) <= INLINE_PREFERRED_IDS:
                return wire.preferred_response(allocator.preferred(requests))
        except AllocationError as err:
            await self._abort(context, wire.status_code(err.code), err.message)
        # A large request is checked and placed off the loop, one per resource at a time, so a flood of them cannot
        # delay the Allocate calls of any resource; beyond a few queued, a flood is refused (the kubelet sends one
        # at a time).
        if plugin.preferred_waiting >= MAX_PREFERRED_WAITING:
            await self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_PREFERRED_WAITING} GetPreferredAllocation calls of {self.resource.name} are in flight already",
            )
        if plugin.preferred_turn is None:
            plugin.preferred_turn = asyncio.Semaphore(1)
        plugin.preferred_waiting += 1
        try:
            async with plugin.preferred_turn:
                answers = await asyncio.to_thread(allocator.preferred, requests)
        except AllocationError as err:
            await self._abort(context, wire.status_code(err.code), err.message)
        finally:
            plugin.preferred_waiting -= 1
        return wire.preferred_response(answers)

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        await self._refuse_undecodable(request, context)
        plugin, allocator = self.plugin, self.plugin.current()[1]
        started = time.perf_counter()
        try:
            allocation = allocator.allocate([req.devices_ids for req in request.container_requests])
        except AllocationError as err:
            log.warning("refused Allocate of %s: %s", self.resource.name, err.message)
            self._count(False, started)
            await self._abort(context, wire.status_code(err.code), err.message)
        response = wire.allocate_response(allocation)
        now = time.monotonic()
        grants = plugin.recent_grants
        while grants and grants[0][0] < now - plugin.timings.grant_window:  # only the last window is ever read
            grants.popleft()
        grants.append((now, allocation.device_ids))
        self._count(True, started)
        if log.isEnabledFor(logging.INFO):  # one line per call, whatever it holds
            log.info(
                "allocated %s: %s -> %s", self.resource.name, brief(allocation.device_ids), brief(allocation.units, 3)
            )
        return response

    def _count(self, ok: bool, started: float) -> None:
        metrics = self.plugin.metrics
        if metrics:
            metrics.allocated(self.resource.name, ok, time.perf_counter() - started)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreStartContainerResponse:
        await self._refuse_undecodable(request, context)
        return pb.PreStartContainerResponse()

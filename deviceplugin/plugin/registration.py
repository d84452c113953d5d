"""The plugin's one registration channel to kubelet.sock, shared by every resource's server.

The first design opened a channel per Register attempt, with gRPC's default options: in kubelet restart storms, calls
on such channels to a kubelet.sock whose server keeps going away made gRPC's native memory climb to gigabytes within a
minute, as gRPC retried each call transparently, without limit, on every GOAWAY of the dying server
(docs/performance.md#kubelet-restart-storms). Here there is one channel per kubelet instance, keyed by kubelet.sock's
identity (inode, ctime), with retries off (the server's backoff loop retries every failed Register). A new kubelet gets
a new channel, so no subchannel still in reconnect backoff from the dead one is reused (docs/kubelet.md#registration),
and the old channel is closed at once, which cancels any Register still waiting on the dead kubelet rather than leaving
it to its deadline. Everything here runs on the plugin's asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import grpc.aio

from ..api import deviceplugin_pb2 as pb
from ..api import deviceplugin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Its own subchannel pool: a global-pool subchannel of the same target may outlive our channel. No gRPC retries: they
# are what grew memory in storms, and a failed Register is retried by the caller anyway.
CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0))


class KubeletReplaced(RuntimeError):
    """A Register cut short because kubelet.sock was replaced (the channel to the old kubelet was closed)."""


class RegistrationChannel:
    """One gRPC channel to `socket` for the kubelet instance listening there now; closed when it is replaced."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.opened = 0  # channels opened so far (benchmarks and tests count them)
        self._channel: grpc.aio.Channel | None = None
        self._identity: tuple[int, int] | None = None

    @property
    def identity(self) -> tuple[int, int] | None:
        """The kubelet instance (kubelet.sock's inode, ctime) the open channel was made for; None when closed."""
        return self._identity if self._channel is not None else None

    async def register(self, request: pb.RegisterRequest, identity: tuple[int, int], timeout: float) -> None:
        """Register with the kubelet whose kubelet.sock has `identity`; gRPC errors are raised as they come."""
        channel = await self.follow(identity)
        try:
            await pb_grpc.RegistrationStub(channel).Register(request, timeout=timeout)
        except asyncio.CancelledError:
            # gRPC raises CancelledError in every call of a channel that is closed: unless this task is the one
            # being cancelled, that was `follow` closing the channel to a kubelet that was replaced.
            task = asyncio.current_task()
            if channel is self._channel or (task is not None and task.cancelling()):
                raise
            raise KubeletReplaced("kubelet.sock was replaced while Register waited on the old kubelet") from None

    async def follow(self, identity: tuple[int, int]) -> grpc.aio.Channel:
        """The channel for this kubelet instance: the open one, or a new one when kubelet.sock changed (the old one is
        closed, cancelling its calls)."""
        if self._channel is None or self._identity != identity:
            old, self._channel = (
                self._channel,
                grpc.aio.insecure_channel(f"unix:{self.socket}", options=CHANNEL_OPTIONS),
            )
            self._identity = identity
            self.opened += 1
            if old is not None:
                log.debug("kubelet.sock was replaced: closing the registration channel to the old kubelet")
                await old.close()
        return self._channel

    async def close(self) -> None:
        """Close the channel (cancelling any Register in flight); a later `register` opens a new one."""
        channel, self._channel, self._identity = self._channel, None, None
        if channel is not None:
            await channel.close()

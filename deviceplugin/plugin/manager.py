"""Runs every resource's server and follows the kubelet's lifecycle (restarts, deleted sockets).

Kubelet restart signals (docs/kubelet.md#kubelet-restarts): kubelet.sock is recreated, or a server's own socket
disappears. The device-plugin directory is watched with inotify, so a new kubelet.sock is answered with
a Register within milliseconds; a poll every `watch_interval` is the safety net (and the only signal
where inotify is unavailable). The same poll asks the MPS pools' daemons (`plugin.mpsgate`): a pool is served once
its control daemon is alive, and its devices are Unhealthy while it is not (written to the NodeState the servers
follow). Everything runs on the one gRPC event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..aioloop import EventLoopThread, shared_loop
from ..alloc.shapeguard import ShapeGuard
from ..model.devices import Resource
from ..model.usage import Hold
from ..mps.control import MpsLiveness
from ..state import NodeState
from .inotify import DirectoryWatch
from .mpsgate import MpsGate
from .registration import RegistrationChannel
from .server import KUBELET_SOCKET, SOCKET_PREFIX, DevicePluginServer, Timings, kubelet_identity, socket_path_for

if TYPE_CHECKING:
    from ..config.types import Config
    from ..obs.metrics import PluginMetrics

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 0.5


def signature(resource: Resource) -> tuple:
    """What decides a resource's devices and Allocate answers: equal signatures need no restart on reload."""
    return (
        resource.name,
        dataclasses.replace(resource.pool, key_path=""),
        resource.units,
        tuple(resource.devices),
        resource.settings,
    )


def socket_is_live(path: Path) -> bool:
    """True when something accepts connections on the Unix socket at `path` (another live plugin process)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT)
    try:
        probe.connect(str(path))
        return True
    except OSError as err:
        if err.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            log.debug("probing %s: %s", path, err)
        return err.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()


def remove_stale_sockets(plugin_dir: Path) -> None:
    """Delete our sockets that nobody serves; leave those a live process answers on (a rolling-update overlap)."""
    for path in plugin_dir.glob(f"{SOCKET_PREFIX}*.sock"):
        try:
            if not stat.S_ISSOCK(path.lstat().st_mode):
                continue
        except FileNotFoundError:
            continue
        if socket_is_live(path):
            log.info("leaving %s alone: a live process serves it", path.name)
        else:
            log.info("removing stale socket %s", path.name)
            path.unlink(missing_ok=True)


class PluginManager:
    """Owns the per-resource servers and re-registers them when the kubelet restarts."""

    def __init__(
        self,
        resources: list[Resource],
        plugin_dir: Path,
        timings: Timings = Timings(),
        metrics: PluginMetrics | None = None,
        loop: EventLoopThread | None = None,
        mps: MpsLiveness | None = None,
        state: NodeState | None = None,
        holdings: Callable[[], frozenset[Hold]] | None = None,
    ) -> None:
        """`holdings`: what containers hold now, read fresh (pod-resources, the kubelet's checkpoint); None: nothing
        is ever held (tests of the bare gRPC layer). Holds other sources wrote to the NodeState count too."""
        self.plugin_dir = Path(plugin_dir)
        self.state = state or NodeState()  # what the servers advertise follows it
        self.timings = timings
        self.metrics = metrics  # counts from the first registration on
        self.kubelet_restarts = 0
        self.holdings = holdings
        self.shapes = ShapeGuard()  # held GPUs keep their shape (the core's guard, shared with the DRA driver)
        self._wanted = list(resources)  # what the config asks for; served as far as holds allow
        self._unsettled = False  # some of it is not served yet: pending GPUs, or holds that could not be read
        self._next_pending_check = 0.0
        self._loop = loop or shared_loop()
        self.kubelet_channel = RegistrationChannel(self.plugin_dir / KUBELET_SOCKET)  # every server's, one per kubelet
        self.servers = [self._new_server(r) for r in resources]
        self.mps_gate = MpsGate(self.state, mps or MpsLiveness(), resources, timings.watch_interval)  # checked by _poll
        self._lifecycle = asyncio.Lock()  # serialises start/stop/apply/check on the loop
        self._nudge = asyncio.Event()  # set by inotify: check now
        self._kubelet: tuple[int, int] | None = None
        self._watch: DirectoryWatch | None = None
        self._poller: asyncio.Task[None] | None = None
        self._stopping = False
        self._serve_failures: dict[str, int] = {}

    @property
    def resources(self) -> list[Resource]:
        return [s.resource for s in self.servers]

    @property
    def register_calls(self) -> int:
        """Register calls made by every server so far (benchmarks and tests count them)."""
        return sum(s.register_calls for s in self.servers)

    @property
    def started(self) -> bool:
        return self._poller is not None and not self._stopping

    def _new_server(self, resource: Resource) -> DevicePluginServer:
        return DevicePluginServer(
            resource, self.plugin_dir, self.timings, self.metrics, self.state, kubelet_channel=self.kubelet_channel
        )

    # --- public, from any thread but the loop ---------------------------------------------------
    def start(self) -> None:
        remove_stale_sockets(self.plugin_dir)
        self.mps_gate.first_check()
        self._loop.run(self._start())

    def stop(self) -> None:
        self._loop.run(self._stop())
        log.info("stopped; sockets removed")

    def apply(self, resources: list[Resource]) -> list[str]:
        """Serve a new set of resources, restarting only those whose signature changed; returns what changed."""
        return self._loop.run(self._apply(resources))

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload (runtime.reload): serve these resources from now on."""
        changes = self.apply(resources)
        log.info("resources: %s", "; ".join(changes) or "no resource changed")

    def health(self) -> tuple[bool, str]:
        """/healthz: every server is serving on its socket (MPS pools waiting for their daemon excepted)."""
        broken = [
            s.resource.name
            for s in self.servers
            if (s.socket_path is None and not self.mps_gate.waits(s))
            or (s.socket_path is not None and not s.socket_path.exists())
        ]
        return (not broken, "ok" if not broken else f"not serving: {', '.join(broken)}")

    def registration(self) -> list[tuple[str, bool]]:
        """(resource, registered with the kubelet now) per server."""
        return [(s.resource.name, s.registered.is_set()) for s in self.servers]

    def readiness(self) -> tuple[bool, str]:
        """/readyz: every resource is registered with the kubelet."""
        waiting = [s.resource.name for s in self.servers if not s.registered.is_set()]
        return (not waiting, "ready" if not waiting else f"not registered: {', '.join(waiting)}")

    # --- on the loop -----------------------------------------------------------------------------
    async def _start(self) -> None:
        self._stopping = False
        async with self._lifecycle:
            self._kubelet = kubelet_identity(self.plugin_dir / KUBELET_SOCKET)
            self._watch = DirectoryWatch.open(self.plugin_dir)
            if self._watch is not None:
                asyncio.get_running_loop().add_reader(self._watch.fd, self._on_directory_event)
            if self.holdings is not None:  # after a crash: what containers hold keeps its shape
                plan = await self._plan([], self._wanted)
                # holds that cannot be read are unknown, never empty: serve nothing until a source answers (the
                # pending check retries), rather than a plan that may re-pool a held GPU
                self.servers = [self._new_server(r) for r in plan or []]
                self.mps_gate.on_config(self.resources)
            for server in self.servers:
                await self._start_server(server, retry=False)
            if self.servers or not self._unsettled:
                self._settle()
        self._poller = asyncio.get_running_loop().create_task(self._poll(), name="kubelet-watch")

    async def _stop(self) -> None:
        self._stopping = True
        async with self._lifecycle:  # a check in progress finishes first: no restart is cut in half
            if self._poller is not None:
                self._poller.cancel()
                self._poller = None
            if self._watch is not None:
                asyncio.get_running_loop().remove_reader(self._watch.fd)
                self._watch.close()
                self._watch = None
            await asyncio.gather(*(s.shutdown() for s in self.servers))
            await self.kubelet_channel.close()

    async def _apply(self, resources: list[Resource]) -> list[str]:
        for resource in resources:  # refuse a plan whose sockets cannot exist before anything is stopped
            socket_path_for(self.plugin_dir, resource, serial=0)
        async with self._lifecycle:
            self._wanted = list(resources)
            return await self._follow_wanted()

    async def _follow_wanted(self) -> list[str]:
        """Serve what is wanted as far as holds allow (under the lifecycle lock); returns what changed."""
        plan = await self._plan(self.resources, self._wanted) if self.holdings is not None else self._wanted
        if plan is None:
            return ["none yet: what containers hold could not be read; trying again"]
        changes = await self._serve_plan(plan)
        self._settle()
        return changes + [f"pending: {p.describe()}" for p in self.shapes.pending.values()]

    def _settle(self) -> None:
        """Once the plan is served: only the GPUs still held in their old shape stay fenced."""
        self._unsettled = bool(self.shapes.pending)
        self.state.set_pending(self.shapes.described())

    async def _plan(self, served: list[Resource], wanted: list[Resource]) -> list[Resource] | None:
        """What to serve: `wanted`, with every GPU whose shape would change while something holds it kept as it is.

        The GPUs about to change are fenced first (pending: Unhealthy, refused in Allocate), so no grant on them can
        slip in between the fresh read of the holds and the switch; `_settle` lifts the fence once the plan is
        served. None when the holds cannot be read: nothing changes, the next check tries again."""
        self._next_pending_check = time.monotonic() + self.timings.pending_interval
        self._unsettled = True
        fence = self.shapes.fence(served, wanted)
        if fence is None:
            return wanted
        self.state.set_pending(fence)
        holdings = self.holdings
        assert holdings is not None
        try:
            fresh = await asyncio.get_running_loop().run_in_executor(None, holdings)
        except Exception as err:  # a read that fails must not let a held GPU switch
            self.shapes.unreadable(err, self.timings.pending_interval)
            return None
        self.state.set_holds("pod-resources", fresh)
        plan = self.shapes.apply(served, wanted, self.state.snapshot().all_holds() | self._recent_grants())
        self.state.set_pending({**fence, **self.shapes.described()})
        return plan

    def _recent_grants(self) -> frozenset[Hold]:
        """What Allocate granted within `grant_window`: held, though the kubelet may not have recorded it yet."""
        since = time.monotonic() - self.timings.grant_window
        return frozenset(
            Hold(
                s.resource.name,
                i,
                d.unit.replicas if (d := s.resource.devices.get(i)) else None,
                "a container granted just now",
            )
            for s in self.servers
            for at, ids in list(s.recent_grants)
            if at >= since
            for i in ids
        )

    async def _serve_plan(self, resources: list[Resource]) -> list[str]:
        """Serve these resources, restarting only those whose signature changed (under the lifecycle lock)."""
        changes = []
        current = {s.resource.name: s for s in self.servers}
        wanted = {r.name: r for r in resources}
        kept, started = [], []
        for name, server in current.items():
            if name not in wanted or signature(wanted[name]) != signature(server.resource):
                await server.shutdown()
                changes.append(f"{'changed' if name in wanted else 'removed'} {name}")
            else:
                kept.append(server)
        for name, resource in wanted.items():
            if name in current and current[name] in kept:
                continue
            server = self._new_server(resource)
            kept.append(server)
            started.append(server)
            if name not in current:
                changes.append(f"added {name}")
        self.servers = kept
        self.mps_gate.on_config(self.resources)  # a new MPS pool waits for its daemon
        for server in started:
            await self._start_server(server)
        return changes

    async def _start_server(self, server: DevicePluginServer, retry: bool = True) -> None:
        """Serve unless an MPS pool's daemon is not ready. With `retry`, a failure (a socket that cannot be bound)
        is logged and left to the next check, which tries again; without, it is raised (start-up)."""
        if (wait := self.mps_gate.waiting_for(server)) is not None:
            log.info("%s: waiting for the control daemon of %s", server.resource.name, wait)
            return
        try:
            await server.serve()
        except (OSError, RuntimeError) as err:  # grpc raises RuntimeError("Failed to bind ...")
            if not retry:
                raise
            failures = self._serve_failures[server.resource.name] = (
                self._serve_failures.get(server.resource.name, 0) + 1
            )
            if failures == 1 or failures % 50 == 0:
                log.error(
                    "cannot serve %s (%s); retrying every %.1fs (failure %d)",
                    server.resource.name,
                    err,
                    self.timings.watch_interval,
                    failures,
                )
        else:
            self._serve_failures.pop(server.resource.name, None)

    def _on_directory_event(self) -> None:
        """inotify says entries of the plugin directory changed: check at once (not at the next poll)."""
        if self._watch is None:
            return
        try:
            names = self._watch.read()
        except OSError as err:
            log.warning("reading inotify events failed (%s); relying on polling", err)
            return
        ours = {s.socket_path.name for s in self.servers if s.socket_path is not None}
        if names is None or KUBELET_SOCKET in names or ours.intersection(names):
            self._nudge.set()

    async def _poll(self) -> None:
        """Check at every inotify nudge, and every `watch_interval` in any case."""
        while True:
            try:
                await asyncio.wait_for(self._nudge.wait(), self.timings.watch_interval)
            except TimeoutError:
                pass
            self._nudge.clear()
            try:
                await self._check()
            except Exception:  # never let the watch die: log and go on with the next round
                log.exception("kubelet watch round failed")

    async def _check(self) -> None:
        """One look at the MPS daemons, the pending GPUs, the kubelet and our sockets (under the lifecycle lock)."""
        async with self._lifecycle:
            if self._stopping:
                return
            for server in self.mps_gate.check(self.servers):  # a pool whose daemon answers now is served
                await self._start_server(server)
            if self._unsettled and time.monotonic() >= self._next_pending_check:
                changes = await self._follow_wanted()
                if not self._unsettled:
                    log.info("resources: %s", "; ".join(changes) or "no resource changed")
            await self._follow_kubelet()

    async def _follow_kubelet(self) -> None:
        """Detect a kubelet restart and deleted sockets; serve again and re-register as needed."""
        current = kubelet_identity(self.plugin_dir / KUBELET_SOCKET)
        restarted = current is not None and current != self._kubelet
        if restarted and self._kubelet is not None:
            self.kubelet_restarts += 1
            log.info("kubelet.sock was recreated: the kubelet restarted")
        if current is not None:
            self._kubelet = current
            if restarted and self.kubelet_channel.identity is not None:
                await self.kubelet_channel.follow(current)  # a Register still waiting on the dead kubelet is cancelled
        restarts = []
        for server in self.servers:
            path = server.socket_path
            if path is None:
                if not self.mps_gate.waits(server):
                    restarts.append(self._serve_again(server, "it is not serving"))
            elif not path.exists():
                restarts.append(self._serve_again(server, f"its socket {path.name} was deleted"))
            elif restarted and server.registered_with is not None and server.registered_with != current:
                restarts.append(self._serve_again(server, "the kubelet restarted"))
            elif restarted:
                server.wake()
        await asyncio.gather(*restarts)  # resources restart side by side, not one grace period after another

    async def _serve_again(self, server: DevicePluginServer, reason: str) -> None:
        if server.resource.name not in self._serve_failures:
            log.info("restarting %s: %s", server.resource.name, reason)
        await server.shutdown()
        await self._start_server(server)

"""Runs every resource's server and follows the kubelet's lifecycle (restarts, deleted sockets)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .loop import BackgroundLoop
from .mps_paths import MpsPaths
from .resources import Resource
from .server import SOCKET_PREFIX, DevicePluginServer, Timings, kubelet_identity

if TYPE_CHECKING:
    from .metrics import PluginMetrics

log = logging.getLogger(__name__)


def signature(resource: Resource) -> tuple:
    """What decides a resource's devices and Allocate answers: equal signatures need no restart on reload."""
    config = resource.config
    return (
        resource.name,
        dataclasses.replace(resource.pool, path=""),
        resource.units,
        tuple(resource.devices),
        (config.allocation_policy, config.device_list_strategy, config.cdi_kind, config.device_specs, config.device_root, config.mps_root),
    )


class PluginManager(BackgroundLoop):
    """Owns the per-resource servers and re-registers them when the kubelet restarts.

    Kubelet restart signals (kubelet-contract §2.6): kubelet.sock is recreated, or a
    server's own socket disappears. Both are polled every `watch_interval`: a stat per
    socket, cheaper than a thread per inotify watch and well inside the 2 s target.
    The same loop follows MPS pools: a pool is served once its daemon's ready marker
    exists, and its devices are Unhealthy while the marker is gone.
    """

    def __init__(self, resources: list[Resource], plugin_dir: Path, timings: Timings = Timings(), metrics: "PluginMetrics | None" = None) -> None:
        super().__init__("kubelet-watch")
        self.plugin_dir = Path(plugin_dir)
        self.timings = timings
        self.metrics = metrics
        self.servers = [DevicePluginServer(r, self.plugin_dir, timings, metrics) for r in resources]
        self.kubelet_restarts = 0
        self._unhealthy: frozenset[str] = frozenset()
        self._quarantined: frozenset[str] = frozenset()
        self._lock = threading.RLock()  # guards self.servers against apply() during the watch loop

    @property
    def resources(self) -> list[Resource]:
        return [s.resource for s in self.servers]

    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.plugin_dir.glob(f"{SOCKET_PREFIX}*.sock"):
            log.info("removing stale socket %s", stale)
            stale.unlink(missing_ok=True)
        with self._lock:
            for server in self.servers:
                self._start_server(server)
        self._start_thread()

    def stop(self) -> None:
        self._stop_thread()
        with self._lock:
            for server in self.servers:
                server.stop()
        log.info("stopped; sockets removed")

    def health(self) -> tuple[bool, str]:
        """/healthz: every started server is serving on its socket."""
        broken = [s.resource.name for s in self.servers if s.socket_path is not None and not s.socket_path.exists()]
        return (not broken, "ok" if not broken else f"not serving: {', '.join(broken)}")

    def readiness(self) -> tuple[bool, str]:
        """/readyz: every resource is registered with the kubelet."""
        waiting = [s.resource.name for s in self.servers if not s.registered.is_set()]
        return (not waiting, "ready" if not waiting else f"not registered: {', '.join(waiting)}")

    def set_unhealthy(self, uuids: frozenset[str]) -> None:
        with self._lock:
            self._unhealthy = uuids
            for server in self.servers:
                server.set_unhealthy(uuids)

    def set_quarantined(self, device_ids: frozenset[str]) -> None:
        with self._lock:
            self._quarantined = device_ids
            for server in self.servers:
                server.set_quarantined(device_ids)

    def apply(self, resources: list[Resource]) -> list[str]:
        """Serve a new set of resources, restarting only those whose signature changed; returns what changed."""
        changes = []
        with self._lock:
            current = {s.resource.name: s for s in self.servers}
            wanted = {r.name: r for r in resources}
            kept = []
            for name, server in current.items():
                if name not in wanted or signature(wanted[name]) != signature(server.resource):
                    server.stop()
                    changes.append(f"{'changed' if name in wanted else 'removed'} {name}")
                else:
                    kept.append(server)
            for name, resource in wanted.items():
                if name in current and current[name] in kept:
                    continue
                server = DevicePluginServer(resource, self.plugin_dir, self.timings, self.metrics)
                server.set_unhealthy(self._unhealthy)
                server.set_quarantined(self._quarantined)
                kept.append(server)
                self._start_server(server)
                if name not in current:
                    changes.append(f"added {name}")
            self.servers = kept
        return changes

    def _start_server(self, server: DevicePluginServer) -> None:
        if server.resource.pool.mps and not self._mps_ready(server):
            log.info("%s waits for its MPS control daemon (%s)", server.resource.name, self._mps_paths(server).ready)
            return
        server.start()

    def _mps_paths(self, server: DevicePluginServer) -> MpsPaths:
        return MpsPaths.of(server.resource.config.mps_root, server.resource.pool.name)

    def _mps_ready(self, server: DevicePluginServer) -> bool:
        return self._mps_paths(server).ready.exists()

    def _run(self) -> None:
        kubelet_socket = self.plugin_dir / "kubelet.sock"
        last = kubelet_identity(kubelet_socket)
        while not self._stop.wait(self.timings.watch_interval):
            with self._lock:
                self._watch_once(kubelet_socket, last)
                last = kubelet_identity(kubelet_socket) or last

    def _watch_once(self, kubelet_socket: Path, last: tuple[int, int] | None) -> None:
        for server in self.servers:
            if server.resource.pool.mps:
                ready = self._mps_ready(server)
                if server.socket_path is None and ready:
                    log.info("MPS control daemon of pool %s is ready", server.resource.pool.name)
                    server.start()
                elif ready != server.available:
                    log.warning("MPS control daemon of pool %s is %s", server.resource.pool.name, "back" if ready else "down: devices Unhealthy")
                server.set_available(ready)
            path = server.socket_path
            if path is not None and not path.exists():
                server.restart(f"its socket {path.name} was deleted")
        current = kubelet_identity(kubelet_socket)
        if current is None or current == last:
            return
        if last is not None:
            self.kubelet_restarts += 1
            log.info("kubelet.sock was recreated: the kubelet restarted")
        for server in self.servers:
            if server.registered.is_set() and server.registered_with != current:
                server.restart("the kubelet restarted")
            else:
                server.wake()

"""Runs every resource's server and follows the kubelet's lifecycle (restarts, deleted sockets)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from .resources import Resource
from .server import SOCKET_PREFIX, DevicePluginServer, Timings, kubelet_identity

log = logging.getLogger(__name__)


class PluginManager:
    """Owns the per-resource servers and re-registers them when the kubelet restarts.

    Kubelet restart signals (kubelet-contract §2.6): kubelet.sock is recreated, or a
    server's own socket disappears. Both are polled every `watch_interval`: a stat per
    socket, cheaper than a thread per inotify watch and well inside the 2 s target.
    """

    def __init__(self, resources: list[Resource], plugin_dir: Path, timings: Timings = Timings()) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.timings = timings
        self.servers = [DevicePluginServer(r, self.plugin_dir, timings) for r in resources]
        self.kubelet_restarts = 0
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.plugin_dir.glob(f"{SOCKET_PREFIX}*.sock"):
            log.info("removing stale socket %s", stale)
            stale.unlink(missing_ok=True)
        for server in self.servers:
            server.start()
        self._watcher = threading.Thread(target=self._watch, name="kubelet-watch", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher:
            self._watcher.join()
        for server in self.servers:
            server.stop()
        log.info("stopped; sockets removed")

    def wait_registered(self, timeout: float | None = None) -> bool:
        """True once every server is registered (used by tests, the demo and readiness)."""
        return all(server.registered.wait(timeout) for server in self.servers)

    def set_unhealthy(self, gpus: frozenset[str]) -> None:
        for server in self.servers:
            server.set_unhealthy(gpus)

    def _watch(self) -> None:
        kubelet_socket = self.plugin_dir / "kubelet.sock"
        last = kubelet_identity(kubelet_socket)
        while not self._stop.wait(self.timings.watch_interval):
            for server in self.servers:
                path = server.socket_path
                if path is not None and not path.exists():
                    server.restart(f"its socket {path.name} was deleted")
            current = kubelet_identity(kubelet_socket)
            if current is None or current == last:
                continue
            if last is not None:
                self.kubelet_restarts += 1
                log.info("kubelet.sock was recreated: the kubelet restarted")
            last = current
            for server in self.servers:
                if server.registered.is_set() and server.registered_with != current:
                    server.restart("the kubelet restarted")
                else:
                    server.wake()

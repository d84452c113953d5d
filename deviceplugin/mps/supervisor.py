"""`gpu-share mps`: one supervised control daemon (MpsDaemon) per MPS pool of the node's plan, following config reloads.

On a reload a new MPS pool gets its daemon, a removed pool's daemon is stopped (`quit`), and a pool whose daemon
would start differently (mpsRoot, GPUs, or the strict limits that replicas and memoryPerShare set) has its daemon
restarted with the new settings: stopped first, then started, so the plugin sees the pool not ready in between.
"""

from __future__ import annotations

import logging
import threading

from .. import defaults
from ..config.types import Config
from ..model.devices import Resource
from .control import DEFAULT_CONTROL_BINARY, MpsDaemon

log = logging.getLogger(__name__)


class MpsSupervisor:
    def __init__(
        self,
        binary: str = DEFAULT_CONTROL_BINARY,
        backoff_max: float = defaults.MPS_BACKOFF_MAX,
        backoff_initial: float = 1.0,
        pools: frozenset[str] = frozenset(),
    ) -> None:
        self.binary = binary
        self.pools = (
            pools  # serve only these MPS pools (one DaemonSet per pool, each with its /dev/shm); empty: every one
        )
        self.backoff_max = backoff_max
        self.backoff_initial = backoff_initial
        self.daemons: dict[str, MpsDaemon] = {}  # pool name -> its running daemon
        self._lock = threading.Lock()  # reloads (reload thread) against stop (main thread)
        self._stopped = False

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """Run exactly the daemons the MPS pools of `resources` need (at start-up and on every config reload)."""
        with self._lock:
            if self._stopped:
                return
            wanted = {
                r.pool.name: MpsDaemon(
                    r,
                    r.settings.mps_root,
                    binary=self.binary,
                    backoff_initial=self.backoff_initial,
                    backoff_max=self.backoff_max,
                )
                for r in resources
                if r.pool.mps and (not self.pools or r.pool.name in self.pools)
            }
            for name, daemon in list(self.daemons.items()):
                if name not in wanted or wanted[name].spec != daemon.spec:
                    log.info("MPS pool %s %s: stopping its daemon", name, "changed" if name in wanted else "removed")
                    daemon.stop()
                    del self.daemons[name]
            for name, daemon in wanted.items():
                if name not in self.daemons:
                    daemon.start()
                    self.daemons[name] = daemon
            if not self.daemons:
                which = f" named {', '.join(sorted(self.pools))}" if self.pools else ""
                log.warning(
                    "the config has no pool with backend mps%s on this node; nothing to run until it has one", which
                )

    def stop(self) -> None:
        """Stop every daemon; later reloads start none."""
        with self._lock:
            self._stopped = True
            for daemon in self.daemons.values():
                daemon.stop()
            self.daemons.clear()

"""Memory watchdog for time-sliced shares.

Time-slicing does not bound memory, so the watchdog compares each container's real GPU memory (its processes,
from NVML) with what its shares allow. `report` logs it, exports it and queues a Warning Event on the pod;
`kill` also SIGKILLs the offending processes, each PID once. Events go to a sink that returns at once (the daemon's
kube.events.EventOutbox), so a slow Kubernetes API never delays the next round. (The residue guard, GPU memory a
finished tenant left behind, is agent.residue.)
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model.usage import ContainerShare

if TYPE_CHECKING:
    from ..config.types import Config
    from ..model.devices import Resource

log = logging.getLogger(__name__)

EventSink = Callable[[str, str, str, str], None]  # (namespace, pod, reason, message); must neither block nor raise


@dataclass(frozen=True)
class ContainerMemory:
    share: ContainerShare
    used_mib: int
    pids: tuple[int, ...]

    @property
    def over_limit(self) -> bool:
        return self.share.time_sliced and self.used_mib > self.share.memory_limit_mib


class MemoryWatchdog:
    """Acts once per offending process: a PID it handled is remembered until NVML stops listing it."""

    def __init__(self, policy: str = "report", events: EventSink | None = None, kill: Callable[[int], None] | None = None) -> None:
        self.policy = policy
        self.events = events
        self.kill = kill or (lambda pid: os.kill(pid, signal.SIGKILL))
        self.violations = 0  # over-limit containers seen (each once per episode)
        self.kills = 0  # processes killed
        self.kill_failures = 0  # processes the watchdog tried and failed to kill
        self._over: set[tuple] = set()
        self._handled: set[int] = set()  # PIDs already killed (or tried): never acted on twice

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload (runtime.reload): follow its memoryWatchdog policy."""
        self.policy = config.watchdog_policy

    def review(self, containers: list[ContainerMemory]) -> None:
        """Act on every container over its limit: report each episode once; under `kill`, each new PID once."""
        now_over = set()
        for item in containers:
            if not item.over_limit:
                continue
            share = item.share
            key = (share.key, share.unit_uuid)
            now_over.add(key)
            what = (
                f"container {share.namespace}/{share.pod}/{share.container} uses {item.used_mib} MiB of GPU memory on "
                f"{share.unit_uuid}, over the {share.memory_limit_mib} MiB of its {share.shares} share(s) of {share.resource}"
            )
            if self.policy == "kill":
                self._kill_new(share, what, [pid for pid in item.pids if pid not in self._handled])
            elif key not in self._over:
                self._event(share, "GPUMemoryOverLimit", what)
                log.warning("%s", what)
            if key not in self._over:
                self.violations += 1
        for key in self._over - now_over:
            log.info("container %s is back within its GPU memory on %s", "/".join(key[0]), key[1])
        self._over = now_over
        self._handled &= {pid for item in containers for pid in item.pids}  # forget PIDs NVML no longer lists

    def _kill_new(self, share: ContainerShare, what: str, pids: list[int]) -> None:
        """SIGKILL these PIDs once each; one Event says exactly which died and which could not be killed, and why."""
        if not pids:
            return
        killed, failed = [], []
        for pid in pids:
            self._handled.add(pid)
            try:
                self.kill(pid)
            except ProcessLookupError:
                failed.append(f"{pid} (no such process: it already exited, or the plugin runs without hostPID)")
            except PermissionError as err:
                failed.append(f"{pid} ({err.strerror or err}: the plugin needs hostPID and root to kill tenants)")
            except OSError as err:
                failed.append(f"{pid} ({err.strerror or err})")
            else:
                killed.append(str(pid))
        self.kills += len(killed)
        self.kill_failures += len(failed)
        parts = ([f"killed process(es) {', '.join(killed)}"] if killed else []) + ([f"could not kill {'; '.join(failed)}"] if failed else [])
        message = f"{what}; {'; '.join(parts)}"
        self._event(share, "GPUMemoryOverLimitKilled" if not failed else "GPUMemoryOverLimitKillFailed", message)
        (log.warning if not failed else log.error)("%s", message)

    def _event(self, share: ContainerShare, reason: str, message: str) -> None:
        if self.events is not None:
            self.events(share.namespace, share.pod, reason, message)

"""Memory watchdog for time-sliced shares, and the residue guard.

Time-slicing does not bound memory, so the watchdog compares each container's real GPU memory (its processes,
from NVML) with what its shares allow. `report` logs it, exports it and posts a Warning Event on the pod;
`kill` also SIGKILLs the offending processes. The residue guard finds GPU memory held by processes that belong
to no active container (a finished tenant's leftovers); with `quarantine`, the GPU's free devices are
advertised Unhealthy until the memory is released, so no new tenant lands on it.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from .podresources import ContainerShare

log = logging.getLogger(__name__)

EventSink = Callable[[str, str, str, str], None]  # (namespace, pod, reason, message)


@dataclass(frozen=True)
class ContainerMemory:
    share: ContainerShare
    used_mib: int
    pids: tuple[int, ...]

    @property
    def over_limit(self) -> bool:
        return self.share.time_sliced and self.used_mib > self.share.memory_limit_mib


class MemoryWatchdog:
    def __init__(self, policy: str = "report", events: EventSink | None = None, kill: Callable[[int], None] | None = None) -> None:
        self.policy = policy
        self.events = events
        self.kill = kill or (lambda pid: os.kill(pid, signal.SIGKILL))
        self.violations = 0  # over-limit containers seen (each once per episode)
        self.kills = 0
        self._over: set[tuple] = set()

    def review(self, containers: list[ContainerMemory]) -> None:
        """Act on every container over its limit; report each episode once, kill every time under `kill`."""
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
                for pid in item.pids:
                    try:
                        self.kill(pid)
                        self.kills += 1
                    except ProcessLookupError:
                        pass
                    except PermissionError as err:
                        log.error("cannot kill process %d of %s/%s: %s (does the plugin run with hostPID?)", pid, share.namespace, share.pod, err)
                self._event(share, "GPUMemoryOverLimitKilled", f"{what}; killed process(es) {', '.join(map(str, item.pids))}")
                log.warning("%s: killed process(es) %s", what, ", ".join(map(str, item.pids)))
            elif key not in self._over:
                self._event(share, "GPUMemoryOverLimit", what)
                log.warning("%s", what)
            if key not in self._over:
                self.violations += 1
        for key in self._over - now_over:
            log.info("container %s is back within its GPU memory on %s", "/".join(key[0]), key[1])
        self._over = now_over

    def _event(self, share: ContainerShare, reason: str, message: str) -> None:
        if self.events is None:
            return
        try:
            self.events(share.namespace, share.pod, reason, message)
        except Exception as err:  # an API outage must not stop the watchdog
            log.warning("cannot post event %s on %s/%s: %s", reason, share.namespace, share.pod, err)

"""Memory watchdog for time-sliced shares.

Time-slicing does not bound memory, so the watchdog compares each container's real GPU memory (its processes,
from NVML) with what its shares allow. `report` logs it, exports it and queues a Warning Event on the pod;
`kill` also SIGKILLs the offending processes, each PID once. Events go to a sink that returns at once (the daemon's
kube.events.EventOutbox), so a slow Kubernetes API never delays the next round. (The residue guard, GPU memory a
finished tenant left behind, is agent.residue.)

`kill` needs the host's PID namespace: NVML reports host PIDs, and in a pod without `hostPID` such a number names
another process of the pod's own namespace, or none. Where the front end asks for the check (the DRA driver, whose
DaemonSet has no hostPID unless opted in), `kill` runs only when `host_pid_namespace` proves the plugin shares the
host's PID namespace; otherwise the watchdog reports as under `report`, says why once per policy change, and counts
the episodes it did not kill (`kills_refused`).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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


def host_pid_namespace(proc_root: str, own: str = "/proc/self") -> str | None:
    """None when this process is in the PID namespace of the host's /proc (`proc_root`, its PID 1's namespace), else
    why not: another namespace (no hostPID), or one of the two cannot be read (fail closed: not the host's)."""
    try:
        host = os.stat(Path(proc_root) / "1" / "ns" / "pid")
        mine = os.stat(Path(own) / "ns" / "pid")
    except OSError as err:
        return f"the PID namespaces cannot be compared ({Path(proc_root) / '1' / 'ns' / 'pid'}: {err.strerror or err})"
    if (host.st_dev, host.st_ino) != (mine.st_dev, mine.st_ino):
        return f"the plugin is not in the host's PID namespace (that of PID 1 of {proc_root}): set hostPID on its pod"
    return None


class MemoryWatchdog:
    """Acts once per offending process: a PID it handled is remembered until NVML stops listing it.

    `kill_check`: where given, () -> why `kill` cannot run here (None: it can), asked at start and on every policy
    change; while it says why, `kill` acts as `report`."""

    def __init__(
        self,
        policy: str = "report",
        events: EventSink | None = None,
        kill: Callable[[int], None] | None = None,
        kill_check: Callable[[], str | None] | None = None,
    ) -> None:
        self.events = events
        self.kill = kill or (lambda pid: os.kill(pid, signal.SIGKILL))
        self.kill_check = kill_check
        self.kill_blocked: str | None = None  # why `kill` acts as `report` now (None: it kills, or policy is report)
        self.kills_refused = 0  # over-limit episodes reported, not killed, because kill_blocked
        self.policy = ""
        self._set_policy(policy)
        self.violations = 0  # over-limit containers seen (each once per episode)
        self.kills = 0  # processes killed
        self.kill_failures = 0  # processes the watchdog tried and failed to kill
        self._over: set[tuple] = set()
        self._handled: set[int] = set()  # PIDs already killed (or tried): never acted on twice

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload (runtime.reload): follow its memoryWatchdog policy."""
        self._set_policy(config.watchdog_policy)

    def _set_policy(self, policy: str) -> None:
        changed = policy != self.policy
        self.policy = policy
        if not changed:
            return
        self.kill_blocked = self.kill_check() if policy == "kill" and self.kill_check else None
        if self.kill_blocked:
            why = self.kill_blocked
            log.error("memoryWatchdog.policy kill cannot run: %s; reporting instead, as under policy report", why)

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
                f"{share.unit_uuid}, over the {share.memory_limit_mib} MiB of its {share.shares} share(s) "
                f"of {share.resource}"
            )
            if self.policy == "kill" and not self.kill_blocked:
                self._kill_new(share, what, [pid for pid in item.pids if pid not in self._handled])
            elif key not in self._over:
                if self.kill_blocked:
                    self.kills_refused += 1
                    what += f"; not killed: {self.kill_blocked}"
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
        parts = ([f"killed process(es) {', '.join(killed)}"] if killed else []) + (
            [f"could not kill {'; '.join(failed)}"] if failed else []
        )
        message = f"{what}; {'; '.join(parts)}"
        self._event(share, "GPUMemoryOverLimitKilled" if not failed else "GPUMemoryOverLimitKillFailed", message)
        (log.warning if not failed else log.error)("%s", message)

    def _event(self, share: ContainerShare, reason: str, message: str) -> None:
        if self.events is not None:
            self.events(share.namespace, share.pod, reason, message)

"""GPU health: critical XIDs, lost GPUs and failing queries make devices Unhealthy, by XID class.

Unlike a plugin that marks one replica per XID and never recovers, an event marks the GPU (or the one MIG
instance it names) and so every share and MIG instance on it. What happens next depends on the class:

- application XIDs (`ignored_xids`): the process is at fault, not the GPU; nothing is marked;
- reset-class XIDs (`reset_xids`), double-bit ECC events, lost GPUs, and any GPU whose driver reports a recovery
  action (NVML's GPU recovery action is not NONE): only a GPU reset clears them, so the devices stay Unhealthy until
  the driver shows the GPU was reset — its recovery action asked for a reset and reads NONE again — or the node
  reboots; never after a quiet period, never because a GPU that failed its queries answers again, and never
  because the plugin restarts: with `evidence_file` the waits are kept on disk (`health.evidence`);
- every other critical XID and failing query: Healthy again after `recovery_period` seconds without a new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ..discovery.inventory import Inventory
from ..logs import RepeatLimiter
from ..loop import BackgroundLoop, Clock
from ..model.node import Gpu, HealthEvent, NodeInfo
from ..state import NodeState
from .evidence import Evidence, EvidenceFile, Loaded, read_boot_id

log = logging.getLogger(__name__)

# Application errors (illegal address, page fault, graphics exception, ...): the process is at fault, not the GPU.
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# XIDs that need a GPU reset before the GPU takes new work, documented one by one in docs/operations.md
# (GPU health): 48 double-bit ECC, 64 row remapping failed, 74 NVLink, 79 fallen off the bus, 95 uncontained
# ECC, 154 recovery action changed. Not here, following NVIDIA's memory-error guide: 63 (row remap pending) and
# 94 (contained ECC), after which new work may start without a reset; those, GSP errors (119/120) and the rest
# recover after the quiet period unless the driver's recovery action asks for a reset.
DEFAULT_RESET_XIDS = frozenset({48, 64, 74, 79, 95, 154})

# The longest single wait for a health event. NVML's event wait cannot be woken, so a stop waits for the one in
# progress to end: this bounds that (SIGTERM -> exit is node downtime in a rolling update) at ~20 cheap waits/s.
EVENT_WAIT = 0.05


@dataclass(frozen=True)
class HealthSettings:
    enabled: bool = True
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    reset_xids: frozenset[int] = DEFAULT_RESET_XIDS
    recovery_period: float = 300.0  # seconds of quiet before devices are Healthy again (not for reset-class faults)
    check_interval: float = 1.0  # seconds between query checks
    evidence_file: Path | None = None  # where reset waits outlive the process (health.evidence); None: in memory only

    def keeping_evidence_in(self, path: Path) -> HealthSettings:
        """These settings with `path` as the evidence file, unless one is set already."""
        return self if self.evidence_file else replace(self, evidence_file=path)


@dataclass
class _ResetWait:
    """A reset-class fault on a GPU or MIG instance: cleared once the driver has required a reset and no longer does."""

    gpu_uuid: str
    reason: str
    required_seen: bool = False  # the driver's recovery action said "reset" since the fault


class HealthMonitor(BackgroundLoop):
    """Follows the backend's health events and checks; writes its verdict (unhealthy GPU/MIG UUIDs with the reasons,
    those awaiting a reset, XID counts) to the NodeState after every change."""

    def __init__(
        self,
        inventory: Inventory,
        node: NodeInfo,
        state: NodeState,
        settings: HealthSettings = HealthSettings(),
        clock: Clock = time.monotonic,
        node_check: Callable[[Gpu], Mapping[str, str]] | None = None,
        boot_id: Callable[[], str | None] = read_boot_id,
    ) -> None:
        super().__init__("health")
        self.inventory = inventory
        self.node = node
        self.state = state
        self.settings = settings
        self.clock = clock
        self.node_check = (
            node_check  # beyond NVML, GPU or MIG UUID -> problem: e.g. the device nodes deviceSpecs hands out
        )
        self._xid_counts: dict[str, int] = {g.uuid: 0 for g in node.gpus}
        self._last_bad: dict[str, float] = {}  # unhealthy uuid -> when it last misbehaved
        self._reasons: dict[str, str] = {}
        self._gpu_of: dict[str, str] = {}  # unhealthy MIG UUID -> its GPU's (NodeView.instance_gpus)
        self._reset_waits: dict[str, _ResetWait] = {}  # uuid -> waiting for a GPU reset
        self._ignored = RepeatLimiter(log, clock=clock)  # an XID storm: one line and a summary per minute
        self._next_check = 0.0
        kept = settings.evidence_file if settings.enabled else None  # health checks off: no evidence, old or new
        self._evidence = EvidenceFile(kept, boot_id) if kept else None
        self._carried: dict[str, Evidence] = {}  # evidence of UUIDs not on the node now (a GPU discovery left out)
        self._saved: dict[str, Evidence] | None = None  # what the evidence file holds; None: unknown
        self._evidence_errors = 0  # failed reads and writes of the evidence file
        self._write_errors = RepeatLimiter(log, clock=clock)
        if self._evidence:
            self._restore(self._evidence.load())
        self._publish()

    def _restore(self, loaded: Loaded) -> None:
        """Wait again for the resets the evidence file names; an unusable file holds every GPU of the node."""
        now = self.clock()
        if loaded.problem:
            self._evidence_errors += 1
            log.error(
                "%s: every GPU is held for a reset until the driver shows it was reset "
                "(docs/operations.md#reset-evidence-across-restarts)",
                loaded.problem,
            )
            for gpu in self.node.gpus:
                self._reset_waits[gpu.uuid] = _ResetWait(gpu.uuid, "reset evidence unreadable")
                self._mark(gpu.uuid, "reset evidence unreadable", now, gpu.uuid)
            return
        self._saved = dict(loaded.entries)
        gpus = {g.uuid for g in self.node.gpus}
        here = gpus | {m.uuid for g in self.node.gpus for m in g.mig_devices}
        for uuid, evidence in loaded.entries.items():
            # a MIG instance not listed (a dynamic one, or destroyed since) stays its GPU's fault until the GPU is
            # shown reset (NodeView.instance_gpus); the evidence of a GPU discovery left out is carried
            if uuid not in here and evidence.gpu_uuid not in gpus:
                self._carried[uuid] = evidence
                continue
            self._reset_waits[uuid] = _ResetWait(evidence.gpu_uuid, evidence.reason, evidence.required_seen)
            log.warning(
                "%s needed a GPU reset before this process started (%s): its devices stay Unhealthy until the "
                "driver shows it was reset",
                uuid,
                evidence.reason,
            )
            self._mark(uuid, evidence.reason, now, evidence.gpu_uuid)

    def first_pass(self) -> None:
        """Check every GPU once now (before the servers list any device); the loop's checks follow from start()."""
        if self.settings.enabled:
            now = self.clock()
            self.check(now)
            self._next_check = now + self.settings.check_interval

    def start(self) -> None:
        if not self.settings.enabled:
            log.warning("health checks are disabled: failed GPUs stay advertised as Healthy")
            return
        self._start_thread()

    def _run(self) -> None:
        self._repeat(self._round, self.settings.check_interval)

    def _round(self) -> float:
        """Wait for one event (at most EVENT_WAIT), apply it, and check every GPU when a check is due."""
        try:
            event = self.inventory.wait_for_event(min(self.settings.check_interval, EVENT_WAIT))
        except Exception as err:  # a backend failure must never end health monitoring
            log.error("health event wait failed: %s", err)
            return self.settings.check_interval
        if event:
            self.handle(event)
        now = self.clock()
        if now >= self._next_check:
            self.check(now)
            self._next_check = now + self.settings.check_interval
        return 0.0

    def handle(self, event: HealthEvent) -> bool:
        """Apply one event (and write the verdict); True when the unhealthy set changed."""
        if event.xid is not None:
            if event.xid in self.settings.ignored_xids:
                self._ignored.log(
                    logging.INFO,
                    (event.xid, event.gpu_uuid),
                    "ignoring application XID %d on GPU %s",
                    event.xid,
                    event.gpu_uuid,
                )
                return False
            self._xid_counts[event.gpu_uuid] = self._xid_counts.get(event.gpu_uuid, 0) + 1
        target = event.mig_uuid or event.gpu_uuid
        if (event.reset_required or event.xid in self.settings.reset_xids) and target not in self._reset_waits:
            self._reset_waits[target] = _ResetWait(event.gpu_uuid, event.reason)
            log.warning(
                "%s needs a GPU reset (%s): its devices stay Unhealthy until the driver shows it was reset",
                target,
                event.reason,
            )
        changed = self._mark(target, event.reason, self.clock(), event.gpu_uuid)
        self._publish()
        return changed

    def check(self, now: float) -> bool:
        """Query every GPU, clear what recovered (and write the verdict); True when the unhealthy set changed."""
        changed = self._check_all(now)
        self._publish()
        return changed

    def _publish(self) -> None:
        self._persist()
        self._gpu_of = {m: g for m, g in self._gpu_of.items() if m in self._reasons}  # bounded: the unhealthy ones
        self.state.set_health(
            self._reasons, frozenset(self._reset_waits), self._xid_counts, self._evidence_errors, self._gpu_of
        )

    def _persist(self) -> None:
        """Write the reset waits to the evidence file when they changed (a failed write is retried next time)."""
        if self._evidence is None:
            return
        waits = {uuid: Evidence(uuid, w.gpu_uuid, w.reason, w.required_seen) for uuid, w in self._reset_waits.items()}
        wanted = {**self._carried, **waits}
        if wanted == self._saved:
            return
        try:
            self._evidence.save(wanted)
        except OSError as err:
            self._evidence_errors += 1
            self._write_errors.log(
                logging.ERROR,
                "write",
                "cannot write the reset evidence %s: %s (a restart would forget it)",
                self._evidence.path,
                err,
            )
            return
        self._saved = wanted

    def _check_all(self, now: float) -> bool:
        self._ignored.flush()
        changed = False
        failing = set()
        required: dict[str, bool | None] = {}  # GPU uuid -> the driver says it needs a reset (None: cannot tell)
        for gpu in self.node.gpus:
            try:
                problem = self.inventory.check(gpu.uuid)
                problems = {gpu.uuid: problem} if problem else dict(self.node_check(gpu)) if self.node_check else {}
            except Exception as err:  # a check that raises counts as a failing query
                problems = {gpu.uuid: f"health check raised {err}"}
            if gpu.uuid in problems:
                failing.add(gpu.uuid)
            for uuid, why in problems.items():  # the GPU, or one MIG instance of it
                changed |= self._mark(uuid, why, now, gpu.uuid)
            try:
                required[gpu.uuid] = self.inventory.reset_required(gpu.uuid)
            except Exception as err:
                log.debug("reset state of GPU %s unknown: %s", gpu.uuid, err)
                required[gpu.uuid] = None
            if required[gpu.uuid] and gpu.uuid not in self._reset_waits:
                self._reset_waits[gpu.uuid] = _ResetWait(gpu.uuid, "the driver requires a GPU reset", True)
                log.warning("GPU %s: the driver requires a GPU reset (NVML GPU recovery action)", gpu.uuid)
                changed |= self._mark(gpu.uuid, "the driver requires a GPU reset", now, gpu.uuid)
        changed |= self._check_resets(failing, required)
        for uuid, last in list(self._last_bad.items()):
            if uuid not in self._reset_waits and now - last >= self.settings.recovery_period:
                del self._last_bad[uuid]
                log.info(
                    "%s is healthy again after %.0fs without errors (was: %s)",
                    uuid,
                    now - last,
                    self._reasons.pop(uuid),
                )
                changed = True
        return changed

    def _check_resets(self, failing: set[str], required: dict[str, bool | None]) -> bool:
        """Clear a reset-class fault only on the driver's evidence of a reset: its GPU recovery action asked for one
        (anything but NONE) and now reads NONE, with the GPU's queries passing. A GPU that failed its queries and
        answers again is no evidence (a transient failure looks the same), and neither is a driver that cannot tell:
        the devices stay Unhealthy until the node reboots or the operator clears the evidence."""
        changed = False
        for uuid, wait in list(self._reset_waits.items()):
            said = required.get(wait.gpu_uuid)
            if said:
                wait.required_seen = True
            elif said is False and wait.required_seen and wait.gpu_uuid not in failing:
                del self._reset_waits[uuid]
                self._last_bad.pop(uuid, None)
                log.info(
                    "%s was reset (the driver's recovery action asked for a reset and now reads none): its "
                    "devices are Healthy again (was: %s)",
                    uuid,
                    self._reasons.pop(uuid, "?"),
                )
                changed = True
        return changed

    def _mark(self, uuid: str, reason: str, now: float, gpu: str) -> bool:
        """`uuid` (the GPU `gpu`, or one MIG instance of it) is unhealthy for `reason`; True when it was not."""
        new = uuid not in self._reasons
        if uuid != gpu:
            self._gpu_of[uuid] = gpu
        self._last_bad[uuid] = now
        self._reasons[uuid] = reason
        if new:
            log.warning("marking %s and every device on it Unhealthy: %s", uuid, reason)
        return new

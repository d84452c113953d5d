"""NodeState: the one owner of the node's runtime state, what the plugin's parts tell each other while it runs.

Writers: the health monitor (unhealthy GPUs and MIG instances with the reasons, those awaiting a GPU reset, XID
counts), the node agent (the GPUs the residue guard quarantines and their quarantined free devices; its latest
observation), the plugin manager (MPS pools whose control daemon is not ready; the GPUs whose new shape waits for
their holders to leave), and whatever holds devices, by source (`holds`: pod-resources and the kubelet's checkpoint
for containers, a DRA driver for its prepared claims). Readers: the DevicePlugin servers
(ListAndWatch and Allocate, through `resource_health`), the label and annotation publisher, the metrics.

Every write replaces a part under one lock and makes a new immutable `NodeView`; readers take `snapshot()`, or
`subscribe()` to be called with each new view. Callbacks run on the writer's thread, outside the lock, one view
at a time and in order; they must be quick (wake a stream, set an event). A callback that raises is logged and
the others still run: a reader never breaks a writer.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from .alloc.allocator import ResourceHealth

if TYPE_CHECKING:
    from .agent.observe import Observation
    from .config.types import PoolConfig
    from .model.devices import Resource, Unit
    from .model.usage import Hold

log = logging.getLogger(__name__)

# The kinds of finding of a unit's verdict (`NodeView.verdict`): why it may not take new work.
GPU_LOST = "gpu-lost"  # the GPU stopped answering (fell off the bus); only a reset clears it (health.monitor)
RESET_REQUIRED = "reset-required"  # a reset-class XID, a double-bit ECC error or the driver's recovery action
XID = "xid"  # another critical XID; cleared after the health monitor's quiet period
QUERY_FAILED = "query-failed"  # an NVML query or a device-node check failed
FAULTS = (GPU_LOST, RESET_REQUIRED, XID, QUERY_FAILED)  # the health monitor's kinds
QUARANTINED = "quarantined"  # the residue guard holds the GPU back (a finished tenant's memory is still in use)
MPS_DOWN = "mps-down"  # the unit's MPS pool has no ready control daemon
SHAPE_PENDING = "shape-pending"  # a reload keeps the GPU in its old shape until its holders leave
KINDS = (*FAULTS, QUARANTINED, MPS_DOWN, SHAPE_PENDING)

_XID = re.compile(r"\bXID \d+\b")


def fault_kind(reason: str, awaiting_reset: bool) -> str:
    """The kind of a health monitor reason ("XID 79", "GPU is lost", "NVML query on GPU ... failed: ...")."""
    if "lost" in reason.lower():
        return GPU_LOST
    if awaiting_reset:
        return RESET_REQUIRED
    if _XID.search(reason):
        return XID
    return QUERY_FAILED


@dataclass(frozen=True)
class Finding:
    kind: str  # one of KINDS
    reason: str  # one line for humans


@dataclass(frozen=True)
class Verdict:
    """May this unit take new work, and why not: every finding, the most serious first (empty: it may)."""

    findings: tuple[Finding, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.findings

    def kinds(self) -> tuple[str, ...]:
        return tuple(f.kind for f in self.findings)

    def fault(self) -> Finding | None:
        """The health monitor's finding, if any."""
        return next((f for f in self.findings if f.kind in FAULTS), None)


@dataclass(frozen=True)
class NodeView:
    """The node's runtime state at one moment; `version` grows with every change."""

    version: int = 0
    unhealthy: frozenset[str] = frozenset()  # GPU or MIG UUIDs whose devices are Unhealthy
    reasons: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # each of them -> why
    awaiting_reset: frozenset[str] = frozenset()  # GPU or MIG UUIDs Unhealthy until their GPU is reset
    instance_gpus: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({})
    )  # MIG UUID -> its GPU's, for the MIG instances among `unhealthy`
    xid_counts: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType({})
    )  # GPU UUID -> critical XIDs seen
    evidence_errors: int = 0  # failed reads and writes of the health monitor's reset evidence file
    quarantined_gpus: frozenset[str] = frozenset()  # GPUs holding a finished tenant's memory (residue guard)
    quarantined_devices: frozenset[str] = frozenset()  # their free device IDs, advertised Unhealthy
    mps_not_ready: frozenset[str] = frozenset()  # MPS pools whose control daemon is not ready: all devices Unhealthy
    observation: Observation | None = None  # the node agent's latest round; None before the first
    holds: Mapping[str, frozenset[Hold]] = field(
        default_factory=lambda: MappingProxyType({})
    )  # source -> devices it holds
    pending_gpus: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({})
    )  # GPU UUID -> why its new shape waits

    def all_holds(self) -> frozenset[Hold]:
        """Every hold of every source."""
        return frozenset().union(*self.holds.values())

    def fault_of(self, uuid: str) -> str | None:
        """The kind of the health monitor's fault on this GPU or MIG instance UUID itself; None when it has none."""
        reason = self.reasons.get(uuid)
        return None if reason is None else fault_kind(reason, uuid in self.awaiting_reset)

    def mps_down(self, pool: PoolConfig) -> bool:
        """The pool's MPS control daemon is not ready (a pool that is not MPS has none to wait for)."""
        return pool.mps and pool.name in self.mps_not_ready

    def verdict(self, unit: Unit, pool: PoolConfig) -> Verdict:
        """The one answer to "may this unit take new work, and why not"; every consumer maps from it."""
        gpu = unit.gpu
        findings = []
        for uuid in (gpu.uuid, unit.uuid):  # the GPU's own fault first: a MIG instance inherits it
            kind = self.fault_of(uuid)
            if kind is not None:
                findings.append(Finding(kind, f"GPU {gpu.index} ({unit.uuid}): {self.reasons[uuid]}"))
                break
        if not findings and unit.uuid == gpu.uuid:
            # the whole GPU's unit (a dynamic-MIG device's) takes the faults of its MIG instances (fail closed)
            for mig in (m for m, parent in self.instance_gpus.items() if parent == gpu.uuid):
                kind = self.fault_of(mig)
                if kind is not None:
                    findings.append(Finding(kind, f"GPU {gpu.index} (MIG instance {mig}): {self.reasons[mig]}"))
                    break
        if gpu.uuid in self.quarantined_gpus:
            why = "a finished container's memory is still in use"
            quarantined = f"GPU {gpu.index} ({gpu.uuid}) is quarantined by the residue guard: {why}"
            findings.append(Finding(QUARANTINED, quarantined))
        if self.mps_down(pool):
            findings.append(Finding(MPS_DOWN, f"the MPS control daemon of pool {pool.name} is not ready"))
        if gpu.uuid in self.pending_gpus:
            findings.append(Finding(SHAPE_PENDING, self.pending_gpus[gpu.uuid]))
        return Verdict(tuple(findings))

    def resource_health(self, resource: Resource, health_keys: frozenset[str] | None = None) -> ResourceHealth:
        """One resource's part of this view, mapped from the verdict of each of its units that has a finding: a fault
        or a shape that waits makes the unit's devices Unhealthy (and a waiting GPU's refused in Allocate), the
        residue guard's quarantine only the unit's free devices (a held one takes no new work anyway), a pool whose
        MPS daemon is down every device. `health_keys`: `resource.health_keys()`, when the caller keeps it."""
        keys = resource.health_keys() if health_keys is None else health_keys
        pool = resource.pool
        mps_ready = not self.mps_down(pool)  # the pool's finding, the same in every unit's verdict
        flagged = self.unhealthy.union(self.quarantined_gpus, self.pending_gpus) & keys
        if not flagged:
            return ResourceHealth(mps_ready=mps_ready)
        unhealthy, pending, held_back = set(), set(), set()
        for unit in resource.units:
            if unit.uuid not in flagged and unit.gpu.uuid not in flagged:
                continue
            kinds = self.verdict(unit, pool).kinds()
            if SHAPE_PENDING in kinds:
                pending.add(unit.gpu.uuid)
            if SHAPE_PENDING in kinds or any(k in FAULTS for k in kinds):
                unhealthy.add(unit.uuid)
            if QUARANTINED in kinds:
                held_back.add(unit.uuid)
        devices = resource.devices
        quarantined = (
            frozenset(i for i in self.quarantined_devices if (d := devices.get(i)) and d.unit.uuid in held_back)
            if held_back
            else frozenset()
        )
        return ResourceHealth(frozenset(unhealthy), quarantined, frozenset(pending), mps_ready)


Subscriber = Callable[[NodeView], None]


class NodeState:
    """Thread-safe; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._view = NodeView()
        self._subscribers: tuple[Subscriber, ...] = ()
        self._delivery = threading.Lock()  # one delivery round at a time: subscribers see views in order
        self._delivered = 0
        self._delivering = threading.local()

    def snapshot(self) -> NodeView:
        with self._lock:
            return self._view

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(view)` after every change from now on; returns the function that ends the subscription.
        The current view is not delivered: read `snapshot()` after subscribing (a newer view may arrive first)."""
        with self._lock:
            self._subscribers = (*self._subscribers, callback)

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = tuple(s for s in self._subscribers if s is not callback)

        return unsubscribe

    # --- writers ---------------------------------------------------------------------------------
    def set_health(
        self,
        reasons: Mapping[str, str],
        awaiting_reset: frozenset[str] = frozenset(),
        xid_counts: Mapping[str, int] | None = None,
        evidence_errors: int | None = None,
        instance_gpus: Mapping[str, str] | None = None,
    ) -> None:
        """The health monitor's verdict: unhealthy UUIDs with their reasons, those awaiting a reset, XID counts and
        the reset evidence file's errors (None: unchanged), and the GPU of each unhealthy MIG instance."""
        reasons, awaiting_reset = MappingProxyType(dict(reasons)), frozenset(awaiting_reset)
        parents = MappingProxyType({m: g for m, g in (instance_gpus or {}).items() if m in reasons})
        counts = None if xid_counts is None else MappingProxyType(dict(xid_counts))

        def change(v: NodeView) -> NodeView:
            return replace(
                v,
                unhealthy=frozenset(reasons),
                reasons=reasons,
                awaiting_reset=awaiting_reset,
                instance_gpus=parents,
                xid_counts=v.xid_counts if counts is None else counts,
                evidence_errors=v.evidence_errors if evidence_errors is None else evidence_errors,
            )

        self._update(change)

    def set_quarantine(self, gpus: frozenset[str], devices: frozenset[str]) -> None:
        """The residue guard's verdict: quarantined GPUs and their quarantined free devices."""
        gpus, devices = frozenset(gpus), frozenset(devices)
        self._update(lambda v: replace(v, quarantined_gpus=gpus, quarantined_devices=devices))

    def set_mps_ready(self, pool: str, ready: bool) -> None:
        """Whether an MPS pool's control daemon is ready (False: every device of the pool Unhealthy)."""
        self._update(
            lambda v: replace(v, mps_not_ready=v.mps_not_ready - {pool} if ready else v.mps_not_ready | {pool})
        )

    def set_observation(self, observation: Observation) -> None:
        """The node agent's latest round (usage, GPU stats, per-container memory, residue)."""
        self._update(lambda v: replace(v, observation=observation))

    def set_holds(self, source: str, holds: frozenset[Hold]) -> None:
        """What one source (`pod-resources`, `dra`, ...) says is held now: it pins those GPUs' shapes."""
        holds = frozenset(holds)
        self._update(lambda v: replace(v, holds=MappingProxyType({**v.holds, source: holds})))

    def set_pending(self, pending: Mapping[str, str]) -> None:
        """The GPUs kept in their old shape until released (their devices are Unhealthy for new containers)."""
        pending = MappingProxyType(dict(pending))
        self._update(lambda v: replace(v, pending_gpus=pending))

    # --- inside ------------------------------------------------------------------------------------
    def _update(self, change: Callable[[NodeView], NodeView]) -> None:
        """Apply `change` to the current view; a new version (and a delivery) only when something differs."""
        with self._lock:
            current = self._view
            new = change(current)
            if new == current:
                return
            self._view = replace(new, version=current.version + 1)
        self._deliver()

    def _deliver(self) -> None:
        """Hand the newest view to every subscriber, outside the state lock, in version order. A write made by a
        subscriber is delivered by the round already running on this thread, after the current one."""
        if getattr(self._delivering, "active", False):
            return
        with self._delivery:
            self._delivering.active = True
            try:
                while True:
                    with self._lock:
                        view, subscribers = self._view, self._subscribers
                    if view.version <= self._delivered:
                        return
                    self._delivered = view.version
                    for callback in subscribers:
                        try:
                            callback(view)
                        except Exception:
                            log.exception(
                                "a NodeState subscriber failed on version %d (the others still run)", view.version
                            )
            finally:
                self._delivering.active = False

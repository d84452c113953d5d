"""The driver's node logic, transport-free: a claim's allocation -> prepared devices, CDI specs and the checkpoint.

`Driver.prepare` takes a claim as the API returns it (a resource.k8s.io/v1 ResourceClaim, camelCase dict) and
keeps only the allocation results of this driver and this node's pool. Every refusal is a `ClaimError` with a
message for the pod's event, never an exception of another kind for bad input:

- the claim was replaced (another UID) or is not allocated;
- a result names a device this node does not publish, or a pool other than the node's;
- a SharingConfig of this driver (`dra.sharingconfig`) is malformed, asks for what the pool does not offer, or more
  than the claim consumed (another driver's config is not read);
- a device is Unhealthy (`dra.health`);
- a whole device is already prepared for another claim;
- the shares prepared claims hold on a shared device, with this claim's, would exceed its N shares (the ledger:
  kube-scheduler checks `shares` and `memory` each on its own, so only the driver can see a claim that names one
  and gets the other by default; see `devices.claim_share`);
- the grant cannot be built (with `deviceSpecs`, a MIG capability that cannot be read): the `AllocationError` the
  device plugin's Allocate would get, with its message;
- a dynamic-MIG device whose instance NVML does not make (its placement taken: INSUFFICIENT_RESOURCES), or one asked
  with admin access (`dra.migdynamic`: the instance is made here, recorded as an intent first, and destroyed at
  unprepare, which NVML may refuse while processes run: IN_USE).

Prepare and unprepare are idempotent and serialised (`SerialLock`); the ledger is rebuilt from the checkpoint.

Never from an allocation it cannot prove current: a claim's first prepare, and a prepare whose claim shows another
allocation than the record (re-allocated under the same UID), need the claim as the API serves it now
(`current=True`, a GET); a cached copy gets `Unconfirmed`, and the caller reads the claim again. A re-allocated
claim is prepared from its new allocation and its record replaced atomically; its old dynamic-MIG instances are
destroyed first (their placements may be the new allocation's), and when the new allocation cannot be prepared the
old record stays without the devices of those instances, so unprepare still removes everything. A claim whose record
is damaged (`Checkpoint.damaged`) keeps its devices fenced — the devices the API allocates to that UID
(`find_claim`), or every device while that cannot be told — until the kubelet unprepares it (its CDI spec is
removed) or the API shows it gone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..alloc.allocator import AllocationError, ContainerGrant
from ..config.types import Config
from ..logs import brief, safe_text
from ..model.devices import Resource
from ..model.mig import MigInstance
from ..state import NodeState
from .cdi import CdiWriter, cdi_device_name, cdi_id
from .checkpoint import Checkpoint, MigRecord, PreparedClaim, PreparedDevice, valid_uid
from .devices import ClaimError, ClaimShare, DraDevice, by_name, claim_share, dra_devices, request_grant
from .lock import SerialLock
from .migdynamic import MigInstances, instance_share
from .sharingconfig import DeviceConfig, Sharing, config_for, driver_configs, resolve

log = logging.getLogger(__name__)

MAX_RESULTS_PER_CLAIM = 32  # the API's own bound on allocation results
MAX_CONFIGS_PER_CLAIM = 64  # class and claim configs together (the API allows 32 claim configs)
MAX_NAME_CHARS = 253
MAX_CLAIMS_PER_CALL = 4096  # a pod's claims, or several pods' batched: far more is not a kubelet


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{safe_text(self.namespace, 63)}/{safe_text(self.name, MAX_NAME_CHARS)}"


class Unconfirmed(ClaimError):
    """The claim was a cached copy, and this prepare needs it as the API serves it now."""


UNKNOWN = "unknown"  # find_claim: the API's view of that UID cannot be told now
GONE = "gone"  # find_claim: no claim with that UID is allocated to this driver on this node
ClaimFinder = Callable[[str], "Mapping[str, Any] | str"]  # UID -> the claim, UNKNOWN or GONE


class Driver:
    """See the module docstring. Thread-safe."""

    def __init__(
        self,
        name: str,
        pool: str,
        checkpoint: Checkpoint,
        cdi: CdiWriter,
        state: NodeState,
        lock: SerialLock,
        mig: MigInstances | None = None,
    ) -> None:
        """`mig`: makes and destroys the instances of dynamic-MIG devices (without it such a claim is refused)."""
        self.name = name  # the DRA driver name (`spec.driver` of its slices and of claims' results)
        self.mig = mig or MigInstances(None, lambda _: [])
        self.pool = pool  # the node's pool: the node name
        self.checkpoint = checkpoint
        self.cdi = cdi
        self.state = state
        self.lock = lock
        self._devices: dict[str, DraDevice] = {}
        self._ledger: dict[str, int] = {}
        self._ledger_mib: dict[str, int] = {}  # GPU memory prepared claims hold, per device name (survives a reload)
        self.find_claim: ClaimFinder = lambda uid: UNKNOWN
        self.reallocated = 0  # prepared claims whose record was replaced by a new allocation
        with self.lock:
            self.checkpoint.sweep()
            self.cdi.sweep()
            self._rebuild_ledger()

    @property
    def devices(self) -> list[DraDevice]:
        return list(self._devices.values())

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload (runtime.reload): new claims are prepared against the devices it yields; prepared
        claims keep what they hold."""
        self._devices = by_name(dra_devices(resources))

    # --- the two calls ---------------------------------------------------------------------------
    def prepare(self, ref: ClaimRef, claim: Mapping[str, Any], current: bool = True) -> PreparedClaim:
        """The claim prepared (the recorded answer when it already is, from the same allocation); ClaimError with a
        message otherwise. `current`: `claim` is the API's answer to a read made for this prepare, not a cached copy."""
        uid = str(_get(claim, "metadata", "uid") or "")
        refused = Unconfirmed if not current else ClaimError
        if uid != ref.uid:
            raise refused(
                f"claim {ref} got replaced: the API has UID {safe_text(uid)}, "
                f"the kubelet asked for {safe_text(ref.uid)}"
            )
        allocation = _get(claim, "status", "allocation")
        if not allocation:
            raise refused(f"claim {ref} is not allocated")
        digest = allocation_digest(self.name, allocation)
        with self.lock:
            self._refresh(ref.uid)
            known = self.checkpoint.get(ref.uid)
            if known is not None and not known.pending and _same_allocation(known, digest, self.name, allocation):
                self._ensure_spec(known, ref, allocation)
                return known
            if not current:
                why = (
                    "its MIG instances were being made"
                    if known and known.pending
                    else "the cache shows another allocation than the record"
                )
                raise Unconfirmed(f"claim {ref}: " + ("first prepare" if known is None else why))
            fenced = self._fenced(ref.uid)
            old = known if known is not None and not known.pending else None  # re-allocated: the record replaced
            if old is not None and old.mig:
                old = self._destroy_instances(ref, old)  # its old instances go first (their placements are needed)
            if known is not None:
                self._add(known, -1)  # replaced below: the new allocation is checked without the old one's shares
            try:
                prepared = self._prepare_new(
                    ref, allocation, digest, fenced, known if known is not None and known.pending else None
                )
            except BaseException:
                if old is not None:
                    self._keep(old)
                elif known is not None and ref.uid in self.checkpoint:
                    self._add(known, 1)
                raise
            if known is not None:
                self.reallocated += 1
                log.warning(
                    "claim %s was re-allocated (devices %s -> %s): prepared from its new allocation, "
                    "its record replaced",
                    ref,
                    brief(sorted(d.device for d in known.devices), 4),
                    brief(sorted(d.device for d in prepared.devices), 4),
                )
            return prepared

    def _prepare_new(
        self,
        ref: ClaimRef,
        allocation: Mapping[str, Any],
        digest: str,
        fenced: Mapping[str, str],
        interrupted: PreparedClaim | None,
    ) -> PreparedClaim:
        """Check, make the dynamic-MIG instances, write the CDI spec and the record, count it in the ledger (under the
        lock). `interrupted`: this claim's intent record, left by a prepare that did not finish."""
        holdings, configs = self._holdings(ref, allocation)
        for result, share in holdings:
            if share.device.name in fenced and not result.get("adminAccess"):
                raise ClaimError(
                    f"claim {ref}: device {share.device.name} is fenced: the checkpoint record of claim "
                    f"{fenced[share.device.name]} is damaged (quarantined) and that claim may still use it, "
                    "until the kubelet unprepares it or the API shows it gone"
                )
        _sharings(
            ref, holdings, configs
        )  # a config the pool does not offer refuses the claim before any instance is made
        holdings, made = self._make_instances(ref, digest, holdings, interrupted)
        try:
            return self._record(ref, digest, holdings, configs, made)
        except BaseException:
            self._undo_instances(ref, made.values())
            raise

    def _record(
        self,
        ref: ClaimRef,
        digest: str,
        holdings: list[tuple[Mapping[str, Any], ClaimShare]],
        configs: Sequence[DeviceConfig],
        made: Mapping[int, MigRecord],
    ) -> PreparedClaim:
        groups, grants, strategies = _request_grants(ref, holdings, configs)
        spec = str(self.cdi.write(ref.uid, grants)) if holdings else ""
        first = {indexes[0]: g for g, indexes in enumerate(groups)}  # a request's CDI device goes with its first result
        group_of = {i: g for g, indexes in enumerate(groups) for i in indexes}
        devices = tuple(
            PreparedDevice(
                request=_base_request(result),
                pool=self.pool,
                device=share.device.name,
                cdi_ids=(cdi_id(self.cdi.kind, cdi_device_name(ref.uid, first[i])), *grants[first[i]].cdi_devices)
                if i in first
                else (),
                share_id=share.share_id,
                shares=0 if result.get("adminAccess") else share.shares,
                memory_mib=share.memory_mib,
                mig=made.get(i),
                strategy=strategies[group_of[i]],
            )
            for i, (result, share) in enumerate(holdings)
        )
        prepared = PreparedClaim(
            uid=ref.uid, namespace=ref.namespace, name=ref.name, devices=devices, cdi_spec=spec, allocation=digest
        )
        try:
            self.checkpoint.put(prepared)
        except BaseException:
            self.cdi.remove(spec)
            raise
        self._add(prepared, 1)
        return prepared

    def unprepare(self, ref: ClaimRef) -> None:
        """Undo prepare from the checkpoint alone (the claim may be gone); a claim not prepared here is done."""
        with self.lock:
            self._refresh(ref.uid)
            known = self.checkpoint.get(ref.uid)
            if known is not None and known.mig:
                self._destroy_instances(ref, known)  # first: a refusal (IN_USE) leaves the claim prepared, to retry
            if known is None:
                if ref.uid in self.checkpoint.damaged:  # its record is damaged: its spec is where this driver writes it
                    self.cdi.remove(str(self.cdi.spec_path(ref.uid)))
                    self.checkpoint.release(ref.uid)
                    log.warning(
                        "claim %s (damaged record) unprepared: its CDI spec removed, its devices no longer fenced", ref
                    )
                return
            self.cdi.remove(known.cdi_spec)
            self.checkpoint.remove(ref.uid)
            self._add(known, -1)

    def sweep_mig(self) -> None:
        """At start-up: the instances on dynamic-MIG GPUs that no record names (dra.migdynamic.MigInstances.sweep)."""
        gpus = {d.unit.gpu.uuid: d.unit.gpu for d in self._devices.values() if d.partition}
        with self.lock:
            self._refresh("")
            self.mig.sweep(gpus.values(), self.checkpoint.claims(), bool(self.checkpoint.damaged))

    def rescan_mig(self) -> bool:
        """Periodically: instances made behind the driver's back (dra.migdynamic.MigInstances.rescan); True when
        the slices must be published again."""
        gpus = {d.unit.gpu.uuid: d.unit.gpu for d in self._devices.values() if d.partition}
        if not gpus:
            return False
        with self.lock:
            self._refresh("")
            return self.mig.rescan(gpus.values(), self.checkpoint.claims())

    # --- dynamic MIG -----------------------------------------------------------------------------
    def _make_instances(
        self,
        ref: ClaimRef,
        digest: str,
        holdings: list[tuple[Mapping[str, Any], ClaimShare]],
        interrupted: PreparedClaim | None,
    ) -> tuple[list[tuple[Mapping[str, Any], ClaimShare]], dict[int, MigRecord]]:
        """The holdings with each dynamic-MIG device's instance made (its MIG device as the unit), and the records by
        holding index; the intent is written first. A shared device's instance is made by its first claim and reused
        by the others (`_holders`). ClaimError when one cannot be made (those made, and held by no other claim, are
        destroyed)."""
        partitioned = [(i, result, share) for i, (result, share) in enumerate(holdings) if share.device.partition]
        if not partitioned:
            return holdings, {}
        if any(result.get("adminAccess") for _, result, _ in partitioned):
            raise ClaimError(
                f"claim {ref}: admin access to a dynamic MIG device is not supported "
                "(its instance exists only while a claim holds it)"
            )
        intent = PreparedClaim(
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            cdi_spec="",
            allocation=digest,
            pending=True,
            devices=tuple(
                PreparedDevice(
                    request=_base_request(result),
                    pool=self.pool,
                    device=share.device.name,
                    cdi_ids=(),
                    share_id=share.share_id,
                    shares=share.shares,
                    memory_mib=share.memory_mib,
                    mig=_intent(share),
                )
                for _, result, share in partitioned
            ),
        )
        self.checkpoint.put(intent)
        adoptable = {(r.gpu, r.profile_id, r.start): r for r in interrupted.mig} if interrupted else {}
        taken = [r for c in self.checkpoint.claims() if c.uid != ref.uid for r in c.mig if r.gi_id is not None]
        made: dict[int, MigRecord] = {}
        # placement -> its instance: two results of this claim on one shared device get one
        seen: dict[tuple[str, int, int], MigInstance] = {}
        out = list(holdings)
        try:
            for i, result, share in partitioned:
                wanted, partition = _intent(share), share.device.partition
                assert partition is not None
                holders = self._holders(ref.uid, wanted) if share.device.shared else []
                made_by_other = next((r for r in holders if r.gi_id is not None), None)
                try:
                    if _placement(wanted) in seen:
                        instance = seen[_placement(wanted)]
                    elif made_by_other is not None:
                        instance = self.mig.reuse(made_by_other)
                    else:  # an intent of another claim there: what it made, if it did, is this device's instance
                        adopt = adoptable.get(_placement(wanted)) or (wanted if holders else None)
                        instance = self.mig.make(partition, adopt, taken)
                except ClaimError as err:
                    raise ClaimError(f"claim {ref}: device {share.device.name}: {err}") from None
                seen[_placement(wanted)] = instance
                made[i] = MigRecord(
                    wanted.gpu, wanted.profile_id, wanted.start, instance.gi_id, instance.ci_id, instance.uuid
                )
                out[i] = (result, instance_share(share, made[i]))
        except BaseException:
            self._undo_instances(ref, made.values())
            raise
        return out, made

    def _undo_instances(self, ref: ClaimRef, made: Iterable[MigRecord]) -> None:
        """A prepare that failed after making instances: destroy those no other claim holds and drop the intent (a
        failure is logged: the start-up sweep finds what is left)."""
        done: set[tuple[str, int, int]] = set()
        for record in made:
            if _placement(record) in done or self._holders(ref.uid, record):
                continue
            done.add(_placement(record))
            try:
                self.mig.destroy(record)
            except ClaimError as err:
                log.warning(
                    "claim %s: a MIG instance made for a prepare that failed could not be destroyed: %s", ref, err
                )
        known = self.checkpoint.get(ref.uid)
        if known is not None and known.pending:
            self.checkpoint.remove(ref.uid)

    def _destroy_instances(self, ref: ClaimRef, known: PreparedClaim) -> PreparedClaim:
        """Destroy the claim's instances that no other claim holds: a shared device's instance stays while another
        record names its placement, or while a damaged record may hold its device (fail closed: it is left to the
        start-up sweep once nothing can hold it). Returns the record without the devices whose instance it
        destroyed; when NVML refuses one after others were destroyed, that record is written before the ClaimError
        (no record names a dead instance)."""
        done: set[tuple[str, int, int]] = set()
        destroyed: set[tuple[str, int, int]] = set()
        fenced: Mapping[str, str] | None = None
        for device in known.devices:
            record = device.mig
            if record is None or _placement(record) in done:
                continue
            done.add(_placement(record))
            holders = self._holders(ref.uid, record)
            if holders:
                log.info(
                    "claim %s: MIG instance %s of device %s kept: %d other claim record(s) hold it",
                    ref,
                    record.uuid or "-",
                    device.device,
                    len(holders),
                )
                continue
            if device.share_id is not None and self.checkpoint.damaged:
                fenced = self._fenced(ref.uid) if fenced is None else fenced
                if device.device in fenced:
                    log.warning(
                        "claim %s: MIG instance %s of device %s kept: the damaged record of claim %s may hold it",
                        ref,
                        record.uuid or "-",
                        device.device,
                        fenced[device.device],
                    )
                    continue
            try:
                self.mig.destroy(record)
            except ClaimError as err:
                if destroyed:
                    left = _without(known, destroyed)
                    self.checkpoint.put(left)
                    self._add(known, -1)
                    self._add(left, 1)
                raise ClaimError(f"claim {ref}: {err}") from None
            destroyed.add(_placement(record))
        return _without(known, destroyed)

    def _keep(self, old: PreparedClaim) -> None:
        """A re-allocation that failed: the old record stays (its instances destroyed for the new allocation left
        out), counted, so that unprepare still removes its CDI spec; with no device left it is released now."""
        if old.devices:
            if self.checkpoint.get(old.uid) != old:
                self.checkpoint.put(old)
            self._add(old, 1)
            return
        self.cdi.remove(old.cdi_spec)
        self.checkpoint.remove(old.uid)

    def _holders(self, uid: str, record: MigRecord) -> list[MigRecord]:
        """The records of other claims (made, or intents) at `record`'s placement: they hold its instance (the
        checkpoint is the count of a shared instance's holders, so it survives a restart)."""
        return [
            r for c in self.checkpoint.claims() if c.uid != uid for r in c.mig if _placement(r) == _placement(record)
        ]

    # --- what the metrics read -------------------------------------------------------------------
    def reread(self) -> None:
        """Read the checkpoint again if a twin changed it (a scrape calls this: a second instance's gauges follow
        the first one's prepares)."""
        with self.lock:
            self._refresh("")

    def ledger(self) -> dict[str, int]:
        """Shares prepared claims hold, per device name (1 for a whole device)."""
        return dict(self._ledger)

    def prepared(self) -> list[PreparedClaim]:
        return list(self.checkpoint.claims())

    # --- inside ----------------------------------------------------------------------------------
    def _holdings(
        self, ref: ClaimRef, allocation: Mapping[str, Any]
    ) -> tuple[list[tuple[Mapping[str, Any], ClaimShare]], list[DeviceConfig]]:
        """This driver's results with the shares each holds, checked against health and the ledger, and this
        driver's configs (parsed: a malformed one refuses the claim)."""
        devices_part = allocation.get("devices") or {}
        results = [
            r
            for r in _list(devices_part.get("results"), "results", ref)
            if isinstance(r, Mapping) and r.get("driver") == self.name
        ]
        if len(results) > MAX_RESULTS_PER_CLAIM:
            raise ClaimError(
                f"claim {ref} has {len(results)} results for {self.name}, more than {MAX_RESULTS_PER_CLAIM}"
            )
        configs = _list(devices_part.get("config"), "config", ref)
        if len(configs) > MAX_CONFIGS_PER_CLAIM:
            raise ClaimError(f"claim {ref} has {len(configs)} device configs, more than {MAX_CONFIGS_PER_CLAIM}")
        ours = _driver_configs(ref, configs, self.name)
        foreign = sorted({str(r.get("pool")) for r in results if r.get("pool") != self.pool})
        if foreign:
            raise ClaimError(
                f"claim {ref} is allocated on pool {brief(foreign, 3)} of {self.name}, "
                f"not on this node's pool {self.pool}"
            )
        view = self.state.snapshot()
        devices = self._devices
        holdings: list[tuple[Mapping[str, Any], ClaimShare]] = []
        wanted: dict[str, int] = {}
        wanted_mib: dict[str, int] = {}
        for result in results:
            name = str(result.get("device") or "")
            device = devices.get(name)
            if device is None:
                raise ClaimError(
                    f"claim {ref}: device {safe_text(name, 63)} is not published by this node "
                    "(did the config change since allocation?)"
                )
            share = claim_share(device, result.get("consumedCapacity"), result.get("shareID"))
            verdict = view.verdict(device.unit, device.resource.pool)  # a shape that waits is refused too (dra.shapes)
            if not verdict.ok:
                why = safe_text(verdict.findings[0].reason, 300)
                raise ClaimError(f"claim {ref}: device {name} is Unhealthy: {why}")
            if not result.get("adminAccess"):
                wanted[name] = wanted.get(name, 0) + share.shares
                wanted_mib[name] = wanted_mib.get(name, 0) + share.memory_mib
            holdings.append((result, share))
        for name, count in wanted.items():
            device, held = devices[name], self._ledger.get(name, 0)
            if not device.shared and (held or count > 1):
                raise ClaimError(f"claim {ref}: device {name} is already prepared for another claim")
            if device.shared and held + count > device.shares:
                raise ClaimError(
                    f"claim {ref}: device {name} has {device.shares} shares; prepared claims hold {held} "
                    f"and this claim needs {count} "
                    "(a claim naming only one of the capacities shares and memory is granted the larger)"
                )
            held_mib, unit_mib = self._ledger_mib.get(name, 0), device.unit.memory_mib
            if (
                device.shared and held_mib + wanted_mib[name] > unit_mib
            ):  # shares prepared before a reload are not these shares
                raise ClaimError(
                    f"claim {ref}: device {name} has {unit_mib} MiB; prepared claims hold {held_mib} MiB and this "
                    f"claim needs {wanted_mib[name]} MiB (shares of its shape before a reload count by the memory "
                    "they were granted)"
                )
        return holdings, ours

    def _ensure_spec(self, known: PreparedClaim, ref: ClaimRef, allocation: Mapping[str, Any]) -> None:
        """A prepared claim whose spec file is gone or damaged (the CDI root is a tmpfs and the node rebooted, or a
        crash cut the file): write it again under the same names, from the same allocation."""
        if not known.cdi_spec or self.cdi.intact(known.cdi_spec):
            return
        devices = self._devices
        devices_part = allocation.get("devices") or {}
        listed = _list(devices_part.get("results"), "results", ref)
        results = [r for r in listed if isinstance(r, Mapping) and r.get("driver") == self.name]
        listed_configs = _list(devices_part.get("config"), "config", ref)[:MAX_CONFIGS_PER_CLAIM]
        configs = _driver_configs(ref, listed_configs, self.name)
        holdings = []
        instances = {d.device: d.mig for d in known.devices if d.mig}  # a dynamic-MIG device: the instance it was given
        for result in results[:MAX_RESULTS_PER_CLAIM]:
            device = devices.get(str(result.get("device") or ""))
            if device is None:
                raise ClaimError(
                    f"claim {ref} is prepared but its CDI spec is gone and device "
                    f"{safe_text(str(result.get('device')), 63)} is no longer published"
                )
            share = claim_share(device, result.get("consumedCapacity"), result.get("shareID"))
            record = instances.get(device.name)
            holdings.append((result, instance_share(share, record) if device.partition and record else share))
        self.cdi.write(ref.uid, _request_grants(ref, holdings, configs)[1])
        log.info("claim %s: CDI spec written again (it was gone)", ref)

    def _fenced(self, uid: str) -> dict[str, str]:
        """Device name -> the damaged claim (other than `uid`) that fences it; a damaged claim the API shows gone is
        released, one whose allocation cannot be told fences every device."""
        fenced: dict[str, str] = {}
        for other in list(self.checkpoint.damaged):
            if other == uid:
                continue
            found = self.find_claim(other)
            if found == GONE:
                self.cdi.remove(str(self.cdi.spec_path(other)))
                self.checkpoint.release(other)
                log.warning(
                    "claim %s (damaged record) is gone from the API: its CDI spec removed, "
                    "its devices no longer fenced",
                    other,
                )
                continue
            if isinstance(found, Mapping):
                results = (_get(found, "status", "allocation", "devices", "results") or ())[:MAX_RESULTS_PER_CLAIM]
                names = {
                    str(r.get("device"))
                    for r in results
                    if isinstance(r, Mapping) and r.get("driver") == self.name and r.get("pool") == self.pool
                }
            else:
                names = set(self._devices)
            for name in names:
                fenced.setdefault(name, other)
        return fenced

    def _refresh(self, uid: str) -> None:
        if self.checkpoint.refresh(uid or None):
            self._rebuild_ledger()

    def _rebuild_ledger(self) -> None:
        self._ledger, self._ledger_mib = {}, {}
        for claim in self.checkpoint.claims():
            self._add(claim, 1)

    def _add(self, claim: PreparedClaim, sign: int) -> None:
        """Count a claim in (1) or out (-1); the ledger is replaced, never changed in place, so `ledger()` (a metrics
        scrape, on another thread) reads a whole one."""
        ledger, ledger_mib = dict(self._ledger), dict(self._ledger_mib)
        for device in claim.devices:
            if device.shares:
                for counts, amount in ((ledger, device.shares), (ledger_mib, device.memory_mib)):
                    left = counts.get(device.device, 0) + sign * amount
                    if left > 0:
                        counts[device.device] = left
                    else:
                        counts.pop(device.device, None)
        self._ledger, self._ledger_mib = ledger, ledger_mib


def _placement(record: MigRecord) -> tuple[str, int, int]:
    return record.gpu, record.profile_id, record.start


def _without(claim: PreparedClaim, destroyed: set[tuple[str, int, int]]) -> PreparedClaim:
    """The record without its devices on the instances at `destroyed` (placements)."""
    kept = tuple(d for d in claim.devices if d.mig is None or _placement(d.mig) not in destroyed)
    return claim if len(kept) == len(claim.devices) else replace(claim, devices=kept)


def _intent(share: ClaimShare) -> MigRecord:
    partition = share.device.partition
    assert partition is not None
    return MigRecord(gpu=partition.gpu.uuid, profile_id=partition.profile.id, start=partition.start)


def allocation_digest(driver: str, allocation: Mapping[str, Any]) -> str:
    """What identifies an allocation for `driver`: a digest of its results (devices, shares, capacity, requests) and,
    when it has any, of its configs for `driver` (an allocation without them digests as records before configs did)."""
    devices = allocation.get("devices")
    results, configs = (devices.get("results"), devices.get("config")) if isinstance(devices, Mapping) else (None, None)
    ours: Any = [r for r in results or () if isinstance(r, Mapping) and r.get("driver") == driver]
    ours = ours[: MAX_RESULTS_PER_CLAIM + 1]
    configured = [
        c
        for c in (configs if isinstance(configs, list) else ())[: MAX_CONFIGS_PER_CLAIM + 1]
        if isinstance(c, Mapping) and _get(c, "opaque", "driver") == driver
    ]
    if configured:
        ours = {"results": ours, "config": configured}
    return hashlib.sha256(json.dumps(ours, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()[
        :32
    ]


def _same_allocation(known: PreparedClaim, digest: str, driver: str, allocation: Mapping[str, Any]) -> bool:
    """The record was prepared from this allocation (records of older versions: the same devices and share IDs)."""
    if known.allocation:
        return known.allocation == digest
    results = (
        (allocation.get("devices") or {}).get("results") if isinstance(allocation.get("devices"), Mapping) else None
    )
    wanted = sorted(
        (_base_request(r), str(r.get("pool")), str(r.get("device")), r.get("shareID") and str(r.get("shareID")))
        for r in results or ()
        if isinstance(r, Mapping) and r.get("driver") == driver
    )
    return wanted == sorted((d.request, d.pool, d.device, d.share_id) for d in known.devices)


def _get(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def _list(value: Any, what: str, ref: ClaimRef) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ClaimError(f"claim {ref}: allocation {what} is not a list")
    return value


def _sharings(
    ref: ClaimRef, holdings: Sequence[tuple[Mapping[str, Any], ClaimShare]], configs: Sequence[DeviceConfig]
) -> tuple[list[list[int]], list[Sharing]]:
    """The holdings' indexes per base request (in order of first appearance) and what each request runs under (the
    SharingConfig that applies to it, resolved); a config's refusal as a ClaimError naming the claim and request."""
    groups: dict[str, list[int]] = {}
    for i, (result, _) in enumerate(holdings):
        groups.setdefault(_base_request(result), []).append(i)
    indexes = list(groups.values())
    sharings = []
    for request, group in zip(groups, indexes, strict=True):
        try:
            sharings.append(
                resolve(
                    config_for(configs, str(holdings[group[0]][0].get("request") or "")),
                    [holdings[i][1] for i in group],
                )
            )
        except ClaimError as err:
            raise ClaimError(f"claim {ref}: request {safe_text(request, 63)}: {err}") from None
    return indexes, sharings


def _request_grants(
    ref: ClaimRef, holdings: Sequence[tuple[Mapping[str, Any], ClaimShare]], configs: Sequence[DeviceConfig]
) -> tuple[list[list[int]], list[ContainerGrant], list[str]]:
    """The holdings' indexes per base request, one grant per request under its sharing (`_sharings`), and the
    strategy each request runs when not its pool's ("" otherwise); the grant's refusal (an `AllocationError`, as the
    device plugin's Allocate gets it) as a ClaimError naming the claim."""
    indexes, sharings = _sharings(ref, holdings, configs)
    try:
        grants = [
            request_grant([holdings[i][1] for i in group], sharing.mode, sharing.limits)
            for group, sharing in zip(indexes, sharings, strict=True)
        ]
    except AllocationError as err:
        raise ClaimError(f"claim {ref}: {err.message}") from None
    return indexes, grants, [s.strategy for s in sharings]


def _driver_configs(ref: ClaimRef, configs: Sequence[Any], driver: str) -> list[DeviceConfig]:
    """The allocation's configs for `driver`, parsed; a malformed one as a ClaimError naming the claim."""
    try:
        return driver_configs(configs, driver)
    except ClaimError as err:
        raise ClaimError(f"claim {ref}: {err}") from None


def _base_request(result: Mapping[str, Any]) -> str:
    """`<req>` of a `firstAvailable` result's `<req>/<sub>`: containers name the top-level request."""
    return str(result.get("request") or "").split("/", 1)[0]


class ClaimSource(Protocol):
    """Where claims come from (`dra.claims.ApiClaims`)."""

    def cached(self, ref: ClaimRef) -> Mapping[str, Any] | None:
        """The claim from memory when the cache is provably current and has it (that UID, allocated); else None."""

    def get(self, ref: ClaimRef, timeout: float) -> Mapping[str, Any]:
        """The claim from the API within `timeout` seconds, retries included; ClaimError naming the claim and the
        cause."""


@dataclass(frozen=True)
class Outcome:
    """One claim's answer: prepared, or why not."""

    claim: PreparedClaim | None
    error: str = ""


def check_ref(ref: ClaimRef) -> None:
    """ClaimError for a claim identity no API object can have."""
    if not valid_uid(ref.uid):
        raise ClaimError(f"claim {ref}: UID {safe_text(ref.uid)} is not a UID (1-128 letters, digits, '.', '_', '-')")
    if not ref.namespace or len(ref.namespace) > 63 or not ref.name or len(ref.name) > MAX_NAME_CHARS:
        raise ClaimError(f"claim {ref}: namespace (1-63 characters) and name (1-{MAX_NAME_CHARS}) are required")


async def prepare_claims(
    driver: Driver,
    source: ClaimSource,
    refs: Sequence[ClaimRef],
    deadline: float | None = None,
    read_timeout: float = 10.0,
    reads: Executor | None = None,
    writes: Executor | None = None,
) -> dict[str, Outcome]:
    """NodePrepareResources for a batch: one outcome per distinct UID, each claim on its own (a claim's read or
    failure never delays or affects another's). A cached, current claim is prepared at once (in `writes`); any other
    is read from the API (in `reads`, bounded) within `read_timeout` and what is left to `deadline`
    (time.monotonic()), and fails with its own message when that runs out, so the call answers before the kubelet
    gives up."""
    unique = list({ref.uid: ref for ref in refs}.values())
    answers = await asyncio.gather(
        *(prepare_one(driver, source, ref, deadline, read_timeout, reads, writes) for ref in unique)
    )
    return {ref.uid: outcome for ref, outcome in zip(unique, answers, strict=True)}


async def prepare_one(
    driver: Driver,
    source: ClaimSource,
    ref: ClaimRef,
    deadline: float | None,
    read_timeout: float,
    reads: Executor | None,
    writes: Executor | None,
) -> Outcome:
    loop = asyncio.get_running_loop()
    try:
        check_ref(ref)
        cached = source.cached(ref) if ref.uid in driver.checkpoint else None  # a first prepare always reads the API
        if cached is not None:
            try:
                return Outcome(await loop.run_in_executor(writes, driver.prepare, ref, cached, False))
            except Unconfirmed:
                pass  # read it from the API below
        budget = read_timeout if deadline is None else min(read_timeout, deadline - time.monotonic())
        if budget <= 0:
            return Outcome(None, f"claim {ref}: not prepared, the call's deadline was near (the kubelet asks again)")
        try:
            claim = await asyncio.wait_for(loop.run_in_executor(reads, source.get, ref, budget), budget + 0.5)
        except TimeoutError:
            return Outcome(
                None,
                f"claim {ref}: not prepared, reading it from the API took over {budget:.1f}s (the kubelet asks again)",
            )
        if deadline is not None and time.monotonic() > deadline:
            return Outcome(None, f"claim {ref}: not prepared, the call's deadline was near (the kubelet asks again)")
        return Outcome(await loop.run_in_executor(writes, driver.prepare, ref, claim, True))
    except ClaimError as err:
        return Outcome(None, str(err))
    except Exception as err:  # a bug or an unexpected client error: this claim fails with a message
        log.exception("preparing claim %s failed", ref)
        return Outcome(None, f"claim {ref}: internal error: {type(err).__name__}: {safe_text(str(err), 300)}")


def unprepare_claims(driver: Driver, refs: Sequence[ClaimRef]) -> dict[str, str]:
    """NodeUnprepareResources for a batch: UID -> error ("" when done)."""
    errors: dict[str, str] = {}
    for ref in {ref.uid: ref for ref in refs}.values():
        try:
            check_ref(ref)
            driver.unprepare(ref)
            errors[ref.uid] = ""
        except ClaimError as err:
            errors[ref.uid] = str(err)
        except Exception as err:
            log.exception("unpreparing claim %s failed", ref)
            errors[ref.uid] = f"claim {ref}: internal error: {type(err).__name__}: {safe_text(str(err), 300)}"
    return errors

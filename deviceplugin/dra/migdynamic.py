"""The MIG instances of dynamic-MIG claims: made at prepare, destroyed at unprepare, swept at start-up.

Through the discovery backend's `MigControl` (real NVML or the simulated node), never a table of its own. Prepare
writes the claim's record as an intent (`PreparedClaim.pending`, each `MigRecord` without IDs) before any instance
is made, and the full record once every instance exists: a crash in between leaves the intent, and the next
prepare of the claim adopts what was made at those placements (or makes what is missing), while unprepare destroys
it. Destroying a gone instance counts as done, so both are idempotent across restarts. Which live instance a record
names is one rule (`names`): NVML reuses GPU-instance IDs, so the ID alone would name another claim's instance.

At start-up an instance on a dynamic-MIG GPU that no record names (a crash before the intent was written, a claim
unprepared while this driver was down, an operator's instance) is destroyed when the GPU runs no process, and
otherwise kept and reported (log, `gpushare_dra_mig_unclaimed_instances`), and the counters published for its GPU
count what it takes as taken (`partitions.gpu_counters`), so no claim is allocated over it. While any record is
damaged nothing is destroyed: its claim's instances cannot be told from the others. After start-up `rescan` re-reads
the instances periodically: one made behind the driver's back is counted and published as taken the same way until it
is gone (never destroyed). A GPU whose instances cannot be listed (sweep or rescan) is unknown, not empty: all of it
is published taken and nothing on it is swept until a list succeeds; processes that cannot be read count as running.

A dynamic-MIG device with shares (`replicas` > 1) is held by several claims at once, all on the instance its first
claim made: a later claim's record names the same instance (`reuse`), and the driver destroys it only when no other
record names its placement (`dra.prepare`), so the count of its holders is the checkpoint's and survives a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from ..discovery.mig import IN_USE, NOT_FOUND, MigControl, MigError
from ..logs import safe_text
from ..loop import BackgroundLoop
from ..model.devices import Unit
from ..model.mig import MigInstance, full_profile
from ..model.node import Gpu, GpuProcess, MigDevice
from .checkpoint import MigRecord, PreparedClaim
from .devices import ClaimError, ClaimShare, DraDevice
from .partitions import Partition

log = logging.getLogger(__name__)

UNLISTED = -1  # Unclaimed.gi_id of a GPU whose MIG instances cannot be listed: all of it is taken


def names(record: MigRecord, gpu: str, found: MigInstance) -> bool:
    """Whether `record` names `found`, an instance on GPU `gpu`: the one identity rule of records and live instances.
    NVML reuses GPU instance IDs, so a made record is its instance by GPU instance ID, profile and placement start,
    and by the MIG UUID recorded at creation when it has one: a GPU instance without a compute instance (no UUID) at
    the same ID may be another claim's, half made, so it is not this record's (left to the start-up sweep); an
    intent (no IDs yet) names whatever stands at its placement."""
    if record.gpu != gpu or (found.profile_id, found.start) != (record.profile_id, record.start):
        return False
    if record.gi_id is None:
        return True
    return found.gi_id == record.gi_id and (not record.uuid or found.uuid == record.uuid)


def _find(instances: Sequence[MigInstance], record: MigRecord) -> MigInstance | None:
    return next((found for found in instances if names(record, record.gpu, found)), None)


@dataclass(frozen=True)
class Unclaimed:
    """An instance no claim record names, kept because its GPU runs processes (or records are damaged); or, with
    `gi_id` `UNLISTED`, a GPU whose instances cannot be listed (its whole profile: all of it taken)."""

    gpu: str
    gi_id: int
    profile_id: int
    start: int
    why: str


class MigInstances:
    """See the module docstring. Not thread-safe: the driver calls it under its serial lock."""

    def __init__(self, control: MigControl | None, processes: Callable[[str], Sequence[GpuProcess] | None]) -> None:
        """`processes`: a GPU's processes, None when they cannot be read (its stray instances are then kept)."""
        self.control = control
        self.processes = processes
        self.unclaimed: tuple[Unclaimed, ...] = ()
        self.made = 0  # instances made by this process
        self.destroyed = 0  # instances destroyed by this process (unprepare and the sweep)

    def _control(self) -> MigControl:
        if self.control is None:
            raise ClaimError("this node's discovery backend cannot make MIG instances")
        return self.control

    def make(self, partition: Partition, adopt: MigRecord | None, taken: Sequence[MigRecord]) -> MigInstance:
        """The instance for `partition`: the one an earlier, interrupted prepare of the same claim made there (`adopt`:
        its intent) if it exists and no other claim's made record (`taken`) names it (`names`), else a new one.
        ClaimError with NVML's reason when it cannot be made (INSUFFICIENT_RESOURCES: the placement is taken)."""
        control, gpu = self._control(), partition.gpu
        where = f"{partition.profile.name} at memory slice {partition.start} of GPU {gpu.index}"
        try:
            if adopt is not None:
                for found in control.mig_instances(gpu.uuid):
                    if (found.profile_id, found.start) == (partition.profile.id, partition.start) and not any(
                        names(r, gpu.uuid, found) for r in taken
                    ):
                        if found.ci_id is None:
                            found = control.create_compute_instance(gpu.uuid, found.gi_id)
                        log.info("MIG instance %s (%s) adopted from an interrupted prepare", where, found.uuid)
                        return found
            gi_id = control.create_gpu_instance(gpu.uuid, partition.profile.id, partition.start)
            try:
                made = control.create_compute_instance(gpu.uuid, gi_id)
            except MigError:
                self._quietly_destroy(gpu.uuid, gi_id)
                raise
        except MigError as err:
            raise ClaimError(
                f"cannot make MIG instance {where}: NVML {err.code_name}: {safe_text(str(err), 300)}"
            ) from None
        if not made.uuid:
            self._quietly_destroy(gpu.uuid, gi_id, made.ci_id)
            raise ClaimError(f"MIG instance {where} was made but NVML shows no MIG device for it; destroyed")
        self.made += 1
        log.info(
            "MIG instance %s made: %s (GPU instance %d, compute instance %s)", where, made.uuid, made.gi_id, made.ci_id
        )
        return made

    def reuse(self, record: MigRecord) -> MigInstance:
        """The instance another claim's record names (`record`, made), for a claim sharing its device; ClaimError when
        it is gone (made again, it would be another instance than the one the other claims' containers see)."""
        control = self._control()
        where = f"MIG instance {record.uuid or '-'} (GPU instance {record.gi_id}) on GPU {record.gpu}"
        try:
            found = _find(control.mig_instances(record.gpu), record)
        except MigError as err:
            raise ClaimError(f"cannot list the MIG instances for {where}: NVML {err.code_name}") from None
        if found is None or found.ci_id is None or (record.uuid and found.uuid != record.uuid):
            raise ClaimError(f"{where}, which other claims on this device hold, is gone or changed")
        return found

    def destroy(self, record: MigRecord) -> None:
        """Destroy the record's instance (an intent's: whatever stands at its placement); gone is done. ClaimError
        when NVML refuses (IN_USE: processes still run on it; the kubelet retries the unprepare)."""
        control = self._control()
        try:
            found = _find(control.mig_instances(record.gpu), record)
            if found is None:
                return
            gi_id, ci_id = found.gi_id, found.ci_id
            if ci_id is not None:
                self._destroy_call(lambda: control.destroy_compute_instance(record.gpu, gi_id, ci_id))
            self._destroy_call(lambda: control.destroy_gpu_instance(record.gpu, gi_id))
        except MigError as err:
            hint = " (processes still run on it; the kubelet retries)" if err.code == IN_USE else ""
            what = f"MIG instance {record.uuid or record.start} on GPU {record.gpu}"
            raise ClaimError(f"cannot destroy {what}: NVML {err.code_name}{hint}: {safe_text(str(err), 300)}") from None
        self.destroyed += 1
        log.info("MIG instance %s (GPU %s, GPU instance %d) destroyed", found.uuid or "-", record.gpu, found.gi_id)

    def sweep(self, gpus: Iterable[Gpu], claims: Iterable[PreparedClaim], damaged: bool) -> None:
        """At start-up: destroy the instances on these GPUs (those of dynamic-MIG pools with MIG on) that no record
        names, where the GPU runs no process; keep and report the others (`unclaimed`)."""
        if self.control is None:
            return
        records = [r for c in claims for r in c.mig]
        kept: list[Unclaimed] = []
        for gpu in gpus:
            try:
                instances = self.control.mig_instances(gpu.uuid)
            except MigError as err:
                kept.append(self._unlisted(gpu, err))
                continue
            stray = [i for i in instances if not any(names(r, gpu.uuid, i) for r in records)]
            if not stray:
                continue
            busy = "a checkpoint record is damaged" if damaged else self._busy(gpu)
            for instance in stray:
                if busy:
                    kept.append(Unclaimed(gpu.uuid, instance.gi_id, instance.profile_id, instance.start, busy))
                    log.warning(
                        "GPU %d (%s): MIG instance %s (GPU instance %d) belongs to no claim; kept because %s",
                        gpu.index,
                        gpu.uuid,
                        instance.uuid or "-",
                        instance.gi_id,
                        busy,
                    )
                    continue
                try:
                    self.destroy(
                        MigRecord(
                            gpu.uuid, instance.profile_id, instance.start, instance.gi_id, instance.ci_id, instance.uuid
                        )
                    )
                except ClaimError as err:
                    kept.append(Unclaimed(gpu.uuid, instance.gi_id, instance.profile_id, instance.start, str(err)))
                    log.warning("GPU %d: MIG instance of no claim kept: %s", gpu.index, err)
        self.unclaimed = tuple(kept)

    def rescan(self, gpus: Iterable[Gpu], claims: Iterable[PreparedClaim]) -> bool:
        """After start-up, periodically: the instances on these GPUs that no record names (made behind the driver's
        back, e.g. by `nvidia-smi mig -cgi`) become `unclaimed`, published as taken until they are gone; nothing is
        destroyed. One list call per GPU; a GPU whose list fails is unknown, all of it taken (`UNLISTED`), until a
        list succeeds. True when `unclaimed` changed (the slices must be published again)."""
        if self.control is None:
            return False
        records = [r for c in claims for r in c.mig]
        before = {(u.gpu, u.gi_id, u.profile_id, u.start): u for u in self.unclaimed}
        found: list[Unclaimed] = []
        for gpu in gpus:
            try:
                instances = self.control.mig_instances(gpu.uuid)
            except MigError as err:
                found.append(self._unlisted(gpu, err))
                continue
            if gpu.uuid in self.unlisted():
                log.info("GPU %d (%s): its MIG instances are listed again", gpu.index, gpu.uuid)
            for i in instances:
                if any(names(r, gpu.uuid, i) for r in records):
                    continue
                known = before.get((gpu.uuid, i.gi_id, i.profile_id, i.start))
                if known is None:
                    log.warning(
                        "GPU %d (%s): MIG instance %s (GPU instance %d) was made outside the driver; its "
                        "placements are withdrawn until it is gone",
                        gpu.index,
                        gpu.uuid,
                        i.uuid or "-",
                        i.gi_id,
                    )
                found.append(known or Unclaimed(gpu.uuid, i.gi_id, i.profile_id, i.start, "made outside the driver"))
        changed = {(u.gpu, u.gi_id, u.profile_id, u.start) for u in found} != {
            (u.gpu, u.gi_id, u.profile_id, u.start) for u in self.unclaimed
        }
        self.unclaimed = tuple(found)
        return changed

    def kept(self) -> dict[str, list[tuple[int, int]]]:
        """GPU UUID -> (profile ID, start) of the instances the sweep kept: the slice publisher publishes them taken
        (an `UNLISTED` GPU as its whole profile)."""
        found: dict[str, list[tuple[int, int]]] = {}
        for u in self.unclaimed:
            found.setdefault(u.gpu, []).append((u.profile_id, u.start))
        return found

    def _unlisted(self, gpu: Gpu, err: MigError) -> Unclaimed:
        """A GPU whose instances cannot be listed: unknown, so all of it is published taken; logged when it starts."""
        if not any(u.gpu == gpu.uuid and u.gi_id == UNLISTED for u in self.unclaimed):
            log.warning(
                "GPU %d (%s): its MIG instances cannot be listed (%s); all its placements are published taken, "
                "nothing on it is swept, until a list succeeds",
                gpu.index,
                gpu.uuid,
                err,
            )
        whole = full_profile(gpu.mig_profiles)  # what it takes is the whole GPU
        profile_id, start = (whole.id, min(whole.placements, default=0)) if whole else (UNLISTED, 0)
        return Unclaimed(gpu.uuid, UNLISTED, profile_id, start, f"its MIG instances cannot be listed: {err.code_name}")

    def unlisted(self) -> list[str]:
        """The GPUs whose instances could not be listed at the last read (all of each published taken)."""
        return [u.gpu for u in self.unclaimed if u.gi_id == UNLISTED]

    def _busy(self, gpu: Gpu) -> str:
        """Why the GPU's stray instances are kept: it runs processes, or they cannot be read (unknown is busy)."""
        running = self.processes(gpu.uuid)
        if running is None:
            return "the GPU's processes cannot be read"
        return "the GPU runs processes" if running else ""

    @staticmethod
    def _destroy_call(call: Callable[[], None]) -> None:
        try:
            call()
        except MigError as err:
            if err.code != NOT_FOUND:
                raise

    def _quietly_destroy(self, gpu: str, gi_id: int, ci_id: int | None = None) -> None:
        """Undo a half-made instance; a failure is logged (the start-up sweep finds what is left)."""
        control = self._control()
        try:
            if ci_id is not None:
                self._destroy_call(lambda: control.destroy_compute_instance(gpu, gi_id, ci_id))
            self._destroy_call(lambda: control.destroy_gpu_instance(gpu, gi_id))
        except MigError as err:
            log.warning("GPU %s: half-made MIG instance %d could not be destroyed: %s", gpu, gi_id, err)


def instance_device(device: DraDevice, record: MigRecord) -> DraDevice:
    """A dynamic-MIG device once its instance exists: the MIG instance as its unit, so the container's grant (CDI
    device, NVIDIA_VISIBLE_DEVICES) names its MIG UUID as for a static MIG instance, and the node agent meters the
    processes NVML finds in it."""
    partition = device.partition
    assert partition is not None
    profile = partition.profile
    gi, ci = record.gi_id or 0, record.ci_id or 0
    mig = MigDevice(uuid=record.uuid, profile=profile.name, memory_mib=profile.memory_mib, gi_id=gi, ci_id=ci, index=gi)
    unit = Unit(uuid=record.uuid, gpu=partition.gpu, memory_mib=profile.memory_mib, mig=mig, replicas=device.shares)
    return replace(device, unit=unit)


def instance_share(share: ClaimShare, record: MigRecord) -> ClaimShare:
    """The holding of a dynamic-MIG device once its instance exists (`instance_device`)."""
    return replace(share, device=instance_device(share.device, record))


class MigRescan(BackgroundLoop):
    """Every `interval` seconds, `rescan` (the driver's `rescan_mig`); on a change, `changed` (republish the slices)."""

    def __init__(self, rescan: Callable[[], bool], changed: Callable[[], None], interval: float) -> None:
        super().__init__("dra-mig-rescan")
        self.rescan, self.changed, self.interval = rescan, changed, max(1.0, interval)

    def start(self) -> None:
        self._start_thread()

    def _run(self) -> None:
        self._repeat(self._round, self.interval)

    def _round(self) -> float:
        if self.rescan():
            self.changed()
        return self.interval

"""The MIG instances of dynamic-MIG claims: made at prepare, destroyed at unprepare, swept at start-up.

Through the discovery backend's `MigControl` (real NVML or the simulated node), never a table of its own. Prepare
writes the claim's record as an intent (`PreparedClaim.pending`, each `MigRecord` without IDs) before any instance
is made, and the full record once every instance exists: a crash in between leaves the intent, and the next
prepare of the claim adopts what was made at those placements (or makes what is missing), while unprepare destroys
it. Destroying a gone instance counts as done, so both are idempotent across restarts.

At start-up an instance on a dynamic-MIG GPU that no record names (a crash before the intent was written, a claim
unprepared while this driver was down, an operator's instance) is destroyed when the GPU runs no process, and
otherwise kept and reported (log, `gpushare_dra_mig_unclaimed_instances`), and the counters published for its GPU
count what it takes as taken (`partitions.gpu_counters`), so no claim is allocated over it. While any record is
damaged nothing is destroyed: its claim's instances cannot be told from the others. After start-up `rescan` re-reads
the instances periodically: one made behind the driver's back is counted and published as taken the same way until it
is gone (never destroyed).

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
from ..model.mig import MigInstance
from ..model.node import Gpu, GpuProcess, MigDevice
from .checkpoint import MigRecord, PreparedClaim
from .devices import ClaimError, ClaimShare, DraDevice
from .partitions import Partition

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unclaimed:
    """An instance no claim record names, kept because its GPU runs processes (or records are damaged)."""

    gpu: str
    gi_id: int
    profile_id: int
    start: int
    why: str


class MigInstances:
    """See the module docstring. Not thread-safe: the driver calls it under its serial lock."""

    def __init__(self, control: MigControl | None, processes: Callable[[str], Sequence[GpuProcess]]) -> None:
        self.control = control
        self.processes = processes
        self.unclaimed: tuple[Unclaimed, ...] = ()
        self.made = 0  # instances made by this process
        self.destroyed = 0  # instances destroyed by this process (unprepare and the sweep)

    def _control(self) -> MigControl:
        if self.control is None:
            raise ClaimError("this node's discovery backend cannot make MIG instances")
        return self.control

    def make(self, partition: Partition, adopt: MigRecord | None, taken: set[tuple[str, int]]) -> MigInstance:
        """The instance for `partition`: the one an earlier, interrupted prepare of the same claim made there (`adopt`:
        its intent) if it exists and no other record (`taken`: (GPU, GI ID)) names it, else a new one. ClaimError
        with NVML's reason when it cannot be made (INSUFFICIENT_RESOURCES: the placement is taken)."""
        control, gpu = self._control(), partition.gpu
        where = f"{partition.profile.name} at memory slice {partition.start} of GPU {gpu.index}"
        try:
            if adopt is not None:
                for found in control.mig_instances(gpu.uuid):
                    if (found.profile_id, found.start) == (partition.profile.id, partition.start) and (
                        gpu.uuid,
                        found.gi_id,
                    ) not in taken:
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
            found = self._find(control.mig_instances(record.gpu), record)
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
            found = self._find(control.mig_instances(record.gpu), record)
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
        named = {(r.gpu, r.gi_id) for r in records if r.gi_id is not None}
        intents = {(r.gpu, r.profile_id, r.start) for r in records if r.gi_id is None}
        kept: list[Unclaimed] = []
        for gpu in gpus:
            try:
                instances = self.control.mig_instances(gpu.uuid)
            except MigError as err:
                log.warning("GPU %d (%s): its MIG instances cannot be listed, none swept: %s", gpu.index, gpu.uuid, err)
                continue
            stray = [
                i
                for i in instances
                if (gpu.uuid, i.gi_id) not in named and (gpu.uuid, i.profile_id, i.start) not in intents
            ]
            if not stray:
                continue
            busy = (
                "a checkpoint record is damaged"
                if damaged
                else ("the GPU runs processes" if self.processes(gpu.uuid) else "")
            )
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
        destroyed. One list call per GPU; a GPU whose list fails keeps what was known. True when `unclaimed`
        changed (the slices must be published again)."""
        if self.control is None:
            return False
        records = [r for c in claims for r in c.mig]
        named = {(r.gpu, r.gi_id) for r in records if r.gi_id is not None}
        intents = {(r.gpu, r.profile_id, r.start) for r in records if r.gi_id is None}
        before = {(u.gpu, u.gi_id): u for u in self.unclaimed}
        found: list[Unclaimed] = []
        for gpu in gpus:
            try:
                instances = self.control.mig_instances(gpu.uuid)
            except MigError as err:
                log.warning("GPU %d (%s): its MIG instances cannot be listed: %s", gpu.index, gpu.uuid, err)
                found += [u for u in self.unclaimed if u.gpu == gpu.uuid]
                continue
            for i in instances:
                if (gpu.uuid, i.gi_id) in named or (gpu.uuid, i.profile_id, i.start) in intents:
                    continue
                known = before.get((gpu.uuid, i.gi_id))
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
        """GPU UUID -> (profile ID, start) of the instances the sweep kept: the slice publisher publishes them taken."""
        found: dict[str, list[tuple[int, int]]] = {}
        for u in self.unclaimed:
            found.setdefault(u.gpu, []).append((u.profile_id, u.start))
        return found

    @staticmethod
    def _find(instances: Sequence[MigInstance], record: MigRecord) -> MigInstance | None:
        for found in instances:
            if record.gi_id is not None and found.gi_id == record.gi_id:
                return found
            if record.gi_id is None and (found.profile_id, found.start) == (record.profile_id, record.start):
                return found
        return None

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

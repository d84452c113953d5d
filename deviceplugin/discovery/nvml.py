"""Real GPUs through NVML (nvidia-ml-py's `pynvml`): the same inventory interface as the simulated node.

docs/nvml.md lists the pynvml behaviours handled here (MIG index gaps, NotSupported on GPUs without MIG,
lost GPUs, PCI bus-id formats, event sets that fail at once after a GPU is lost) and what is done for each.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from ..model.mig import MigInstance, MigProfile
from ..model.node import MIB, Gpu, GpuProcess, GpuStats, HealthEvent, Link, MigDevice, NodeInfo
from .inventory import InventoryError
from .mig import INVALID_ARGUMENT, MAX_COMPUTE_INSTANCES, MAX_GPU_INSTANCES, MAX_PLACEMENTS, NOT_SUPPORTED, MigError

log = logging.getLogger(__name__)

NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of an event or process on the whole GPU
_MIG_PROFILE = re.compile(r"MIG (\d+g\.\d+gb(?:\+\w+)*)")
NO_DRIVER_HINT = (
    "is the NVIDIA driver installed and the container started with the NVIDIA runtime? "
    "Without a GPU, run on a simulated node: gpu-share demo --node examples/nodes/2xT4.yaml"
)


def normalize_bus_id(bus_id: str) -> str:
    """NVML's `00000000:3B:00.0` -> sysfs' `0000:3b:00.0`."""
    domain, _, rest = bus_id.strip().rpartition(":")
    domain, _, bus = domain.rpartition(":") if domain.count(":") else ("", "", domain)
    if not domain:
        return bus_id.strip().lower()
    return f"{int(domain, 16):04x}:{bus}:{rest}".lower()


_NODE_WORDS = 4  # 64-bit words of NUMA node mask: 256 nodes
_MAX_CPU_WORDS = 64  # 4096 CPUs
# At most this often, the event wait asks lost GPUs whether they answer again and, after a failed wait, which GPU
# was lost: the monitor waits in short slices (so a stop is quick), and a query of a fallen GPU can be slow.
RECHECK_INTERVAL = 1.0


def _cpu_words() -> int:
    return min(_MAX_CPU_WORDS, max(1, -(-(os.cpu_count() or 64) // 64)))


def _bits(words: Any) -> list[int]:
    """Set bit positions of NVML's affinity mask (a ctypes array of 64-bit words)."""
    return [i * 64 + b for i, word in enumerate(words) for b in range(64) if int(word) >> b & 1]


def _cpu_list(text: str) -> list[int]:
    """`0-3,8-11` -> [0, 1, 2, 3, 8, 9, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def _mig_error(call: str, err: Exception, gpu: str) -> MigError:
    """An NVML error of a MIG call, naming the call and the GPU, with NVML's return code."""
    return MigError(f"NVML {call} failed on GPU {gpu}: {err}", int(getattr(err, "value", 0) or 0))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlInventory:
    """Inventory over NVML. NVML is initialised here once and shut down by close()."""

    def __init__(self, sysfs_root: str | Path = "/sys", recheck_interval: float = RECHECK_INTERVAL) -> None:
        try:
            import pynvml
        except ImportError as err:  # nvidia-ml-py is a dependency; this is a broken install
            raise InventoryError(f"NVML could not be loaded: cannot import pynvml ({err}); {NO_DRIVER_HINT}") from None
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise InventoryError(f"NVML could not be loaded: nvmlInit failed: {err}; {NO_DRIVER_HINT}") from None
        self.sysfs_root = Path(sysfs_root)
        self._open = True
        self._event_set: Any = None
        self._unwatched: frozenset[str] = frozenset()  # lost GPUs left out of the event set
        self._event_failures = 0
        self.recheck_interval = recheck_interval
        self._next_recheck: dict[str, float] = {}  # check -> the monotonic time it may run again (`_due`)
        self._node: NodeInfo | None = None
        self._made: dict[
            tuple[str, int, int], str
        ] = {}  # (GPU, GI, CI) -> MIG UUID of instances made or listed since discovery

    # --- calls -----------------------------------------------------------------------------
    def _call(self, name: str, *args: Any, gpu: str = "") -> Any:
        """Call pynvml.<name>; an NVML error becomes InventoryError naming the call and the GPU."""
        try:
            return getattr(self.nvml, name)(*args)
        except self.nvml.NVMLError as err:
            where = f" on GPU {gpu}" if gpu else ""
            raise InventoryError(f"NVML {name} failed{where}: {err}") from err

    def _optional(self, name: str, *args: Any, gpu: str = "", default: Any = None) -> Any:
        """Like _call, but NOT_SUPPORTED means `default`."""
        try:
            return getattr(self.nvml, name)(*args)
        except self.nvml.NVMLError_NotSupported:
            return default
        except self.nvml.NVMLError as err:
            raise InventoryError(f"NVML {name} failed on GPU {gpu}: {err}") from err

    # --- discovery -------------------------------------------------------------------------
    def discover(self) -> NodeInfo:
        gpus, handles, skipped = [], {}, []
        for index in range(self._call("nvmlDeviceGetCount")):
            # One GPU that cannot be described (lost: no handle; or any query failing) is left out, never the node.
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                gpu = self._gpu(index, handle)
            except self.nvml.NVMLError as err:
                why = f"nvmlDeviceGetHandleByIndex: {err}"
            except InventoryError as err:
                why = str(err)
            else:
                gpus.append(gpu)
                handles[gpu.uuid] = handle
                continue
            log.error("GPU %d is not usable and is not advertised (the other GPUs are): %s", index, why)
            skipped.append((index, why))
        cuda = self._optional("nvmlSystemGetCudaDriverVersion_v2", default=0) or 0
        self._node = NodeInfo(
            gpus=tuple(gpus),
            driver_version=_text(self._call("nvmlSystemGetDriverVersion")),
            cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "",
            links=self._links(gpus, handles),
            name="nvml",
            skipped=tuple(skipped),
        )
        return self._node

    def _gpu(self, index: int, handle: Any) -> Gpu:
        label = f"{index}"
        uuid = _text(self._call("nvmlDeviceGetUUID", handle, gpu=label))
        label = f"{index} ({uuid})"
        capability = self._optional("nvmlDeviceGetCudaComputeCapability", handle, gpu=label)
        bus_id = normalize_bus_id(_text(self._call("nvmlDeviceGetPciInfo", handle, gpu=label).busId))
        mode = self._optional("nvmlDeviceGetMigMode", handle, gpu=label)
        mig_enabled = bool(mode) and mode[0] == self.nvml.NVML_DEVICE_MIG_ENABLE
        return Gpu(
            index=index,
            uuid=uuid,
            model=_text(self._call("nvmlDeviceGetName", handle, gpu=label)),
            memory_mib=self._call("nvmlDeviceGetMemoryInfo", handle, gpu=label).total // MIB,
            numa_node=self._numa_node(bus_id, handle, label),
            pci_bus_id=bus_id,
            compute_capability=f"{capability[0]}.{capability[1]}" if capability else "",
            minor_number=self._optional("nvmlDeviceGetMinorNumber", handle, gpu=label),
            mig_enabled=mig_enabled,
            mig_devices=self._mig_devices(handle, label) if mig_enabled else (),
            mig_capable=mode is not None,  # NOT_SUPPORTED: no MIG on this GPU
            mig_profiles=self._discovered_profiles(uuid) if mig_enabled else (),
        )

    def _discovered_profiles(self, uuid: str) -> tuple[MigProfile, ...]:
        """The MIG profiles, or none when they cannot be read (the GPU then offers no dynamic MIG, said in the log)."""
        try:
            return self.mig_profiles(uuid)
        except MigError as err:
            log.warning("GPU %s: MIG profiles cannot be read, no dynamic MIG on it: %s", uuid, err)
            return ()

    def _numa_node(self, bus_id: str, handle: Any, label: str) -> int | None:
        """sysfs' numa_node (-1: the platform says none); without that entry, NVML's memory, then CPU, affinity."""
        try:
            node = int((self.sysfs_root / "bus" / "pci" / "devices" / bus_id / "numa_node").read_text())
        except (OSError, ValueError):
            return self._nvml_numa_node(handle, label)
        return node if node >= 0 else None

    def _nvml_numa_node(self, handle: Any, label: str) -> int | None:
        scope = self.nvml.NVML_AFFINITY_SCOPE_NODE
        try:
            nodes = _bits(self.nvml.nvmlDeviceGetMemoryAffinity(handle, _NODE_WORDS, scope))
        except self.nvml.NVMLError as err:
            log.debug("GPU %s: nvmlDeviceGetMemoryAffinity: %s", label, err)
            nodes = []
        if nodes:
            return nodes[0]
        try:
            cpus = _bits(self.nvml.nvmlDeviceGetCpuAffinityWithinScope(handle, _cpu_words(), scope))
        except self.nvml.NVMLError as err:
            log.debug("GPU %s: nvmlDeviceGetCpuAffinityWithinScope: %s", label, err)
            return None
        cpu_nodes = self._cpu_nodes()
        found = sorted({cpu_nodes[c] for c in cpus if c in cpu_nodes})
        if not found:
            log.info("GPU %s: no NUMA node in sysfs or NVML: no topology hint for the kubelet", label)
        return found[0] if found else None

    def _cpu_nodes(self) -> dict[int, int]:
        """CPU -> NUMA node from /sys/devices/system/node/node*/cpulist."""
        mapping: dict[int, int] = {}
        for path in (self.sysfs_root / "devices" / "system" / "node").glob("node[0-9]*"):
            try:
                cpus = _cpu_list(path.joinpath("cpulist").read_text())
            except (OSError, ValueError):
                continue
            mapping.update((cpu, int(path.name[4:])) for cpu in cpus)
        return mapping

    def _mig_devices(self, handle: Any, label: str) -> tuple[MigDevice, ...]:
        devices = []
        for index in range(self._call("nvmlDeviceGetMaxMigDeviceCount", handle, gpu=label)):
            try:
                mig = self.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except self.nvml.NVMLError_NotFound:
                continue  # indices can have gaps
            except self.nvml.NVMLError as err:
                raise InventoryError(
                    f"NVML nvmlDeviceGetMigDeviceHandleByIndex({index}) failed on GPU {label}: {err}"
                ) from err
            name = _text(self._call("nvmlDeviceGetName", mig, gpu=label))
            match = _MIG_PROFILE.search(name)
            if not match:
                log.warning("MIG device %d on GPU %s has no profile in its name %r; skipped", index, label, name)
                continue
            devices.append(
                MigDevice(
                    uuid=_text(self._call("nvmlDeviceGetUUID", mig, gpu=label)),
                    profile=match.group(1),
                    memory_mib=self._call("nvmlDeviceGetMemoryInfo", mig, gpu=label).total // MIB,
                    gi_id=self._call("nvmlDeviceGetGpuInstanceId", mig, gpu=label),
                    ci_id=self._call("nvmlDeviceGetComputeInstanceId", mig, gpu=label),
                    index=index,
                )
            )
        return tuple(devices)

    def _links(self, gpus: list[Gpu], handles: dict[str, Any]) -> dict[tuple[str, str], Link]:
        by_bus = {g.pci_bus_id: g.uuid for g in gpus}
        direct: dict[tuple[str, str], int] = {}  # (from, to) -> active links seen from `from`
        to_switch: dict[str, int] = {}  # NVLinks that end at an NVSwitch (or anything but a GPU here)
        for gpu in gpus:
            for peer in self._nvlink_peers(handles[gpu.uuid], gpu):
                if peer in by_bus and by_bus[peer] != gpu.uuid:
                    key = (gpu.uuid, by_bus[peer])
                    direct[key] = direct.get(key, 0) + 1
                else:
                    to_switch[gpu.uuid] = to_switch.get(gpu.uuid, 0) + 1
        levels = {
            self.nvml.NVML_TOPOLOGY_INTERNAL: "board",
            self.nvml.NVML_TOPOLOGY_SINGLE: "switch",
            self.nvml.NVML_TOPOLOGY_MULTIPLE: "multi-switch",
            self.nvml.NVML_TOPOLOGY_HOSTBRIDGE: "host-bridge",
            self.nvml.NVML_TOPOLOGY_NODE: "numa-node",
            self.nvml.NVML_TOPOLOGY_SYSTEM: "system",
        }
        links = {}
        for i, a in enumerate(gpus):
            for b in gpus[i + 1 :]:
                try:
                    level = self._optional(
                        "nvmlDeviceGetTopologyCommonAncestor",
                        handles[a.uuid],
                        handles[b.uuid],
                        gpu=f"{a.index}/{b.index}",
                    )
                except InventoryError as err:  # a link that cannot be read is unknown, never a failed node
                    log.warning("%s; the link is unknown", err)
                    level = None
                nvlinks = max(direct.get((a.uuid, b.uuid), 0), direct.get((b.uuid, a.uuid), 0))
                if not nvlinks and a.uuid in to_switch and b.uuid in to_switch:
                    nvlinks = min(to_switch[a.uuid], to_switch[b.uuid])
                links[(a.uuid, b.uuid)] = Link(nvlinks=nvlinks, pcie=levels.get(level, ""))
        return links

    def _nvlink_peers(self, handle: Any, gpu: Gpu) -> list[str]:
        """PCI bus ids at the far end of each active NVLink (A100 has 12 links, H100 18: stop at the first
        unsupported)."""
        peers: list[str] = []
        if gpu.mig_enabled:
            return peers  # NVLink queries are not supported with MIG enabled
        for link in range(self.nvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = self.nvml.nvmlDeviceGetNvLinkState(handle, link)
            except (self.nvml.NVMLError_NotSupported, self.nvml.NVMLError_InvalidArgument):
                break
            except self.nvml.NVMLError as err:
                log.warning("NVML nvmlDeviceGetNvLinkState(%d) failed on GPU %d: %s", link, gpu.index, err)
                break
            if state == self.nvml.NVML_FEATURE_ENABLED:
                try:
                    remote = self._call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link, gpu=str(gpu.index))
                except InventoryError as err:
                    log.warning("%s; the NVLinks of GPU %d are unknown", err, gpu.index)
                    return []
                peers.append(normalize_bus_id(_text(remote.busId)))
        return peers

    # --- health ----------------------------------------------------------------------------
    def _due(self, check: str) -> bool:
        """True at most once a recheck interval for each `check` ("back": do lost GPUs answer again; "lost": which
        GPU made a wait fail): each has its own allowance, so one never starves the other."""
        now = time.monotonic()
        if now < self._next_recheck.get(check, 0.0):
            return False
        self._next_recheck[check] = now + self.recheck_interval
        return True

    def _register_events(self, skip: frozenset[str] = frozenset()) -> None:
        """A new event set on every GPU but `skip` (lost ones: with one in the set, every wait fails at once)."""
        wanted = self.nvml.nvmlEventTypeXidCriticalError | self.nvml.nvmlEventTypeDoubleBitEccError
        if self._event_set is not None:
            self._free_events()
        self._event_set = self._call("nvmlEventSetCreate")
        self._unwatched = skip
        for gpu in (self._node or self.discover()).gpus:
            if gpu.uuid in skip:
                continue
            try:
                handle = self.nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                supported = self.nvml.nvmlDeviceGetSupportedEventTypes(handle)
                # One unsupported bit rejects the whole registration: ask only for what the GPU has.
                self.nvml.nvmlDeviceRegisterEvents(handle, wanted & supported, self._event_set)
            except self.nvml.NVMLError as err:
                log.warning("GPU %d (%s): no health events (%s); relying on query checks", gpu.index, gpu.uuid, err)

    def wait_for_event(self, timeout: float) -> HealthEvent | None:
        if self._event_set is None:
            self._register_events()
        elif self._unwatched and self._due("back"):
            back = frozenset(u for u in self._unwatched if self.check(u) is None)
            if back:  # a lost GPU that answers again is watched again: its XIDs are never missed
                log.warning("GPU(s) %s answer NVML again: watching their health events again", ", ".join(sorted(back)))
                self._register_events(skip=self._unwatched - back)
        deadline = time.monotonic() + timeout
        while True:
            try:
                data = self.nvml.nvmlEventSetWait_v2(self._event_set, int(max(0.0, deadline - time.monotonic()) * 1000))
                break
            except self.nvml.NVMLError_Timeout:
                self._event_failures = 0
                return None
            except self.nvml.NVMLError as err:
                # After a GPU is lost every wait on a set holding it fails at once: watch the other GPUs without it,
                # so their events are not delayed; with nothing to leave out, wait out the interval, never spin.
                gpus = self._node.gpus if self._node and self._due("lost") else ()
                lost = self._unwatched | {g.uuid for g in gpus if g.uuid not in self._unwatched and self.check(g.uuid)}
                if lost - self._unwatched:
                    log.error(
                        "NVML nvmlEventSetWait_v2 failed (%s): watching events without lost GPU(s) %s",
                        err,
                        ", ".join(sorted(lost)),
                    )
                    self._register_events(skip=lost)
                    continue
                self._event_failures += 1
                if self._event_failures == 1:
                    log.error("NVML nvmlEventSetWait_v2 failed: %s; query checks find the GPU", err)
                time.sleep(max(0.0, deadline - time.monotonic()))
                return None
        self._event_failures = 0
        try:
            uuid = _text(self.nvml.nvmlDeviceGetUUID(data.device))
        except self.nvml.NVMLError as err:
            log.error("health event on a GPU whose UUID cannot be read: %s", err)
            return None
        if data.eventType == self.nvml.nvmlEventTypeXidCriticalError:
            xid, reason = int(data.eventData), f"XID {int(data.eventData)}"
        else:
            xid, reason = None, "double-bit ECC error"
        mig = self._mig_of(uuid, data.gpuInstanceId, data.computeInstanceId)
        return HealthEvent(
            gpu_uuid=uuid, reason=reason, xid=xid, mig_uuid=mig, reset_required=xid is None
        )  # DBE: reset-class

    def _mig_of(self, gpu_uuid: str, gi: int, ci: int) -> str | None:
        if gi == NO_INSTANCE or self._node is None:
            return None
        for gpu in self._node.gpus:
            if gpu.uuid == gpu_uuid:
                for mig in gpu.mig_devices:
                    if mig.gi_id == gi and (ci == NO_INSTANCE or mig.ci_id == ci):
                        return mig.uuid
        for (gpu_of, gi_of, ci_of), uuid in self._made.items():  # an instance made after discovery (dynamic MIG)
            if (gpu_of, gi_of) == (gpu_uuid, gi) and ci in (NO_INSTANCE, ci_of):
                return uuid
        return None  # cannot be attributed: the whole GPU

    def _remember(self, gpu_uuid: str, instances: list[MigInstance], replace_all: bool = False) -> None:
        """Keep the MIG UUIDs of instances seen, so their processes are attributed to them (replaced whole: a reader
        on another thread sees an old map or a new one)."""
        made = {k: v for k, v in self._made.items() if not (replace_all and k[0] == gpu_uuid)}
        made.update({(gpu_uuid, i.gi_id, i.ci_id): i.uuid for i in instances if i.ci_id is not None and i.uuid})
        self._made = made

    def check(self, gpu_uuid: str) -> str | None:
        try:
            handle = self.nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
            self.nvml.nvmlDeviceGetMemoryInfo(handle)
        except self.nvml.NVMLError as err:
            return f"NVML query on GPU {gpu_uuid} failed: {err}"
        return None

    def reset_required(self, gpu_uuid: str) -> bool | None:
        """NVML's GPU recovery action (drivers R550+): anything but NONE means the GPU needs a reset or more."""
        field = getattr(self.nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            return None
        try:
            handle = self.nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
            (value,) = self.nvml.nvmlDeviceGetFieldValues(handle, [field])
        except self.nvml.NVMLError:
            return None
        if value.nvmlReturn != self.nvml.NVML_SUCCESS:
            return None
        return value.value.uiVal != self.nvml.NVML_GPU_RECOVERY_ACTION_NONE

    def _reading(self, name: str, *args: Any) -> Any:
        """A live reading; None when unsupported or failing (a failing GPU is the health monitor's business)."""
        try:
            return getattr(self.nvml, name)(*args)
        except self.nvml.NVMLError:
            return None

    def stats(self, gpu_uuid: str) -> GpuStats:
        try:
            handle = self.nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        except self.nvml.NVMLError:
            return GpuStats()
        memory = self._reading("nvmlDeviceGetMemoryInfo", handle)
        rates = self._reading("nvmlDeviceGetUtilizationRates", handle)
        temperature = self._reading("nvmlDeviceGetTemperature", handle, self.nvml.NVML_TEMPERATURE_GPU)
        power = self._reading("nvmlDeviceGetPowerUsage", handle)
        return GpuStats(
            memory_used_mib=memory.used // MIB if memory else None,
            utilization_percent=float(rates.gpu) if rates else None,
            temperature_celsius=float(temperature) if temperature is not None else None,
            power_watts=power / 1000 if power is not None else None,
        )

    def processes(self, gpu_uuid: str) -> list[GpuProcess] | None:
        """Compute and MPS-client processes; None when the GPU's handle or its compute processes cannot be had
        (unknown, not none; the MPS-client list is extra: many drivers lack it). MIG processes are attributed by
        their GPU/compute instance ids."""
        try:
            handle = self.nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        except self.nvml.NVMLError:
            return None
        found: dict[int, GpuProcess] = {}
        for call in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
            try:
                entries = getattr(self.nvml, call)(handle)
            except Exception as err:  # NVMLLibraryMismatchError is a plain Exception, not NVMLError
                log.debug("%s on GPU %s: %s", call, gpu_uuid, err)
                if call == "nvmlDeviceGetComputeRunningProcesses":
                    return None
                continue
            for entry in entries:
                used = (entry.usedGpuMemory or 0) // MIB  # None when the driver cannot tell
                mig = self._mig_of(
                    gpu_uuid,
                    getattr(entry, "gpuInstanceId", NO_INSTANCE),
                    getattr(entry, "computeInstanceId", NO_INSTANCE),
                )
                found[entry.pid] = GpuProcess(pid=entry.pid, gpu_uuid=gpu_uuid, used_mib=used, mig_uuid=mig)
        return list(found.values())

    # --- MigControl (discovery.mig) ---------------------------------------------------------------
    def _mig_call(self, name: str, *args: Any, gpu: str) -> Any:
        """pynvml.<name>; an NVML error becomes MigError with NVML's return code."""
        try:
            return getattr(self.nvml, name)(*args)
        except self.nvml.NVMLError as err:
            raise _mig_error(name, err, gpu) from err

    def _mig_handle(self, gpu_uuid: str) -> Any:
        """The GPU's handle; MigError NOT_SUPPORTED unless its current MIG mode is on."""
        handle = self._mig_call("nvmlDeviceGetHandleByUUID", gpu_uuid, gpu=gpu_uuid)
        mode = self._mig_call("nvmlDeviceGetMigMode", handle, gpu=gpu_uuid)
        if mode[0] != self.nvml.NVML_DEVICE_MIG_ENABLE:
            raise MigError(f"GPU {gpu_uuid}: MIG mode is off", NOT_SUPPORTED)
        return handle

    def mig_profiles(self, gpu_uuid: str) -> tuple[MigProfile, ...]:
        handle = self._mig_handle(gpu_uuid)
        profiles = []
        for index in range(self.nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:  # the call takes the profile's enum index, not its ID
                info = self.nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
            except (self.nvml.NVMLError_NotSupported, self.nvml.NVMLError_InvalidArgument):
                continue  # a profile this GPU does not have
            except self.nvml.NVMLError as err:
                raise _mig_error(f"nvmlDeviceGetGpuInstanceProfileInfo({index})", err, gpu_uuid) from err
            match = _MIG_PROFILE.search(_text(info.name))
            placements = self._placements(handle, info.id, gpu_uuid)
            if not match or not placements:
                log.warning(
                    "GPU %s: MIG profile %d (%r) has no profile name or no placement; skipped",
                    gpu_uuid,
                    info.id,
                    _text(info.name),
                )
                continue
            profiles.append(
                MigProfile(
                    id=info.id,
                    name=match.group(1),
                    compute_slices=info.sliceCount,
                    memory_slices=placements[0][1],
                    memory_mib=info.memorySizeMB,
                    instance_count=info.instanceCount,
                    placements=tuple(start for start, _ in placements),
                    copy_engines=info.copyEngineCount,
                    decoders=info.decoderCount,
                    encoders=info.encoderCount,
                    jpeg_engines=info.jpegCount,
                    ofa_engines=info.ofaCount,
                )
            )
        return tuple(profiles)

    def _placements(self, handle: Any, profile_id: int, gpu: str) -> list[tuple[int, int]]:
        """(start, size) of every possible placement of the profile (nvmlDeviceGetGpuInstancePossiblePlacements_v2)."""
        found = (self.nvml.c_nvmlGpuInstancePlacement_t * MAX_PLACEMENTS)()
        count = ctypes.c_uint(MAX_PLACEMENTS)
        self._mig_call(
            "nvmlDeviceGetGpuInstancePossiblePlacements", handle, profile_id, found, ctypes.byref(count), gpu=gpu
        )
        return [(found[i].start, found[i].size) for i in range(min(count.value, MAX_PLACEMENTS))]

    def mig_instances(self, gpu_uuid: str) -> tuple[MigInstance, ...]:
        handle = self._mig_handle(gpu_uuid)
        uuids = self._mig_uuids(handle, gpu_uuid)
        instances = []
        for gi_id in range(MAX_GPU_INSTANCES):  # IDs are small; NOT_FOUND: no instance with that ID
            try:
                gi = self.nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            except (self.nvml.NVMLError_NotFound, self.nvml.NVMLError_InvalidArgument):
                continue
            except self.nvml.NVMLError as err:
                raise _mig_error(f"nvmlDeviceGetGpuInstanceById({gi_id})", err, gpu_uuid) from err
            info = self._mig_call("nvmlGpuInstanceGetInfo", gi, gpu=gpu_uuid)
            ci_id = self._compute_instance_id(gi, gpu_uuid)
            instances.append(
                MigInstance(
                    gi_id=info.id,
                    profile_id=info.profileId,
                    start=info.placement.start,
                    size=info.placement.size,
                    ci_id=ci_id,
                    uuid=uuids.get((info.id, ci_id), "") if ci_id is not None else "",
                )
            )
        self._remember(gpu_uuid, instances, replace_all=True)
        return tuple(instances)

    def _compute_instance_id(self, gi: Any, gpu: str) -> int | None:
        for ci_id in range(MAX_COMPUTE_INSTANCES):
            try:
                self.nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
            except (self.nvml.NVMLError_NotFound, self.nvml.NVMLError_InvalidArgument):
                continue
            except self.nvml.NVMLError as err:
                raise _mig_error(f"nvmlGpuInstanceGetComputeInstanceById({ci_id})", err, gpu) from err
            return ci_id
        return None

    def _mig_uuids(self, handle: Any, gpu: str) -> dict[tuple[int, int], str]:
        """(GPU-instance ID, compute-instance ID) -> MIG device UUID, for the MIG devices there now."""
        found = {}
        for index in range(self._mig_call("nvmlDeviceGetMaxMigDeviceCount", handle, gpu=gpu)):
            try:
                mig = self.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except self.nvml.NVMLError_NotFound:
                continue  # indices can have gaps
            except self.nvml.NVMLError as err:
                raise _mig_error(f"nvmlDeviceGetMigDeviceHandleByIndex({index})", err, gpu) from err
            key = (
                self._mig_call("nvmlDeviceGetGpuInstanceId", mig, gpu=gpu),
                self._mig_call("nvmlDeviceGetComputeInstanceId", mig, gpu=gpu),
            )
            found[key] = _text(self._mig_call("nvmlDeviceGetUUID", mig, gpu=gpu))
        return found

    def create_gpu_instance(self, gpu_uuid: str, profile_id: int, start: int) -> int:
        handle = self._mig_handle(gpu_uuid)
        sizes = dict(self._placements(handle, profile_id, gpu_uuid))
        if start not in sizes:
            raise MigError(
                f"GPU {gpu_uuid}: MIG profile {profile_id} has no placement starting at memory slice {start}",
                INVALID_ARGUMENT,
            )
        placement = self.nvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, sizes[start]
        gi = self._mig_call(
            "nvmlDeviceCreateGpuInstanceWithPlacement", handle, profile_id, ctypes.byref(placement), gpu=gpu_uuid
        )
        return int(self._mig_call("nvmlGpuInstanceGetInfo", gi, gpu=gpu_uuid).id)

    def create_compute_instance(self, gpu_uuid: str, gi_id: int) -> MigInstance:
        handle = self._mig_handle(gpu_uuid)
        gi = self._mig_call("nvmlDeviceGetGpuInstanceById", handle, gi_id, gpu=gpu_uuid)
        info = self._mig_call("nvmlGpuInstanceGetInfo", gi, gpu=gpu_uuid)
        whole = None  # the compute-instance profile that takes the whole GPU instance: the most slices
        for index in range(self.nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                ci_profile = self.nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, index, self.nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except (self.nvml.NVMLError_NotSupported, self.nvml.NVMLError_InvalidArgument):
                continue
            except self.nvml.NVMLError as err:
                raise _mig_error(f"nvmlGpuInstanceGetComputeInstanceProfileInfo({index})", err, gpu_uuid) from err
            if whole is None or ci_profile.sliceCount > whole.sliceCount:
                whole = ci_profile
        if whole is None:
            raise MigError(f"GPU {gpu_uuid}: GPU instance {gi_id} offers no compute-instance profile", NOT_SUPPORTED)
        ci = self._mig_call("nvmlGpuInstanceCreateComputeInstance", gi, whole.id, gpu=gpu_uuid)
        ci_id = int(self._mig_call("nvmlComputeInstanceGetInfo", ci, gpu=gpu_uuid).id)
        uuid = self._mig_uuids(handle, gpu_uuid).get((gi_id, ci_id), "")
        made = MigInstance(
            gi_id=gi_id,
            profile_id=info.profileId,
            start=info.placement.start,
            size=info.placement.size,
            ci_id=ci_id,
            uuid=uuid,
        )
        self._remember(gpu_uuid, [made])
        return made

    def destroy_compute_instance(self, gpu_uuid: str, gi_id: int, ci_id: int) -> None:
        handle = self._mig_handle(gpu_uuid)
        gi = self._mig_call("nvmlDeviceGetGpuInstanceById", handle, gi_id, gpu=gpu_uuid)
        ci = self._mig_call("nvmlGpuInstanceGetComputeInstanceById", gi, ci_id, gpu=gpu_uuid)
        self._mig_call("nvmlComputeInstanceDestroy", ci, gpu=gpu_uuid)
        self._made = {k: v for k, v in self._made.items() if k != (gpu_uuid, gi_id, ci_id)}

    def destroy_gpu_instance(self, gpu_uuid: str, gi_id: int) -> None:
        handle = self._mig_handle(gpu_uuid)
        gi = self._mig_call("nvmlDeviceGetGpuInstanceById", handle, gi_id, gpu=gpu_uuid)
        self._mig_call("nvmlGpuInstanceDestroy", gi, gpu=gpu_uuid)

    def _free_events(self) -> None:
        try:
            self.nvml.nvmlEventSetFree(self._event_set)
        except self.nvml.NVMLError as err:
            log.warning("NVML nvmlEventSetFree failed: %s", err)
        self._event_set = None

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._event_set is not None:
            self._free_events()
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as err:
            log.warning("NVML nvmlShutdown failed: %s", err)

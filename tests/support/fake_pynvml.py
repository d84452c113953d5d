"""A fake `pynvml` module for testing the NVML backend without a driver.

It keeps the real binding's error classes and constants (so `except pynvml.NVMLError_NotSupported`
means the same thing) and implements the calls the backend makes over an in-memory GPU model.
Errors are injected per call and GPU index with `fail(call, index, error_class)`.
"""

from __future__ import annotations

import queue
import time
import types
from dataclasses import dataclass, field

import pynvml as real

MIB = 1024 * 1024


@dataclass
class FakeMig:
    uuid: str
    profile: str
    memory_mib: int
    gi: int
    ci: int = 0


@dataclass
class FakeGpu:
    uuid: str
    name: str
    memory_mib: int
    bus_id: str  # NVML format, e.g. 00000000:3B:00.0
    capability: tuple[int, int] = (8, 0)
    mig: dict[int, FakeMig] | None = None  # MIG index -> instance (gaps allowed); None: MIG not supported
    nvlinks: list[str] = field(default_factory=list)  # remote NVML bus id per link
    lost: bool = False
    processes: list = field(default_factory=list)  # (pid, used bytes or None, gi, ci)
    utilization: int = 0
    recovery_action: int | None = None  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; None: the field is not supported
    memory_affinity: list[int] | None = None  # NUMA nodes of nvmlDeviceGetMemoryAffinity; None: NotSupported
    cpu_affinity: list[int] | None = None  # CPUs of nvmlDeviceGetCpuAffinityWithinScope(NODE); None: NotSupported


@dataclass(frozen=True)
class Handle:
    gpu: int
    mig: int | None = None


class EventData:
    def __init__(self, device: Handle, event_type: int, data: int, gi: int, ci: int) -> None:
        self.device, self.eventType, self.eventData, self.gpuInstanceId, self.computeInstanceId = device, event_type, data, gi, ci


class FakeNvml(types.ModuleType):
    def __init__(self, gpus: list[FakeGpu], driver: str = "550.54.15", cuda: int = 12040, topology: dict | None = None) -> None:
        super().__init__("pynvml")
        for name in dir(real):
            if name.startswith(("NVMLError", "NVML_", "nvmlEventType")):
                setattr(self, name, getattr(real, name))
        self.gpus = gpus
        self.driver = driver
        self.cuda = cuda
        self.topology = topology or {}  # (i, j) -> NVML_TOPOLOGY_* level
        self.calls: list[str] = []
        self.failures: dict[tuple[str, int | None], type] = {}
        self.events: queue.Queue = queue.Queue()
        self.registered: dict[int, int] = {}  # gpu index -> event mask, in the newest event set
        self.event_sets: dict[int, dict[int, int]] = {}  # live event set -> its registrations
        self.supported_events = real.nvmlEventTypeXidCriticalError | real.nvmlEventTypeDoubleBitEccError
        self.initialised = 0
        self.wait_error: type | None = None

    # --- test controls ------------------------------------------------------------------------
    def fail(self, call: str, index: int | None, error: type) -> None:
        self.failures[(call, index)] = error

    def xid(self, index: int, xid: int, gi: int = 0xFFFFFFFF, ci: int = 0xFFFFFFFF) -> None:
        self.events.put(EventData(Handle(index), real.nvmlEventTypeXidCriticalError, xid, gi, ci))

    # --- helpers ------------------------------------------------------------------------------
    def _enter(self, call: str, handle: Handle | None = None) -> FakeGpu | None:
        self.calls.append(call)
        if call != "nvmlInit" and not self.initialised:
            raise real.NVMLError_Uninitialized()
        index = handle.gpu if handle else None
        error = self.failures.get((call, index)) or self.failures.get((call, None))
        if error:
            raise error()
        if handle is None:
            return None
        gpu = self.gpus[handle.gpu]
        if gpu.lost:
            raise real.NVMLError_GpuIsLost()
        return gpu

    def _mig(self, handle: Handle) -> FakeMig:
        return self.gpus[handle.gpu].mig[handle.mig]

    # --- the pynvml calls the backend uses ----------------------------------------------------------
    def nvmlInit(self):
        self._enter("nvmlInit")
        self.initialised += 1

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self):
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self):
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return self.cuda

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex", Handle(index))
        return Handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                self._enter("nvmlDeviceGetHandleByUUID", Handle(i))
                return Handle(i)
        raise real.NVMLError_NotFound()

    def nvmlDeviceGetUUID(self, handle):
        gpu = self._enter("nvmlDeviceGetUUID", handle)
        return self._mig(handle).uuid if handle.mig is not None else gpu.uuid

    def nvmlDeviceGetName(self, handle):
        gpu = self._enter("nvmlDeviceGetName", handle)
        return f"{gpu.name} MIG {self._mig(handle).profile}" if handle.mig is not None else gpu.name

    def nvmlDeviceGetMemoryInfo(self, handle):
        gpu = self._enter("nvmlDeviceGetMemoryInfo", handle)
        total = (self._mig(handle).memory_mib if handle.mig is not None else gpu.memory_mib) * MIB
        return types.SimpleNamespace(total=total, used=0, free=total)

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self._enter("nvmlDeviceGetCudaComputeCapability", handle).capability

    def nvmlDeviceGetMinorNumber(self, handle):
        self._enter("nvmlDeviceGetMinorNumber", handle)
        return handle.gpu

    def nvmlDeviceGetPciInfo(self, handle):
        return types.SimpleNamespace(busId=self._enter("nvmlDeviceGetPciInfo", handle).bus_id.encode())

    def nvmlDeviceGetMigMode(self, handle):
        gpu = self._enter("nvmlDeviceGetMigMode", handle)
        if gpu.mig is None:
            raise real.NVMLError_NotSupported()
        mode = real.NVML_DEVICE_MIG_ENABLE if gpu.mig else real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        self._enter("nvmlDeviceGetMaxMigDeviceCount", handle)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index):
        gpu = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if index not in gpu.mig:
            raise real.NVMLError_NotFound()
        return Handle(handle.gpu, index)

    def nvmlDeviceGetGpuInstanceId(self, handle):
        self._enter("nvmlDeviceGetGpuInstanceId", handle)
        return self._mig(handle).gi

    def nvmlDeviceGetComputeInstanceId(self, handle):
        self._enter("nvmlDeviceGetComputeInstanceId", handle)
        return self._mig(handle).ci

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        self._enter("nvmlDeviceGetTopologyCommonAncestor", a)
        return self.topology.get((a.gpu, b.gpu), real.NVML_TOPOLOGY_SYSTEM)

    def nvmlDeviceGetNvLinkState(self, handle, link):
        gpu = self._enter("nvmlDeviceGetNvLinkState", handle)
        if link >= len(gpu.nvlinks):
            raise real.NVMLError_NotSupported()
        return real.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
        gpu = self._enter("nvmlDeviceGetNvLinkRemotePciInfo", handle)
        return types.SimpleNamespace(busId=gpu.nvlinks[link])

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=self._enter("nvmlDeviceGetUtilizationRates", handle).utilization, memory=0)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        self._enter("nvmlDeviceGetTemperature", handle)
        return 41

    def nvmlDeviceGetPowerUsage(self, handle):
        self._enter("nvmlDeviceGetPowerUsage", handle)
        return 71500  # milliwatts

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        gpu = self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m, gpuInstanceId=gi, computeInstanceId=ci) for p, m, gi, ci in gpu.processes]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):
        self._enter("nvmlDeviceGetMPSComputeRunningProcesses", handle)
        raise real.NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match the NVML lib version.")

    def nvmlEventSetCreate(self):
        self._enter("nvmlEventSetCreate")
        handle = self._next_set = getattr(self, "_next_set", 0) + 1
        self.event_sets[handle] = self.registered = {}
        return handle

    def nvmlDeviceGetSupportedEventTypes(self, handle):
        self._enter("nvmlDeviceGetSupportedEventTypes", handle)
        return self.supported_events

    def nvmlDeviceRegisterEvents(self, handle, mask, event_set):
        self._enter("nvmlDeviceRegisterEvents", handle)
        if mask & ~self.supported_events:
            raise real.NVMLError_NotSupported()
        self.event_sets[event_set][handle.gpu] = mask

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        self._enter("nvmlEventSetWait_v2")
        if self.wait_error:
            raise self.wait_error()
        if any(self.gpus[i].lost for i in self.event_sets[event_set]):
            raise real.NVMLError_GpuIsLost()  # like the driver: every wait fails at once while a lost GPU is in the set
        deadline = time.monotonic() + timeout_ms / 1000
        while True:  # like the driver: only events of GPUs registered in this set are delivered
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise real.NVMLError_Timeout() from None
            if event.device.gpu in self.event_sets[event_set]:
                return event

    def nvmlEventSetFree(self, event_set):
        self._enter("nvmlEventSetFree")
        del self.event_sets[event_set]

    def nvmlDeviceGetFieldValues(self, handle, field_ids):
        gpu = self._enter("nvmlDeviceGetFieldValues", handle)
        values = []
        for field_id in field_ids:
            known = field_id == real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and gpu.recovery_action is not None
            values.append(types.SimpleNamespace(
                fieldId=field_id,
                nvmlReturn=real.NVML_SUCCESS if known else real.NVML_ERROR_NOT_SUPPORTED,
                value=types.SimpleNamespace(uiVal=gpu.recovery_action or 0),
            ))
        return values

    def nvmlDeviceGetMemoryAffinity(self, handle, node_set_size, scope):
        gpu = self._enter("nvmlDeviceGetMemoryAffinity", handle)
        return self._bitmask(gpu.memory_affinity, node_set_size)

    def nvmlDeviceGetCpuAffinityWithinScope(self, handle, cpu_set_size, scope):
        gpu = self._enter("nvmlDeviceGetCpuAffinityWithinScope", handle)
        return self._bitmask(gpu.cpu_affinity, cpu_set_size)

    @staticmethod
    def _bitmask(bits: list[int] | None, words: int) -> list[int]:
        """NVML's affinity masks: `words` 64-bit words, bit i set for node/CPU i."""
        if bits is None:
            raise real.NVMLError_NotSupported()
        mask = [0] * words
        for bit in bits:
            mask[bit // 64] |= 1 << (bit % 64)
        return mask

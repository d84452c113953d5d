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

from deviceplugin.discovery.mig import MigError
from deviceplugin.discovery.migsim import SimulatedMig
from deviceplugin.model.node import MigDevice

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
    mig_mode: bool | None = None  # MIG mode on; None: on when `mig` has instances (MIG on with none: True and mig={})


@dataclass(frozen=True)
class Handle:
    gpu: int
    mig: int | None = None


@dataclass(frozen=True)
class GpuInstanceHandle:
    gpu: int
    gi: int


@dataclass(frozen=True)
class ComputeInstanceHandle:
    gpu: int
    gi: int
    ci: int


class EventData:
    def __init__(self, device: Handle, event_type: int, data: int, gi: int, ci: int) -> None:
        self.device, self.eventType, self.eventData, self.gpuInstanceId, self.computeInstanceId = (
            device,
            event_type,
            data,
            gi,
            ci,
        )


class FakeNvml(types.ModuleType):
    def __init__(
        self, gpus: list[FakeGpu], driver: str = "550.54.15", cuda: int = 12040, topology: dict | None = None
    ) -> None:
        super().__init__("pynvml")
        for name in dir(real):
            if name.startswith(("NVMLError", "NVML_", "nvmlEventType", "c_nvmlGpuInstancePlacement")):
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
        self.mig_state = {i: self._simulated_mig(i, g) for i, g in enumerate(gpus) if g.mig is not None}

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

    def _mig_enabled(self, gpu: FakeGpu) -> bool:
        return bool(gpu.mig) if gpu.mig_mode is None else gpu.mig_mode

    def _simulated_mig(self, index: int, gpu: FakeGpu) -> SimulatedMig:
        """The GPU's MIG state from the project's MIG model (discovery.migsim), with its listed instances placed."""

        def in_use(mig_uuid: str) -> bool:
            ids = {(m.gi, m.ci) for m in (gpu.mig or {}).values() if m.uuid == mig_uuid}
            return any((gi, ci) in ids for _, _, gi, ci in gpu.processes)

        state = SimulatedMig(gpu.uuid, gpu.name, gpu.memory_mib, self._mig_enabled(gpu), in_use)
        state.adopt(
            [
                MigDevice(uuid=m.uuid, profile=m.profile, memory_mib=m.memory_mib, gi_id=m.gi, ci_id=m.ci, index=k)
                for k, m in (gpu.mig or {}).items()
            ]
        )
        return state

    def _mig_state(self, call: str, handle: Handle | GpuInstanceHandle | ComputeInstanceHandle) -> SimulatedMig:
        self._enter(call, Handle(handle.gpu))
        if handle.gpu not in self.mig_state:
            raise real.NVMLError_NotSupported()
        return self.mig_state[handle.gpu]

    @staticmethod
    def _nvml(err: MigError) -> Exception:
        return real.NVMLError(err.code)  # pynvml's NVMLError(code) is the code's subclass (NVMLError_InUse, ...)

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
        mode = real.NVML_DEVICE_MIG_ENABLE if self._mig_enabled(gpu) else real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    # --- MIG instance management (answered by discovery.migsim, with NVML's error codes) ----------------------------
    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle, profile, version=2):
        state = self._mig_state("nvmlDeviceGetGpuInstanceProfileInfo", handle)
        try:
            profiles = state.profiles()
        except MigError as err:
            raise self._nvml(err) from None
        order = {0: 19, 7: 20, 9: 15, 1: 14, 2: 9, 3: 5, 4: 0}  # NVML's profile enum index -> the profile ID it names
        if profile >= real.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise real.NVMLError_InvalidArgument()
        found = next((p for p in profiles if p.id == order.get(profile)), None)
        if found is None:
            raise real.NVMLError_NotSupported()
        return types.SimpleNamespace(
            id=found.id,
            isP2pSupported=0,
            sliceCount=found.compute_slices,
            instanceCount=found.instance_count,
            multiprocessorCount=0,
            copyEngineCount=found.copy_engines,
            decoderCount=found.decoders,
            encoderCount=found.encoders,
            jpegCount=found.jpeg_engines,
            ofaCount=found.ofa_engines,
            memorySizeMB=found.memory_mib,
            name=f"MIG {found.name}".encode(),
        )

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle, profile_id, placements, count_ref):
        state = self._mig_state("nvmlDeviceGetGpuInstancePossiblePlacements", handle)
        try:
            starts = state.placements(profile_id)
        except MigError as err:
            raise self._nvml(err) from None
        size = next(p.memory_slices for p in state.table if p.id == profile_id)
        count = count_ref._obj  # ctypes.byref(c_uint): in, the room; out, how many
        if placements is None:
            count.value = len(starts)
            return real.NVML_SUCCESS
        if count.value < len(starts):
            raise real.NVMLError_InsufficientSize()
        for i, start in enumerate(starts):
            placements[i].start, placements[i].size = start, size
        count.value = len(starts)
        return real.NVML_SUCCESS

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle, profile_id, placement):
        state = self._mig_state("nvmlDeviceCreateGpuInstanceWithPlacement", handle)
        placement = getattr(placement, "_obj", placement)
        try:
            return GpuInstanceHandle(handle.gpu, state.create_gpu_instance(profile_id, placement.start))
        except MigError as err:
            raise self._nvml(err) from None

    def nvmlDeviceGetGpuInstanceById(self, handle, gi_id):
        state = self._mig_state("nvmlDeviceGetGpuInstanceById", handle)
        if not any(i.gi_id == gi_id for i in state.instances()):
            raise real.NVMLError_NotFound()
        return GpuInstanceHandle(handle.gpu, gi_id)

    def _instance(self, state: SimulatedMig, gi_id: int):
        found = next((i for i in state.instances() if i.gi_id == gi_id), None)
        if found is None:
            raise real.NVMLError_NotFound()
        return found

    def nvmlGpuInstanceGetInfo(self, gi):
        found = self._instance(self._mig_state("nvmlGpuInstanceGetInfo", gi), gi.gi)
        placement = types.SimpleNamespace(start=found.start, size=found.size)
        return types.SimpleNamespace(
            device=Handle(gi.gpu), id=found.gi_id, profileId=found.profile_id, placement=placement
        )

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi, profile, eng_profile, version=2):
        state = self._mig_state("nvmlGpuInstanceGetComputeInstanceProfileInfo", gi)
        found = self._instance(state, gi.gi)
        slices = next(p.compute_slices for p in state.table if p.id == found.profile_id)
        by_index = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}  # NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE -> n
        if by_index.get(profile, 99) > slices:
            raise real.NVMLError_NotSupported()
        return types.SimpleNamespace(
            id=profile, sliceCount=by_index[profile], instanceCount=slices // by_index[profile]
        )

    def nvmlGpuInstanceCreateComputeInstance(self, gi, profile_id):
        state = self._mig_state("nvmlGpuInstanceCreateComputeInstance", gi)
        try:
            made = state.create_compute_instance(gi.gi)
        except MigError as err:
            raise self._nvml(err) from None
        gpu = self.gpus[gi.gpu]
        profile = next(p for p in state.table if p.id == made.profile_id)
        index = next(i for i in range(len(gpu.mig) + 1) if i not in gpu.mig)
        gpu.mig[index] = FakeMig(
            uuid=made.uuid, profile=profile.name, memory_mib=profile.memory_mib, gi=made.gi_id, ci=made.ci_id or 0
        )
        return ComputeInstanceHandle(gi.gpu, gi.gi, made.ci_id or 0)

    def nvmlComputeInstanceGetInfo(self, ci):
        self._mig_state("nvmlComputeInstanceGetInfo", ci)
        return types.SimpleNamespace(
            device=Handle(ci.gpu), gpuInstance=GpuInstanceHandle(ci.gpu, ci.gi), id=ci.ci, profileId=0
        )

    def nvmlGpuInstanceGetComputeInstanceById(self, gi, ci_id):
        found = self._instance(self._mig_state("nvmlGpuInstanceGetComputeInstanceById", gi), gi.gi)
        if found.ci_id != ci_id:
            raise real.NVMLError_NotFound()
        return ComputeInstanceHandle(gi.gpu, gi.gi, ci_id)

    def nvmlComputeInstanceDestroy(self, ci):
        state = self._mig_state("nvmlComputeInstanceDestroy", ci)
        try:
            state.destroy_compute_instance(ci.gi, ci.ci)
        except MigError as err:
            raise self._nvml(err) from None
        gpu = self.gpus[ci.gpu]
        gpu.mig = {k: m for k, m in gpu.mig.items() if (m.gi, m.ci) != (ci.gi, ci.ci)}
        return real.NVML_SUCCESS

    def nvmlGpuInstanceDestroy(self, gi):
        state = self._mig_state("nvmlGpuInstanceDestroy", gi)
        try:
            state.destroy_gpu_instance(gi.gi)
        except MigError as err:
            raise self._nvml(err) from None
        return real.NVML_SUCCESS

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
        return [
            types.SimpleNamespace(pid=p, usedGpuMemory=m, gpuInstanceId=gi, computeInstanceId=ci)
            for p, m, gi, ci in gpu.processes
        ]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):
        self._enter("nvmlDeviceGetMPSComputeRunningProcesses", handle)
        raise real.NVMLLibraryMismatchError(
            "Unversioned function called and the pyNVML version does not match the NVML lib version."
        )

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
            values.append(
                types.SimpleNamespace(
                    fieldId=field_id,
                    nvmlReturn=real.NVML_SUCCESS if known else real.NVML_ERROR_NOT_SUPPORTED,
                    value=types.SimpleNamespace(uiVal=gpu.recovery_action or 0),
                )
            )
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

"""A simulated GPU node built from a node description file (YAML), with fault injection.

File format (every key is documented in docs/configuration.md)::

    name: 8xA100                   # optional, for logs
    driverVersion: "550.54.15"     # optional
    cudaDriverVersion: "12.4"      # optional
    gpus:
      - index: 0
        uuid: GPU-6a3c...          # must start with GPU-
        model: NVIDIA A100-SXM4-80GB
        memoryMiB: 81920
        numaNode: 0                # optional
        pciBusId: "0000:3b:00.0"   # optional
        computeCapability: "8.0"   # optional
        minorNumber: 0             # optional, N of /dev/nvidiaN (default: index)
        mig:                       # optional: MIG enabled, with these instances
          - {uuid: MIG-..., profile: 3g.40gb, memoryMiB: 40192, giId: 1, ciId: 0}
        migCapable: true           # optional: the hardware supports MIG (default: true when mig is given)
        health: Healthy            # optional (as `discover --json` prints it): anything else fails queries from
                                   # the start
    links:                         # optional: GPU pairs by index
      - {gpus: [0, 1], nvlinks: 12}
      - {gpus: [0, 2], pcie: host-bridge}
    failures:                      # optional: faults that happen by themselves
      - {gpu: 1, after: 30, xid: 79}      # seconds after start
      - {gpu: 2, after: 60, lost: true}
"""

from __future__ import annotations

import queue
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config.schema import Fields, SchemaError, join
from ..config.yamlfile import YamlProblem, decode, load_yaml, read_bounded
from ..model.devices import HEALTHY
from ..model.mig import MigInstance, MigProfile
from ..model.node import PCIE_LEVELS, Gpu, GpuProcess, GpuStats, HealthEvent, Link, MigDevice, NodeInfo
from .inventory import InventoryError
from .mig import GPU_IS_LOST, NOT_SUPPORTED, MigError
from .migsim import SimulatedMig

_GPU_KEYS = {
    "index": int,
    "uuid": str,
    "model": str,
    "memoryMiB": int,
    "numaNode": int,
    "pciBusId": str,
    "computeCapability": str,
    "minorNumber": int,
    "mig": list,
    "migCapable": bool,
    "health": str,
}
_MIG_KEYS = {"uuid": str, "profile": str, "memoryMiB": int, "giId": int, "ciId": int}
_PROFILE = re.compile(r"^\d+g\.\d+gb(\+[a-z]+)*$")


@dataclass(frozen=True)
class ScheduledFailure:
    gpu_uuid: str
    after: float
    xid: int | None
    lost: bool
    reason: str = "GPU is lost"  # why queries fail after a loss


def parse_node(data: Any, source: str = "node file") -> tuple[NodeInfo, list[ScheduledFailure]]:
    """Validate a node description; errors name the key and the reason."""
    try:
        top = Fields(
            data,
            "",
            {
                "name": str,
                "driverVersion": str,
                "cudaDriverVersion": str,
                "gpus": list,
                "links": list,
                "failures": list,
            },
        )
        items = top.get("gpus", [], required=True)
        gpus = [_parse_gpu(item, f"gpus[{i}]") for i, item in enumerate(items)]
        _check_unique(gpus)
        by_index = {g.index: g for g in gpus}
        links = dict(_parse_link(item, f"links[{i}]", by_index) for i, item in enumerate(top.get("links", [])))
        failures = [_parse_failure(item, f"failures[{i}]", by_index) for i, item in enumerate(top.get("failures", []))]
        # A GPU that `discover --json` saw unhealthy fails its queries from the start.
        failures += [
            ScheduledFailure(g.uuid, 0, None, True, item["health"])
            for g, item in zip(gpus, items, strict=True)
            if item.get("health", HEALTHY) != HEALTHY
        ]
    except SchemaError as err:
        raise InventoryError(f"{source}: {err}") from None
    node = NodeInfo(
        gpus=tuple(sorted(gpus, key=lambda g: g.index)),
        driver_version=top.get("driverVersion", ""),
        cuda_driver_version=top.get("cudaDriverVersion", ""),
        links=links,
        name=top.get("name", Path(source).stem),
    )
    return node, failures


def _parse_gpu(item: Any, path: str) -> Gpu:
    fields = Fields(item, path, _GPU_KEYS)
    index = fields.get("index", required=True)
    uuid = fields.get("uuid", required=True)
    model = fields.get("model", required=True)
    memory = fields.get("memoryMiB", required=True)
    fields.check(index >= 0, "index", f"must be >= 0, got {index}")
    fields.check(uuid.startswith("GPU-"), "uuid", f"must start with 'GPU-', got {uuid!r}")
    fields.check(memory > 0, "memoryMiB", f"must be > 0, got {memory}")
    numa = fields.get("numaNode", None)
    mig = [_parse_mig(m, f"{join(path, 'mig')}[{i}]", i, memory) for i, m in enumerate(fields.get("mig", []))]
    return Gpu(
        index=index,
        uuid=uuid,
        model=model,
        memory_mib=memory,
        numa_node=numa if numa is not None and numa >= 0 else None,
        pci_bus_id=fields.get("pciBusId", ""),
        compute_capability=fields.get("computeCapability", ""),
        minor_number=fields.get("minorNumber", index),
        mig_enabled=fields.has("mig"),
        mig_devices=tuple(mig),
        mig_capable=fields.get("migCapable", fields.has("mig")),
    )


def _parse_mig(item: Any, path: str, index: int, gpu_memory: int) -> MigDevice:
    fields = Fields(item, path, _MIG_KEYS)
    uuid = fields.get("uuid", required=True)
    profile = fields.get("profile", required=True)
    memory = fields.get("memoryMiB", required=True)
    fields.check(uuid.startswith("MIG-"), "uuid", f"must start with 'MIG-', got {uuid!r}")
    fields.check(bool(_PROFILE.match(profile)), "profile", f"must look like 1g.10gb or 1g.10gb+me, got {profile!r}")
    fields.check(0 < memory <= gpu_memory, "memoryMiB", f"must be between 1 and the GPU's {gpu_memory}, got {memory}")
    return MigDevice(
        uuid=uuid,
        profile=profile,
        memory_mib=memory,
        gi_id=fields.get("giId", index),
        ci_id=fields.get("ciId", 0),
        index=index,
    )


def _gpu_ref(fields: Fields, key: str, value: int, by_index: dict[int, Gpu]) -> Gpu:
    fields.check(value in by_index, key, f"no GPU with index {value} in gpus")
    return by_index[value]


def _parse_link(item: Any, path: str, by_index: dict[int, Gpu]) -> tuple[tuple[str, str], Link]:
    fields = Fields(item, path, {"gpus": list, "nvlinks": int, "pcie": str})
    pair = fields.get("gpus", required=True)
    fields.check(
        len(pair) == 2 and all(isinstance(i, int) for i in pair) and pair[0] != pair[1],
        "gpus",
        f"must be two different GPU indexes, got {pair}",
    )
    a, b = sorted((_gpu_ref(fields, "gpus", i, by_index) for i in pair), key=lambda g: g.index)
    nvlinks = fields.get("nvlinks", 0)
    fields.check(nvlinks >= 0, "nvlinks", f"must be >= 0, got {nvlinks}")
    pcie = fields.get("pcie", "")
    fields.check(pcie in PCIE_LEVELS + ("",), "pcie", f"must be one of {', '.join(PCIE_LEVELS)}, got {pcie!r}")
    return (a.uuid, b.uuid), Link(nvlinks=nvlinks, pcie=pcie)


def _parse_failure(item: Any, path: str, by_index: dict[int, Gpu]) -> ScheduledFailure:
    fields = Fields(item, path, {"gpu": int, "after": int, "xid": int, "lost": bool})
    gpu = _gpu_ref(fields, "gpu", fields.get("gpu", required=True), by_index)
    after = fields.get("after", required=True)
    fields.check(after >= 0, "after", f"must be >= 0 seconds, got {after}")
    xid, lost = fields.get("xid", None), fields.get("lost", False)
    fields.check((xid is None) != (not lost), "xid", "give exactly one of xid or lost: true")
    return ScheduledFailure(gpu_uuid=gpu.uuid, after=after, xid=xid, lost=lost)


def _check_unique(gpus: list[Gpu]) -> None:
    for attr in ("index", "uuid"):
        seen: set[object] = set()
        for i, gpu in enumerate(gpus):
            value = getattr(gpu, attr)
            if value in seen:
                raise SchemaError(f"gpus[{i}].{attr}", f"duplicate value {value!r}")
            seen.add(value)


class SimulatedInventory:
    """Inventory backend over a node description, with faults injected by tests or scheduled in the file."""

    def __init__(
        self, node: NodeInfo, failures: list[ScheduledFailure] | None = None, proc_root: str | Path | None = None
    ) -> None:
        self._node = node
        self.proc_root = Path(proc_root) if proc_root else None  # where add_process writes /proc/<pid>/cgroup
        self._processes: dict[int, GpuProcess] = {}
        self._utilization: dict[str, float] = {}
        self._events: queue.Queue[HealthEvent] = queue.Queue()
        self._failing: dict[str, str] = {}  # GPU uuid -> why queries fail
        self._reset_required: dict[str, bool | None] = {}  # GPU uuid -> the driver's recovery action says reset
        self._lock = threading.Lock()
        started = time.monotonic()
        self._schedule = sorted(((started + f.after, f) for f in failures or []), key=lambda p: p[0])
        self._failing.update(
            {f.gpu_uuid: f.reason for f in failures or [] if f.lost and f.after == 0}
        )  # lost from the start
        self._mig = {g.uuid: self._simulated_mig(g) for g in node.gpus if g.mig_capable}
        gpus = tuple(
            replace(g, mig_profiles=self._mig[g.uuid].table) if g.mig_enabled and g.uuid in self._mig else g
            for g in node.gpus
        )
        self._node = replace(node, gpus=gpus)

    def _simulated_mig(self, gpu: Gpu) -> SimulatedMig:
        """The GPU's MIG state (discovery.migsim): its model's tables, with the node file's instances placed."""
        mig = SimulatedMig(gpu.uuid, gpu.model, gpu.memory_mib, gpu.mig_enabled, self._mig_in_use)
        mig.adopt(gpu.mig_devices)
        return mig

    def _mig_in_use(self, mig_uuid: str) -> bool:
        with self._lock:
            return any(p.mig_uuid == mig_uuid for p in self._processes.values())

    @classmethod
    def from_file(cls, path: str | Path, proc_root: str | Path | None = None) -> SimulatedInventory:
        try:
            data, duplicates = load_yaml(decode(read_bounded(path)))
        except YamlProblem as err:
            raise InventoryError(f"node file {path}: {err}") from None
        if duplicates:
            raise InventoryError(f"node file {path}: {duplicates[0]}")
        return cls(*parse_node(data, str(path)), proc_root=proc_root)

    def discover(self) -> NodeInfo:
        return self._node

    # --- fault injection -------------------------------------------------------------------
    def inject_xid(self, gpu_uuid: str, xid: int, mig_uuid: str | None = None) -> None:
        self._events.put(HealthEvent(gpu_uuid=gpu_uuid, reason=f"XID {xid}", xid=xid, mig_uuid=mig_uuid))

    def lose_gpu(self, gpu_uuid: str) -> None:
        """The GPU falls off the bus: queries fail until restore()."""
        self.fail_queries(gpu_uuid, "GPU is lost")
        self._events.put(HealthEvent(gpu_uuid=gpu_uuid, reason="GPU is lost", reset_required=True))

    def add_process(
        self, pid: int, gpu_uuid: str, used_mib: int, mig_uuid: str | None = None, cgroup: str | None = None
    ) -> None:
        """A process using GPU memory; with proc_root, `cgroup` becomes its /proc/<pid>/cgroup."""
        with self._lock:
            self._processes[pid] = GpuProcess(pid=pid, gpu_uuid=gpu_uuid, used_mib=used_mib, mig_uuid=mig_uuid)
        if self.proc_root is not None and cgroup is not None:
            (self.proc_root / str(pid)).mkdir(parents=True, exist_ok=True)
            (self.proc_root / str(pid) / "cgroup").write_text(cgroup)

    def remove_process(self, pid: int) -> None:
        with self._lock:
            self._processes.pop(pid, None)

    def set_utilization(self, gpu_uuid: str, percent: float) -> None:
        self._utilization[gpu_uuid] = percent

    def fail_queries(self, gpu_uuid: str, reason: str = "Unknown Error") -> None:
        with self._lock:
            self._failing[gpu_uuid] = reason

    def restore(self, gpu_uuid: str) -> None:
        with self._lock:
            self._failing.pop(gpu_uuid, None)

    # --- Inventory -------------------------------------------------------------------------
    def wait_for_event(self, timeout: float) -> HealthEvent | None:
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._schedule and self._schedule[0][0] <= time.monotonic():
                _, failure = self._schedule.pop(0)
                if failure.lost:
                    self._failing[failure.gpu_uuid] = failure.reason
                    return HealthEvent(gpu_uuid=failure.gpu_uuid, reason=failure.reason, reset_required=True)
                return HealthEvent(gpu_uuid=failure.gpu_uuid, reason=f"XID {failure.xid}", xid=failure.xid)
            if self._schedule:
                deadline = min(deadline, self._schedule[0][0])
        try:
            return self._events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def check(self, gpu_uuid: str) -> str | None:
        with self._lock:
            reason = self._failing.get(gpu_uuid)
        return f"query on GPU {gpu_uuid} failed: {reason}" if reason else None

    def set_reset_required(self, gpu_uuid: str, required: bool | None) -> None:
        """What the simulated driver says about a reset (None: it cannot tell, like a driver without the field)."""
        with self._lock:
            self._reset_required[gpu_uuid] = required

    def reset_required(self, gpu_uuid: str) -> bool | None:
        with self._lock:
            return self._reset_required.get(gpu_uuid)

    def stats(self, gpu_uuid: str) -> GpuStats:
        with self._lock:
            used = sum(p.used_mib for p in self._processes.values() if p.gpu_uuid == gpu_uuid)
        busy = self._utilization.get(gpu_uuid, 0.0)
        return GpuStats(
            memory_used_mib=used,
            utilization_percent=busy,
            temperature_celsius=35 + busy * 0.4,
            power_watts=60 + busy * 2.4,
        )

    def processes(self, gpu_uuid: str) -> list[GpuProcess]:
        with self._lock:
            return [p for p in self._processes.values() if p.gpu_uuid == gpu_uuid]

    # --- MigControl (discovery.mig) ---------------------------------------------------------------
    def _mig_of(self, gpu_uuid: str) -> SimulatedMig:
        reason = self.check(gpu_uuid)
        if reason:
            raise MigError(reason, GPU_IS_LOST)
        if gpu_uuid not in self._mig:
            raise MigError(f"GPU {gpu_uuid} does not support MIG", NOT_SUPPORTED)
        return self._mig[gpu_uuid]

    def mig_profiles(self, gpu_uuid: str) -> tuple[MigProfile, ...]:
        return self._mig_of(gpu_uuid).profiles()

    def mig_instances(self, gpu_uuid: str) -> tuple[MigInstance, ...]:
        return self._mig_of(gpu_uuid).instances()

    def create_gpu_instance(self, gpu_uuid: str, profile_id: int, start: int) -> int:
        return self._mig_of(gpu_uuid).create_gpu_instance(profile_id, start)

    def create_compute_instance(self, gpu_uuid: str, gi_id: int) -> MigInstance:
        return self._mig_of(gpu_uuid).create_compute_instance(gi_id)

    def destroy_compute_instance(self, gpu_uuid: str, gi_id: int, ci_id: int) -> None:
        self._mig_of(gpu_uuid).destroy_compute_instance(gi_id, ci_id)

    def destroy_gpu_instance(self, gpu_uuid: str, gi_id: int) -> None:
        self._mig_of(gpu_uuid).destroy_gpu_instance(gi_id)

    def close(self) -> None:
        pass

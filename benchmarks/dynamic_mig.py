"""Dynamic MIG against a fixed MIG layout: the fraction of GPU slices a mixed claim stream keeps busy, and the claims
refused, on a simulated 8xH100 node.

The stream: one claim arrives per step, its profile drawn (seeded) from 1g.10gb ... 7g.80gb, and each running
claim ends with a fixed chance per step (a mean lifetime of `LIFETIME` steps). The same stream goes to both:

- **dynamic**: the node's dynamic MIG pool as the DRA driver publishes it (`dra.devices`, `dra.partitions`: the
  counter set per GPU and one device per profile and placement), placed by a simulation of kube-scheduler's rule
  (first fit in slice and device order, a device allowed when every counter it consumes, with what the allocated
  devices consume, stays within its set), then prepared and unprepared by the driver (`dra.prepare.Driver`), which
  makes and destroys each instance through the simulated NVML. `nvml_refused` counts placements the counters
  allowed but NVML refused (none expected: the counters are NVML's rules).
- **fixed**: the MIG layout of the shipped `mig-mixed` profile (examples/config/mig-mixed.yaml serves the MIG
  layouts of GPUs 0-4 of examples/nodes/8xA100-80GB-mig.yaml; their profile names are the H100 80GB's), GPU i of
  the 8 H100s taking layout i mod 5; a claim takes a free instance of its profile, else it is refused.

`slices_used` is the mean, over the steps, of the compute slices held by running claims over the node's 56 (7 per
GPU); `refused` is the fraction of claims that found no room.
"""

from __future__ import annotations

import random
import tempfile
import uuid
from pathlib import Path
from typing import Any

from deviceplugin.alloc.plan import build_resources
from deviceplugin.config.parse import parse_config
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.dra.cdi import CdiWriter
from deviceplugin.dra.checkpoint import Checkpoint
from deviceplugin.dra.devices import DraDevice
from deviceplugin.dra.lock import SerialLock
from deviceplugin.dra.migdynamic import MigInstances
from deviceplugin.dra.partitions import gpu_counters
from deviceplugin.dra.prepare import ClaimRef, Driver
from deviceplugin.kube.dranames import driver_name
from deviceplugin.model.node import Gpu, NodeInfo
from deviceplugin.state import NodeState

ROOT = Path(__file__).resolve().parents[1]
DRIVER = driver_name("example.com")
NODE = "bench-h100"
PROFILES = {
    "1g.10gb": (1, 30),
    "1g.20gb": (1, 10),
    "2g.20gb": (2, 20),
    "3g.40gb": (3, 20),
    "4g.40gb": (4, 10),
    "7g.80gb": (7, 10),
}  # compute slices, weight
LIFETIME = 20  # mean steps a claim runs
GPUS = 8
SLICES = 7


def _fixed_layout() -> list[list[str]]:
    """The profiles of each MIG-enabled GPU (0-4) of the node `mig-mixed` serves, in index order."""
    node = SimulatedInventory.from_file(ROOT / "examples" / "nodes" / "8xA100-80GB-mig.yaml").discover()
    return [[m.profile for m in g.mig_devices] for g in node.gpus if g.mig_enabled]


def _stream(steps: int, seed: int) -> list[str]:
    """The arriving claims' profiles, one per step."""
    rng = random.Random(seed)
    names, weights = list(PROFILES), [w for _, w in PROFILES.values()]
    return [rng.choices(names, weights)[0] for _ in range(steps)]


class Dynamic:
    def __init__(self, directory: Path) -> None:
        gpus = tuple(
            Gpu(
                index=i,
                uuid=f"GPU-c41e9d27-55a0-4b1f-9e3d-{i:012d}",
                model="NVIDIA H100 80GB HBM3",
                memory_mib=81559,
                mig_capable=True,
                mig_enabled=True,
                compute_capability="9.0",
            )
            for i in range(GPUS)
        )
        self.inventory = SimulatedInventory(NodeInfo(gpus=gpus, name=NODE))
        config = parse_config({"version": "v1", "pools": [{"name": "dyn", "mode": "mig", "strategy": "dynamic"}]})
        self.driver = Driver(
            DRIVER,
            NODE,
            Checkpoint(directory / "claims"),
            CdiWriter(directory / "cdi", DRIVER),
            NodeState(),
            SerialLock(directory / "serialize.lock"),
            MigInstances(self.inventory, self.inventory.processes),
        )
        info = self.inventory.discover()
        self.driver.on_config(config, build_resources(config, info, dynamic_mig=True))
        self.devices: list[DraDevice] = self.driver.devices  # in published order: what first fit walks
        self.totals = {g.uuid: gpu_counters(g) for g in info.gpus}
        self.used: dict[str, dict[str, int]] = {g.uuid: {} for g in info.gpus}
        self.nvml_refused = 0

    def place(self, profile: str) -> tuple[Any, ...] | None:
        for device in self.devices:
            part = device.partition
            if part is None or part.profile.name != profile:
                continue
            used, totals = self.used[part.gpu.uuid], self.totals[part.gpu.uuid]
            wants = part.consumes()
            if all(used.get(k, 0) + v <= totals[k] for k, v in wants.items()):
                ref = ClaimRef("bench", f"c-{uuid.uuid4().hex[:8]}", str(uuid.uuid4()))
                body = {
                    "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
                    "status": {
                        "allocation": {
                            "devices": {
                                "results": [{"request": "mig", "driver": DRIVER, "pool": NODE, "device": device.name}]
                            }
                        }
                    },
                }
                try:
                    self.driver.prepare(ref, body)
                except Exception:
                    self.nvml_refused += 1
                    return None
                for k, v in wants.items():
                    used[k] = used.get(k, 0) + v
                return (ref, part.gpu.uuid, wants)
        return None

    def release(self, held: tuple[Any, ...]) -> None:
        ref, gpu, wants = held
        self.driver.unprepare(ref)
        for k, v in wants.items():
            self.used[gpu][k] -= v


class Fixed:
    def __init__(self) -> None:
        layouts = _fixed_layout()
        self.free = [list(layouts[i % len(layouts)]) for i in range(GPUS)]

    def place(self, profile: str) -> tuple[int, str] | None:
        for gpu, free in enumerate(self.free):
            if profile in free:
                free.remove(profile)
                return (gpu, profile)
        return None

    def release(self, held: tuple[int, str]) -> None:
        self.free[held[0]].append(held[1])


def _simulate(placer: Any, steps: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed + 1)  # the same departures for both placers
    arrivals = _stream(steps, seed)
    running: list[tuple[Any, int]] = []  # (held, compute slices)
    busy_sum = refused = 0
    refused_by: dict[str, int] = {}
    for profile in arrivals:
        leaving = [r for r in running if rng.random() < 1 / LIFETIME]
        for held, _ in leaving:
            placer.release(held)
        running = [r for r in running if r not in leaving]
        held = placer.place(profile)
        if held is None:
            refused += 1
            refused_by[profile] = refused_by.get(profile, 0) + 1
        else:
            running.append((held, PROFILES[profile][0]))
        busy_sum += sum(c for _, c in running)
    for held, _ in running:
        placer.release(held)
    return {
        "slices_used": round(busy_sum / (steps * GPUS * SLICES), 3),
        "refused": round(refused / steps, 3),
        "refused_by_profile": dict(sorted(refused_by.items())),
    }


def run(smoke: bool = False) -> dict:
    steps, seed = (200, 7) if smoke else (5000, 7)
    with tempfile.TemporaryDirectory() as directory:
        dynamic = Dynamic(Path(directory))
        dyn = _simulate(dynamic, steps, seed)
        dyn["nvml_refused"] = dynamic.nvml_refused
        dyn["instances_made"] = dynamic.driver.mig.made
        dyn["instances_left"] = sum(
            len(dynamic.inventory.mig_instances(g.uuid)) for g in dynamic.inventory.discover().gpus
        )
    fixed = _simulate(Fixed(), steps, seed)
    return {
        "node": "8x H100 80GB",
        "claims": steps,
        "mean_lifetime_steps": LIFETIME,
        "dynamic": dyn,
        "fixed_mig_mixed": fixed,
    }

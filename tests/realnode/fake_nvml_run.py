"""`gpu-share run` (or `mps`) over the project's fake NVML (tests/support/fake_pynvml.py): two Tesla T4s, or with
$FAKE_NVML_NODE=kinds a T4, an A100 80GB in MIG mode with two 3g.40gb instances and another T4; each GPU's
per-process memory (`nvmlDeviceGetComputeRunningProcesses`) is read from a JSON file the test writes,
{gpu uuid: [[pid, MiB]]}.

    python -m tests.realnode.fake_nvml_run PROCESSES.json run --kubeconfig ... (the rest of gpu-share's argv)
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

from tests.support.fake_pynvml import MIB, FakeGpu, FakeMig, FakeNvml

UUIDS = ("GPU-8a2f4c1d-3b5e-4f60-a7c8-0000000000a0", "GPU-8a2f4c1d-3b5e-4f60-a7c8-0000000000a1")
T4_MIB = 15360
KINDS = (
    "GPU-8a2f4c1d-3b5e-4f60-a7c8-0000000000b0",
    "GPU-8a2f4c1d-3b5e-4f60-a7c8-0000000000b1",
    "GPU-8a2f4c1d-3b5e-4f60-a7c8-0000000000b2",
)
MIGS = (
    "MIG-5c3d2e1f-0a9b-4c8d-8e7f-0000000000c1",
    "MIG-5c3d2e1f-0a9b-4c8d-8e7f-0000000000c2",
)  # GI 1 and 2 of KINDS[1]


def t4(uuid: str, slot: int) -> FakeGpu:
    return FakeGpu(
        uuid=uuid, name="Tesla T4", memory_mib=T4_MIB, bus_id=f"00000000:{0x3B + slot:02X}:00.0", capability=(7, 5)
    )


def gpus(layout: str) -> list[FakeGpu]:
    if layout == "kinds":
        migs = {i: FakeMig(uuid=u, profile="3g.40gb", memory_mib=40192, gi=i + 1) for i, u in enumerate(MIGS)}
        a100 = FakeGpu(
            uuid=KINDS[1], name="NVIDIA A100-SXM4-80GB", memory_mib=81920, bus_id="00000000:3C:00.0", mig=migs
        )
        return [t4(KINDS[0], 0), a100, t4(KINDS[2], 2)]
    return [t4(u, i) for i, u in enumerate(UUIDS)]


class FileProcesses(FakeNvml):
    """The fake NVML, with each GPU's processes read from a file at every call (the test is another process)."""

    def __init__(self, path: Path) -> None:
        super().__init__(gpus(os.environ.get("FAKE_NVML_NODE", "")))
        self.path = path

    def nvmlDeviceGetComputeRunningProcesses(self, handle):  # type: ignore[no-untyped-def]
        gpu = self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        try:
            table = json.loads(self.path.read_text())
        except (OSError, ValueError):
            table = {}
        return [
            types.SimpleNamespace(
                pid=pid, usedGpuMemory=mib * MIB, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
            )
            for pid, mib in table.get(gpu.uuid, [])
        ]


def main() -> int:
    sys.modules["pynvml"] = FileProcesses(Path(sys.argv[1]))
    from deviceplugin.cli.main import main as gpu_share

    return gpu_share(sys.argv[2:])


if __name__ == "__main__":
    raise SystemExit(main())

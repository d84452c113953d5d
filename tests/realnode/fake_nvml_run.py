"""`gpu-share run` over the project's fake NVML (tests/support/fake_pynvml.py): two Tesla T4s whose per-process
memory (`nvmlDeviceGetComputeRunningProcesses`) is read from a JSON file the test writes, {gpu uuid: [[pid, MiB]]}.

    python -m tests.realnode.fake_nvml_run PROCESSES.json run --kubeconfig ... (the rest of gpu-share's argv)
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

from tests.support.fake_pynvml import MIB, FakeGpu, FakeNvml

UUIDS = ("GPU-8a2f4c1d-3b5e-4f60-a7c8-0000000000a0", "GPU-8a2f4c1d-3b5e-4f60-a7c8-0000000000a1")
T4_MIB = 15360


class FileProcesses(FakeNvml):
    """The fake NVML, with each GPU's processes read from a file at every call (the test is another process)."""

    def __init__(self, path: Path) -> None:
        gpus = [FakeGpu(uuid=u, name="Tesla T4", memory_mib=T4_MIB, bus_id=f"00000000:{0x3B + i:02X}:00.0", capability=(7, 5)) for i, u in enumerate(UUIDS)]
        super().__init__(gpus)
        self.path = path

    def nvmlDeviceGetComputeRunningProcesses(self, handle):  # type: ignore[no-untyped-def]
        gpu = self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        try:
            table = json.loads(self.path.read_text())
        except (OSError, ValueError):
            table = {}
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=mib * MIB, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF) for pid, mib in table.get(gpu.uuid, [])]


def main() -> int:
    sys.modules["pynvml"] = FileProcesses(Path(sys.argv[1]))
    from deviceplugin.cli.main import main as gpu_share

    return gpu_share(sys.argv[2:])


if __name__ == "__main__":
    raise SystemExit(main())

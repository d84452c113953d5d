"""`gpu-share run` over the fake NVML (tests/support/fake_pynvml.py) with faults a test in another process controls:
two Tesla T4s, and a JSON file read at every event wait and recovery-action read,

    {"xids": [[gpu index, xid], ...], "recovery": {"<gpu index>": NVML recovery action}}

Each `xids` entry is delivered once per process (by its position); a GPU absent from `recovery` does not support
the recovery-action field, as on drivers before R550.

    python -m tests.support.fake_nvml_faults FAULTS.json run ... (the rest of gpu-share's argv)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pynvml as real

from tests.support.fake_pynvml import FakeGpu, FakeNvml

UUIDS = ("GPU-5e1d0c2a-7b3f-4e81-9d2c-0000000000b0", "GPU-5e1d0c2a-7b3f-4e81-9d2c-0000000000b1")
T4_MIB = 15360


class FileFaults(FakeNvml):
    def __init__(self, path: Path) -> None:
        gpus = [
            FakeGpu(
                uuid=u, name="Tesla T4", memory_mib=T4_MIB, bus_id=f"00000000:{0x3B + i:02X}:00.0", capability=(7, 5)
            )
            for i, u in enumerate(UUIDS)
        ]
        super().__init__(gpus)
        self.path = path
        self.delivered = 0  # xids entries already delivered

    def _faults(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):  # type: ignore[no-untyped-def]
        xids = self._faults().get("xids", [])
        for index, xid in xids[self.delivered :]:
            self.xid(index, xid)
        self.delivered = max(self.delivered, len(xids))
        return super().nvmlEventSetWait_v2(event_set, timeout_ms)

    def nvmlDeviceGetFieldValues(self, handle, field_ids):  # type: ignore[no-untyped-def]
        action = self._faults().get("recovery", {}).get(str(handle.gpu))
        self.gpus[handle.gpu].recovery_action = action
        return super().nvmlDeviceGetFieldValues(handle, field_ids)


def write_faults(path: Path, xids: Sequence[tuple[int, int]] = (), recovery: dict[int, int] | None = None) -> None:
    """The test's side: what the driver reports from now on (written atomically: the plugin reads it any time)."""
    tmp = path.with_name(path.name + ".tmp")
    body = {"xids": [list(x) for x in xids], "recovery": {str(i): a for i, a in (recovery or {}).items()}}
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


RESET_REQUIRED = real.NVML_GPU_RECOVERY_ACTION_GPU_RESET
NONE = real.NVML_GPU_RECOVERY_ACTION_NONE


def main() -> int:
    sys.modules["pynvml"] = FileFaults(Path(sys.argv[1]))
    from deviceplugin.cli.main import main as gpu_share

    return gpu_share(sys.argv[2:])


if __name__ == "__main__":
    raise SystemExit(main())

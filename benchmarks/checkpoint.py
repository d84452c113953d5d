"""Peak memory to read the kubelet's checkpoint (`kubelet_internal_checkpoint`): files of 1 MiB (a full node), just
under the read bound, and 10, 30 and 60 MiB (an attacker's, or a damaged one), each read in a fresh process. Prints
the peak RSS over idle (VmHWM after `clear_refs`) and what the read answered (holds, or refused: unknown), for the
streamed reader and, for contrast, for `json.loads` of the whole file as the reader did before.

    python -m benchmarks.checkpoint
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from deviceplugin.agent import holds
from deviceplugin.api import deviceplugin_pb2 as pb

MIB = 1024 * 1024
GPUS = [f"GPU-{uuid.UUID(int=i)}" for i in range(8)]
SIZES_MIB = (1, holds.MAX_CHECKPOINT_BYTES / MIB - 0.1, 10, 30, 60)

_CHILD = """
import json, sys, time
from pathlib import Path
from deviceplugin.agent import holds

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise RuntimeError(key)

path, how, ours = Path(sys.argv[1]), sys.argv[2], set(json.loads(sys.argv[3]))
Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here on
idle = status("VmRSS:")
try:
    if how == "streamed":
        answer = f"{len(holds.read_checkpoint(path, lambda u: u in ours))} holds"
    else:
        entries = json.loads(path.read_bytes())["Data"]["PodDeviceEntries"]
        answer = f"{len(entries)} entries parsed"
except holds.HoldsUnknown as err:
    answer = "refused (unknown): " + str(err).split("kubelet_internal_checkpoint ", 1)[-1]
print(
    json.dumps({"idle_mib": round(idle, 1), "peak_over_idle_mib": round(status("VmHWM:") - idle, 1), "answer": answer})
)
"""


def _write(path: Path, size: int) -> None:
    """A checkpoint in the kubelet's JSON of share containers on this node's GPUs, `size` bytes or a little over."""
    envs = {
        "GPU_SHARE_TOTAL": "8",
        "NVIDIA_VISIBLE_DEVICES": GPUS[0],
        "CUDA_MPS_PIPE_DIRECTORY": "/run/gpu-share/mps/pool",
    }
    answer = base64.b64encode(pb.ContainerAllocateResponse(envs=envs).SerializeToString()).decode()
    with open(path, "w") as file:
        file.write('{"Data":{"PodDeviceEntries":[')
        written, i = 0, 0
        while written < size:
            entry = {
                "PodUID": str(uuid.UUID(int=i)),
                "ContainerName": f"c{i}",
                "ResourceName": "example.com/gpu-share",
                "DeviceIDs": {"0": [f"{GPUS[i % 8]}::{i // 8}"]},
                "AllocResp": answer,
            }
            written += file.write(("," if i else "") + json.dumps(entry, separators=(",", ":")))
            i += 1
        file.write('],"RegisteredDevices":{}},"Checksum":0}')


def _measure(path: Path, how: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), how, json.dumps(GPUS)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout)


def run(smoke: bool = False) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in SIZES_MIB[:2] if smoke else SIZES_MIB:
            path = Path(tmp) / "kubelet_internal_checkpoint"
            _write(path, int(size * MIB))
            for how in ("streamed", "json.loads whole"):
                rows.append({"file_mib": round(path.stat().st_size / MIB, 1), "reader": how, **_measure(path, how)})
            path.unlink()
    return {
        "read_bound_mib": holds.MAX_CHECKPOINT_BYTES / MIB,
        "max_entries": holds.MAX_ENTRIES,
        "max_entry_bytes": holds.MAX_ENTRY_BYTES,
        "rows": rows,
    }


if __name__ == "__main__":
    result = run(smoke="--smoke" in sys.argv)
    print(
        f"read bound {result['read_bound_mib']:.0f} MiB, {result['max_entries']} "
        f"entries, {result['max_entry_bytes']} bytes per entry"
    )
    for row in result["rows"]:
        print(
            f"{row['file_mib']:6.1f} MiB  {row['reader']:17s} idle {row['idle_mib']:6.1f} MiB  peak "
            f"+{row['peak_over_idle_mib']:6.1f} MiB  {row['answer']}"
        )

"""Shared helpers: a generated node, the plugin as a real subprocess, process readings from /proc."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from deviceplugin.sim.kubelet import KubeletSimulator


def node_file(directory: Path, gpus: int = 8, memory_mib: int = 81559) -> Path:
    path = directory / "node.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": f"bench-{gpus}gpu",
                "gpus": [
                    {
                        "index": i,
                        "uuid": f"GPU-bench000-0000-4000-8000-{i:012d}",
                        "model": "NVIDIA H100 80GB HBM3",
                        "memoryMiB": memory_mib,
                        "numaNode": i * 2 // gpus,
                    }
                    for i in range(gpus)
                ],
            }
        )
    )
    return path


def config_file(directory: Path, replicas: int) -> Path:
    path = directory / "config.yaml"
    path.write_text(
        yaml.safe_dump({"version": "v1", "pools": [{"name": "bench", "mode": "shared", "replicas": replicas}]})
    )
    return path


@contextmanager
def plugin_process(gpus: int = 8, replicas: int = 64, extra: tuple[str, ...] = ()):
    """A kubelet simulator here and `gpu-share run` as a subprocess, registered; yields (kubelet, process, dir)."""
    with tempfile.TemporaryDirectory(prefix="gsb-", dir="/tmp") as tmp:
        directory = Path(tmp)
        kubelet = KubeletSimulator(directory / "dp")
        kubelet.start()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deviceplugin.cli",
                "run",
                "--node",
                str(node_file(directory, gpus)),
                "--config",
                str(config_file(directory, replicas)),
                "--plugin-dir",
                str(directory / "dp"),
                "--pod-resources-socket",
                str(kubelet.pod_resources_socket),
                "--log-level",
                "warning",
                "--metrics-port",
                "0",
                *extra,
            ],
            stderr=subprocess.DEVNULL,
        )
        try:
            if not kubelet.wait_for(
                lambda st: "example.com/gpu-share" in st and st["example.com/gpu-share"].allocatable > 0, timeout=30
            ):
                raise RuntimeError("the plugin did not register within 30 s")
            yield kubelet, process, directory
        finally:
            process.terminate()
            process.wait(15)
            kubelet.stop()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise RuntimeError("no Threads")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def summary_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
        "n": len(ms),
    }


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started

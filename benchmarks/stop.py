"""Stop: SIGTERM -> process exit of `gpu-share run` (a real subprocess) with the kubelet's ListAndWatch open.

A DaemonSet rolling update waits for the old pod to exit before the new one registers, so this is node downtime.
Each round starts the plugin beside the built-in kubelet, waits until it registered, the kubelet's stream has had
its first list and start-up is over, then sends SIGTERM and times the exit (a pidfd: no polling interval in the
figure). Backends:

- simulated: the node from a file, metrics port on, no API access;
- simulated_api: the same with the tests' fake Kubernetes API (labels, annotation, pod list), as the DaemonSet runs;
- nvml: the NVML backend over the tests' fake pynvml (its event wait blocks like the driver's).

`--api dra` is not measured here: it needs a real API server (ResourceSlices); tests/e2e drive it.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deviceplugin.sim.kubelet import KubeletSimulator

from .common import config_file, cpu_seconds, node_file, summary_ms
from .kubelet_link import _fake_api

ROOT = Path(__file__).resolve().parent.parent
RESOURCE = "example.com/gpu-share"
EXIT_TIMEOUT = 15.0

# The `gpu-share` command with the tests' fake pynvml in place of the driver's binding: 8 T4s.
NVML_LAUNCHER = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests.support.fake_pynvml import FakeGpu, FakeNvml
sys.modules["pynvml"] = FakeNvml(
    [
        FakeGpu(uuid=f"GPU-t4-{{i}}", name="Tesla T4", memory_mib=15360, bus_id=f"00000000:{{0x3B + i:02X}}:00.0")
        for i in range(8)
    ]
)
from deviceplugin.cli.main import main
sys.exit(main())
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _listed(status: dict) -> bool:
    """Registered, and the kubelet's ListAndWatch has had its first list."""
    resource = status.get(RESOURCE)
    return resource is not None and resource.registered and resource.allocatable > 0 and resource.messages > 0


def _settle(pid: int, timeout: float = 20.0) -> None:
    """Wait until start-up is over (the parts that load after registration): the process idles, using under 10 ms
    of CPU in 200 ms. A stop during start-up is another measurement."""
    deadline = time.monotonic() + timeout
    used = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        used, before = cpu_seconds(pid), used
        if used - before < 0.01:
            return
    raise RuntimeError(f"the plugin did not settle within {timeout:.0f} s of registering")


def _exit_seconds(process: subprocess.Popen) -> tuple[float, int]:
    """SIGTERM, then the seconds until the process exited (woken by its pidfd) and its exit status."""
    pidfd = os.pidfd_open(process.pid)
    try:
        started = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        readable, _, _ = select.select([pidfd], [], [], EXIT_TIMEOUT)
        elapsed = time.perf_counter() - started
    finally:
        os.close(pidfd)
    if not readable:
        process.kill()
        process.wait()
        raise RuntimeError(f"the plugin did not exit within {EXIT_TIMEOUT:.0f} s of SIGTERM")
    return elapsed, process.wait()


def _rounds(backend: str, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gsb-", dir="/tmp") as tmp, _fake_api() as (api, kubeconfig):
        directory = Path(tmp)
        kubelet = KubeletSimulator(directory / "dp")
        kubelet.start()
        env = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
        command = [sys.executable, "-m", "deviceplugin.cli"]
        extra = ["--node", str(node_file(directory, 8))]
        if backend == "nvml":
            command, extra = [sys.executable, "-c", NVML_LAUNCHER], []
        elif backend == "simulated_api":
            env["NODE_NAME"] = api.node_name
            extra += ["--kubeconfig", str(kubeconfig)]
        times, statuses = [], set()
        try:
            for _ in range(rounds):
                process = subprocess.Popen(
                    [
                        *command,
                        "run",
                        *extra,
                        "--config",
                        str(config_file(directory, 10)),
                        "--plugin-dir",
                        str(directory / "dp"),
                        "--pod-resources-socket",
                        str(kubelet.pod_resources_socket),
                        "--log-level",
                        "warning",
                        "--metrics-port",
                        str(_free_port()),
                        "--metrics-bind-address",
                        "127.0.0.1",
                    ],
                    stderr=subprocess.DEVNULL,
                    env=env,
                )
                try:
                    if not kubelet.wait_for(_listed, timeout=30):
                        raise RuntimeError(f"{backend}: the plugin did not register and list its devices within 30 s")
                    _settle(process.pid)
                    elapsed, status = _exit_seconds(process)
                finally:
                    if process.poll() is None:
                        process.kill()
                        process.wait()
                times.append(elapsed)
                statuses.add(status)
                kubelet.wait_for(lambda st: not st[RESOURCE].registered, timeout=5)  # the kubelet saw the stream end
        finally:
            kubelet.stop()
    return {**summary_ms(times), "exit_status": ",".join(map(str, sorted(statuses)))}


def run(smoke: bool = False) -> dict:
    rounds = 2 if smoke else 10
    return {
        "rounds": rounds,
        "sigterm_to_exit": {backend: _rounds(backend, rounds) for backend in ("simulated", "simulated_api", "nvml")},
    }

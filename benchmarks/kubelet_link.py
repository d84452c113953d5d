"""The kubelet link when leaned on, with `gpu-share run` as a real subprocess beside the built-in kubelet:

- startup: exec -> Register received (8 GPUs x 10 shares), and resident memory alone and with API + metrics;
- streams: Allocate latency quiet, then while 1,000 ListAndWatch streams are opened and dropped and 50 held open;
- storm: kubelet restarts at random 0-0.6 s gaps: registered at the end, accepted Registers per kubelet
  generation, and the plugin's RSS, threads and fds before and after.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from deviceplugin.api import deviceplugin_pb2 as pb
from deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from deviceplugin.sim.kubelet import KubeletSimulator

from .common import config_file, cpu_seconds, node_file, plugin_process, rss_mib, summary_ms, timed

RESOURCE = "example.com/gpu-share"


def _threads_and_fds(pid: int) -> tuple[int, int]:
    threads = int(Path(f"/proc/{pid}/status").read_text().split("Threads:")[1].split()[0])
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def wait_register(kubelet: KubeletSimulator, before: int, timeout: float = 30.0, after: float = 0.0) -> float:
    """time.time() of the first Register past the first `before` that arrived at or after `after`."""
    deadline = time.monotonic() + timeout
    while True:
        arrived = [t for t in kubelet.register_times[before:] if t >= after]
        if arrived:
            return arrived[0]
        if time.monotonic() > deadline:
            raise RuntimeError(f"no Register within {timeout:.0f} s")
        time.sleep(0.0005)


@contextmanager
def _fake_api():
    """The tests' fake Kubernetes API (real HTTP), for the full-configuration footprint."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.support.fake_kube import FakeKube

    api = FakeKube().start()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            yield api, api.write_kubeconfig(Path(tmp) / "kubeconfig")
        finally:
            api.stop()


def startup(smoke: bool) -> dict:
    starts = 3 if smoke else 15
    with tempfile.TemporaryDirectory(prefix="gsb-", dir="/tmp") as tmp:
        directory = Path(tmp)
        kubelet = KubeletSimulator(directory / "dp")
        kubelet.start()
        node, config = node_file(directory, 8), config_file(directory, 10)

        def launch(env: dict[str, str], *extra: str) -> tuple[float, float, float]:
            before = len(kubelet.register_times)
            started = time.time()
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "deviceplugin.cli",
                    "run",
                    "--node",
                    str(node),
                    "--config",
                    str(config),
                    "--plugin-dir",
                    str(directory / "dp"),
                    "--pod-resources-socket",
                    str(kubelet.pod_resources_socket),
                    "--log-level",
                    "warning",
                    *extra,
                ],
                stderr=subprocess.DEVNULL,
                env=env,
            )
            try:
                registered = wait_register(kubelet, before) - started
                cpu = cpu_seconds(process.pid)  # read at once: the process works on after registering
                time.sleep(1.5)  # the rest loads after registration: measure once it has
                return registered, rss_mib(process.pid), cpu
            finally:
                process.terminate()
                process.wait(15)

        alone = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
        runs = [launch(alone, "--metrics-port", "0") for _ in range(starts)]
        with _fake_api() as (api, kubeconfig):
            full = launch(
                {**alone, "NODE_NAME": api.node_name}, "--metrics-port", "19410", "--kubeconfig", str(kubeconfig)
            )
        kubelet.stop()
    registered_ms = [r[0] * 1000 for r in runs]
    return {
        "starts": starts,
        "exec_to_register_median_ms": round(statistics.median(registered_ms), 1),
        "exec_to_register_max_ms": round(max(registered_ms), 1),
        "cpu_until_register_median_ms": round(statistics.median(r[2] * 1000 for r in runs), 1),
        "rss_alone_mib": round(statistics.median(r[1] for r in runs), 1),
        "rss_full_mib": round(full[1], 1),
        "note": "alone: no API access, no metrics port; full: fake API (labels, annotation, pod list) + metrics "
        "port, as the DaemonSet runs",
    }


def _allocate_latency(stub: pb_grpc.DevicePluginStub, ids: list[str], rounds: int) -> tuple[list[float], list[float]]:
    floor, allocate = [], []
    for i in range(rounds):
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[ids[i % len(ids)]])])
        floor.append(timed(lambda: stub.PreStartContainer(pb.PreStartContainerRequest())))
        allocate.append(timed(lambda: stub.Allocate(request)))
    return floor, allocate


def streams(smoke: bool) -> dict:
    dropped, held, rounds = (50, 10, 100) if smoke else (1000, 50, 1000)
    with plugin_process(gpus=8, replicas=64) as (kubelet, _, directory):
        socket = next((directory / "dp").glob("gpu-share-*.sock"))
        registers = len(kubelet.register_requests)
        stub = kubelet.stub(RESOURCE)
        ids = kubelet.resources()[RESOURCE].healthy
        _allocate_latency(stub, ids, 50)  # warm up
        quiet_floor, quiet = _allocate_latency(stub, ids, rounds)
        import grpc

        with grpc.insecure_channel(f"unix:{socket}") as channel:
            other = pb_grpc.DevicePluginStub(channel)
            kept = [other.ListAndWatch(pb.Empty()) for _ in range(held)]
            assert all(next(s).devices for s in kept)
            for _ in range(dropped):
                stream = other.ListAndWatch(pb.Empty())
                next(stream)
                stream.cancel()
            _, loaded = _allocate_latency(stub, ids, rounds)
            for s in kept:
                s.cancel()
        time.sleep(0.5)
        extra_registers = len(kubelet.register_requests) - registers
    q, after = summary_ms(quiet), summary_ms(loaded)
    floor = summary_ms(quiet_floor)
    return {
        "streams_dropped": dropped,
        "streams_held": held,
        "floor_empty_call": floor,
        "allocate_quiet": q,
        "allocate_after_streams": after,
        "p99_after_over_quiet": round(after["p99_ms"] / q["p99_ms"], 2),
        "allocate_p50_over_floor_p50": round(q["p50_ms"] / floor["p50_ms"], 2),
        "extra_register_calls": extra_registers,
    }


def storm(smoke: bool) -> dict:
    restarts = 10 if smoke else 500
    rng = random.Random(5)
    with plugin_process(gpus=8, replicas=10) as (kubelet, process, _):
        time.sleep(1.0)
        rss_before, (threads_before, fds_before) = rss_mib(process.pid), _threads_and_fds(process.pid)
        gaps = []
        for _ in range(restarts):
            kubelet.restart()
            gaps.append(rng.uniform(0, 0.6))
            time.sleep(gaps[-1])
        settled = kubelet.wait_for(lambda st: st[RESOURCE].registered and st[RESOURCE].allocatable == 80, timeout=10)
        time.sleep(1.0)
        rss_after, (threads_after, fds_after) = rss_mib(process.pid), _threads_and_fds(process.pid)
        accepted = kubelet.accepted_registrations()
        first_generation = min(g for g, _ in accepted)
    # Generation first+1+i lived gaps[i] seconds; one that lived 50 ms or more must have got its Register.
    settled_generations = [first_generation + 1 + i for i, gap in enumerate(gaps) if gap >= 0.05]
    missed = [g for g in settled_generations if (g, RESOURCE) not in accepted]
    return {
        "restarts": restarts,
        "registered_at_the_end": settled,
        "generations_lasting_50ms_or_more": len(settled_generations),
        "of_those_without_a_registration": len(missed),
        "max_accepted_registers_per_generation": max(accepted.values()),
        "register_calls_received": len(kubelet.register_requests),
        "rss_growth_mib": round(rss_after - rss_before, 1),
        "threads_before_after": f"{threads_before}/{threads_after}",
        "fds_before_after": f"{fds_before}/{fds_after}",
    }


def run(smoke: bool = False) -> dict:
    return {"startup": startup(smoke), "streams": streams(smoke), "storm": storm(smoke)}

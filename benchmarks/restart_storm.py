"""Kubelet restart storms: `gpu-share run` as a real subprocess serving three resources, the built-in kubelet
restarted (every socket deleted, kubelet.sock recreated) in storms of quick restarts, over real gRPC on real Unix
sockets. Reported: the plugin's peak RSS (VmHWM, and VmRSS sampled every 20 ms), its threads and fds, and per
kubelet start the time until every resource was registered with it again.

    python -m benchmarks.restart_storm                 # 20 storms of 10 restarts
    python -m benchmarks.restart_storm --storms 5 --gap 0.3

Targets (issue 31): RSS <= 120 MiB, every resource re-registered within 1 s of each kubelet start. A kubelet that
lives less than that before the next restart cannot miss the target; it counts only if it lived over 1 s unregistered.

`--churn SECONDS` isolates the trigger instead: Register calls, three at a time, from a fresh process against a
kubelet.sock whose server (another process) restarts every 0-50 ms; the client's peak RSS with
- `first_design`: a channel per attempt with gRPC's default retries, as the plugin registered before issue 31;
- `per_attempt_no_retries`: a channel per attempt with the plugin's channel options (`grpc.enable_retries` 0);
- `plugin`: the plugin's RegistrationChannel (one channel per kubelet instance, retries off).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from deviceplugin.sim.kubelet import KubeletSimulator

from .common import node_file, open_fds, threads

CLIENTS = ("first_design", "per_attempt_no_retries", "plugin")
RESOURCES = ("example.com/gpu", "example.com/gpu-share", "example.com/gpu-quarter")
POOLS = [
    {"name": "whole", "mode": "exclusive", "resource": "gpu", "gpus": {"indexes": [0, 1]}},
    {"name": "tenth", "mode": "shared", "resource": "gpu-share", "replicas": 10, "gpus": {"indexes": [2, 3, 4]}},
    {"name": "quarter", "mode": "shared", "resource": "gpu-quarter", "replicas": 4},
]
TARGET_RSS_MIB = 120
TARGET_REGISTER_S = 1.0
SETTLE_TIMEOUT = 30.0  # after a storm, the last kubelet waits this long for every resource


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key}")


class RssSampler(threading.Thread):
    """VmRSS of `pid` every `interval` seconds; `peak_mib` is the largest seen."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_mib = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            try:
                self.peak_mib = max(self.peak_mib, _status_kib(self.pid, "VmRSS") / 1024)
            except (OSError, RuntimeError):
                return


def _all_registered(kubelet: KubeletSimulator) -> bool:
    return kubelet.wait_for(
        lambda st: all(r in st and st[r].registered and st[r].allocatable > 0 for r in RESOURCES), timeout=0
    )


def storms(
    storm_count: int, restarts: int, gap: tuple[float, float], seed: int = 31, env: dict[str, str] | None = None
) -> dict:
    """`storm_count` storms of `restarts` kubelet restarts at uniform `gap` seconds apart; after each, the last
    kubelet is given SETTLE_TIMEOUT for every resource to register, then 0.5 s of calm."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="gss-", dir="/tmp") as tmp:
        directory = Path(tmp)
        kubelet = KubeletSimulator(directory / "dp")
        kubelet.start()
        config = directory / "config.yaml"
        config.write_text(yaml.safe_dump({"version": "v1", "domain": "example.com", "pools": POOLS}))
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deviceplugin.cli",
                "run",
                "--node",
                str(node_file(directory, 8)),
                "--config",
                str(config),
                "--plugin-dir",
                str(directory / "dp"),
                "--pod-resources-socket",
                str(kubelet.pod_resources_socket),
                "--log-level",
                "warning",
                "--metrics-port",
                "0",
            ],
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        sampler = RssSampler(process.pid)
        try:
            if not kubelet.wait_for(lambda st: all(r in st and st[r].registered for r in RESOURCES), timeout=30):
                raise RuntimeError("the plugin did not register every resource within 30 s")
            time.sleep(1.0)
            sampler.start()
            rss_start = _status_kib(process.pid, "VmRSS") / 1024
            threads_start, fds_start = threads(process.pid), open_fds(process.pid)
            unsettled, storm_peaks, threads_max, fds_max = 0, [], threads_start, fds_start
            for _ in range(storm_count):
                for _ in range(restarts):
                    kubelet.restart()
                    time.sleep(rng.uniform(*gap))
                    threads_max, fds_max = max(threads_max, threads(process.pid)), max(fds_max, open_fds(process.pid))
                if not kubelet.wait_for(
                    lambda st: all(r in st and st[r].registered for r in RESOURCES), timeout=SETTLE_TIMEOUT
                ):
                    unsettled += 1
                storm_peaks.append(round(sampler.peak_mib, 1))
                time.sleep(0.5)
            time.sleep(1.0)
            rss_end = _status_kib(process.pid, "VmRSS") / 1024
            hwm = _status_kib(process.pid, "VmHWM") / 1024
            threads_end, fds_end = threads(process.pid), open_fds(process.pid)
            all_registered = _all_registered(kubelet)
        finally:
            sampler.done.set()
            process.terminate()
            process.wait(15)
            kubelet.stop()
    # Per kubelet generation: the time from its start until its last resource registered; a generation replaced
    # first counts with its lifetime (it was unregistered that long).
    generations = sorted(kubelet.started_at)[1:]  # the first is the one the plugin started against
    gaps, over, slowest = [], 0, ""
    for g in generations:
        began = kubelet.started_at[g]
        ended = kubelet.started_at.get(g + 1, float("inf"))
        accepted = {r: kubelet.first_accepted_at.get((g, r)) for r in RESOURCES}
        done = [a for a in accepted.values() if a is not None]
        gap_s = min(max(done) if len(done) == len(RESOURCES) else ended, began + SETTLE_TIMEOUT) - began
        if not gaps or gap_s > max(gaps):
            slowest = ", ".join(
                f"{r.split('/')[1]} {'-' if a is None else round((a - began) * 1000, 1)}" for r, a in accepted.items()
            )
            slowest += (
                f" ms (kubelet lived {'to the end' if ended == float('inf') else f'{(ended - began) * 1000:.0f} ms'})"
            )
        gaps.append(gap_s)
        over += gap_s > TARGET_REGISTER_S
    return {
        "storms": storm_count,
        "restarts_per_storm": restarts,
        "gap_s": f"{gap[0]}-{gap[1]}",
        "resources": len(RESOURCES),
        "rss_start_mib": round(rss_start, 1),
        "rss_end_mib": round(rss_end, 1),
        "rss_max_mib": round(max(hwm, sampler.peak_mib), 1),
        "rss_max_per_storm_mib": " ".join(map(str, storm_peaks)),
        "threads_start_max_end": f"{threads_start}/{threads_max}/{threads_end}",
        "fds_start_max_end": f"{fds_start}/{fds_max}/{fds_end}",
        "kubelet_starts": len(gaps),
        "start_to_all_registered_max_ms": round(max(gaps) * 1000, 1),
        "start_to_all_registered_median_ms": round(sorted(gaps)[len(gaps) // 2] * 1000, 1),
        "starts_over_100ms": sum(g > 0.1 for g in gaps),
        "slowest_start_per_resource": slowest,
        "starts_unregistered_over_1s": over,
        "storms_not_settled_in_30s": unsettled,
        "registered_at_the_end": all_registered,
        "register_calls_received": len(kubelet.register_requests),
        "targets": f"rss_max_mib <= {TARGET_RSS_MIB}, starts_unregistered_over_1s == 0",
    }


def _flapping_kubelet(socket: Path) -> None:
    """A Registration server on `socket` that stops (cancelling its calls) and starts again every 0-50 ms, forever."""
    from concurrent import futures

    import grpc

    from deviceplugin.api import deviceplugin_pb2 as pb
    from deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc

    class Registration(pb_grpc.RegistrationServicer):
        def Register(self, request, context):
            time.sleep(random.uniform(0, 0.02))  # the real kubelet dials the plugin back before it answers
            return pb.Empty()

    while True:
        executor = futures.ThreadPoolExecutor(max_workers=4)
        server = grpc.server(executor)
        pb_grpc.add_RegistrationServicer_to_server(Registration(), server)
        socket.unlink(missing_ok=True)
        server.add_insecure_port(f"unix:{socket}")
        server.start()
        time.sleep(random.uniform(0, 0.05))
        server.stop(0).wait()
        executor.shutdown(wait=False)


def _churn_client(socket: Path, seconds: float, client: str) -> dict:
    """Register calls, three at a time, for `seconds`, as `client` (one of CLIENTS) makes them."""
    import asyncio

    import grpc
    import grpc.aio

    from deviceplugin.api import deviceplugin_pb2 as pb
    from deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
    from deviceplugin.plugin.registration import CHANNEL_OPTIONS, RegistrationChannel
    from deviceplugin.plugin.server import kubelet_identity

    shared = RegistrationChannel(socket)
    request = pb.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name="example.com/x")
    counts = {"attempts": 0, "channels": 0}
    per_attempt = {
        "first_design": (("grpc.use_local_subchannel_pool", 1),),
        "per_attempt_no_retries": CHANNEL_OPTIONS,
    }.get(client)

    async def attempt() -> None:
        identity = kubelet_identity(socket)
        if identity is None:
            return
        counts["attempts"] += 1
        try:
            if per_attempt is not None:
                counts["channels"] += 1
                async with grpc.aio.insecure_channel(f"unix:{socket}", options=per_attempt) as channel:
                    await pb_grpc.RegistrationStub(channel).Register(request, timeout=2)
            else:
                await shared.register(request, identity, 2)
        except (grpc.aio.AioRpcError, RuntimeError):
            pass

    async def main() -> float:
        peak, deadline = 0.0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            await asyncio.gather(attempt(), attempt(), attempt())
            peak = max(peak, _status_kib(os.getpid(), "VmRSS") / 1024)
        await shared.close()
        return peak

    peak = asyncio.run(main())
    channels = counts["channels"] if per_attempt is not None else shared.opened
    return {
        "attempts": counts["attempts"],
        "channels": channels,
        "rss_max_mib": round(peak, 1),
        "rss_end_mib": round(_status_kib(os.getpid(), "VmRSS") / 1024, 1),
    }


def churn(seconds: float) -> dict:
    """The churn comparison: each client in a fresh process, against the same flapping kubelet."""
    with tempfile.TemporaryDirectory(prefix="gsc-", dir="/tmp") as tmp:
        socket = Path(tmp) / "kubelet.sock"
        flapping = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.restart_storm", "--flap", str(socket)], stderr=subprocess.DEVNULL
        )
        try:
            result = {}
            for name in CLIENTS:
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.restart_storm",
                        "--churn",
                        str(seconds),
                        "--socket",
                        str(socket),
                        "--client",
                        name,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=seconds + 60,
                    check=True,
                ).stdout
                result[name] = json.loads(out)
        finally:
            flapping.kill()
            flapping.wait(10)
    return {"seconds": seconds, **result}


def run(smoke: bool = False) -> dict:
    storm = storms(2, 5, (0.05, 0.3)) if smoke else storms(20, 10, (0.05, 0.5))
    return {**storm, "churn": churn(2 if smoke else 60)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storms", type=int, default=20)
    parser.add_argument("--restarts", type=int, default=10, help="restarts per storm")
    parser.add_argument(
        "--gap", type=float, nargs=2, default=(0.05, 0.5), metavar=("MIN", "MAX"), help="seconds between restarts"
    )
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--churn", type=float, metavar="SECONDS", help="run the channel-churn comparison instead")
    parser.add_argument("--flap", type=Path, help=argparse.SUPPRESS)  # the churn's flapping kubelet, on this socket
    parser.add_argument("--socket", type=Path, help=argparse.SUPPRESS)  # with --client: one churn client
    parser.add_argument("--client", choices=CLIENTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.flap:
        _flapping_kubelet(args.flap)
    elif args.client:
        print(json.dumps(_churn_client(args.socket, args.churn, args.client)))
    elif args.churn:
        print(json.dumps(churn(args.churn), indent=1))
    else:
        print(json.dumps(storms(args.storms, args.restarts, tuple(args.gap), args.seed), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""NodePrepareResources latency of the DRA driver for one claim, the claim already in the watch cache.

The kubelet plugin runs in this process on real Unix sockets, reading claims from memory as a warm cache serves
them (no API server is contacted), with the real checkpoint (fsync) and CDI spec writes, in a temporary directory. A
gRPC client calls as the kubelet does: one claim per call, then NodeUnprepareResources, with 100 other claims prepared
beside it. Target: p50 <= 5 ms. `prepare_again_while_a_read_hangs`: the same repeat prepares while another pod's claim
read hangs in the API (the kubelet calls per pod; that claim must not delay these). `prepare_with_sharing_config`: first
prepares of claims that carry a SharingConfig from their class and their own (parsed, picked per request, checked
against the shares; docs/dra.md#sharing-chosen-per-claim-sharingconfig).

It runs twice: with the driver's directory on the disk of /tmp (a prepare waits for one fsync of its checkpoint
record, so the disk's fsync latency, measured alongside, is part of the figure) and on /dev/shm (a tmpfs, where
fsync costs nothing: the driver's own cost).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import grpc

from deviceplugin.alloc.plan import build_resources
from deviceplugin.api import dra_v1_pb2 as pb
from deviceplugin.api import dra_v1_pb2_grpc as pb_grpc
from deviceplugin.config.parse import parse_config
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.dra.cdi import CdiWriter
from deviceplugin.dra.checkpoint import Checkpoint
from deviceplugin.dra.kubeletplugin import KubeletPlugin
from deviceplugin.dra.lock import SerialLock
from deviceplugin.dra.prepare import Driver
from deviceplugin.dra.registration import PluginPaths
from deviceplugin.dra.sharingconfig import api_version
from deviceplugin.kube.dranames import driver_name
from deviceplugin.state import NodeState

from .common import node_file, summary_ms, timed

DRIVER = driver_name("example.com")
NODE = "bench-node"
BESIDE = 100


def _claim(index: int, gpus: int) -> dict[str, Any]:
    result = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": NODE,
        "device": f"gpu-{index % gpus}",
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"shares": "1"},
    }
    return {
        "metadata": {"namespace": "bench", "name": f"claim-{index}", "uid": str(uuid.uuid4())},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def _with_sharing_config(body: dict[str, Any]) -> dict[str, Any]:
    """The claim with a class config and its own (the last applies: 2 % of the GPU's threads, what 1 of 48 shares
    give)."""

    def config(percent: int, source: str) -> dict[str, Any]:
        mps = {"strategy": "mps", "mpsConfig": {"defaultActiveThreadPercentage": percent}}
        parameters = {"apiVersion": api_version(DRIVER), "kind": "SharingConfig", "sharing": mps}
        return {"source": source, "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}

    body["status"]["allocation"]["devices"]["config"] = [config(1, "FromClass"), config(2, "FromClaim")]
    return body


def run(smoke: bool = False) -> dict:
    rounds = 20 if smoke else 1000
    result: dict[str, Any] = {"claims_prepared_beside": BESIDE, "target_p50_ms": 5.0}
    for name, base in (("disk", "/tmp"), ("tmpfs", "/dev/shm")):
        if Path(base).is_dir():
            result[name] = _measure(Path(base), rounds)
    return result


def _fsync_ms(directory: Path, rounds: int = 50) -> dict[str, float]:
    """A 1 KiB write + fsync on this file system, the floor of one durable checkpoint record."""
    path = directory / "fsync-probe"
    times = []
    for _ in range(rounds):

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, b"x" * 1024)
            os.fsync(fd)
            os.close(fd)

        times.append(timed(write))
    path.unlink()
    return summary_ms(times)


class _Warm:
    """A warm, current cache's answers (a first prepare still reads the claim, here from memory); the read of a
    claim in `hung` blocks until `release` is set."""

    def __init__(self, by_uid: dict[str, dict[str, Any]]) -> None:
        self.by_uid = by_uid
        self.hung: set[str] = set()
        self.reading = threading.Event()
        self.release = threading.Event()

    def cached(self, ref: Any) -> dict[str, Any] | None:
        return None if ref.uid in self.hung else self.by_uid[ref.uid]

    def get(self, ref: Any, timeout: float) -> dict[str, Any]:
        if ref.uid in self.hung:
            self.reading.set()
            self.release.wait()
        return self.by_uid[ref.uid]


def _while_a_read_hangs(
    stub: Any, source: _Warm, refs: Any, bodies: list[dict[str, Any]], rounds: int
) -> dict[str, float]:
    """Repeat prepares of a prepared, cached claim while another claim's read hangs (its call on another thread)."""
    hung = _claim(len(bodies), 8)
    source.by_uid[hung["metadata"]["uid"]] = hung
    source.hung.add(hung["metadata"]["uid"])
    call = stub.NodePrepareResources.future(pb.NodePrepareResourcesRequest(claims=refs(hung)), timeout=60)
    if not source.reading.wait(10):
        raise RuntimeError("the hung claim's read never began")
    request = pb.NodePrepareResourcesRequest(claims=refs(bodies[0]))
    times = [timed(lambda: stub.NodePrepareResources(request)) for _ in range(rounds)]
    if call.done():
        raise RuntimeError("the hung claim's call ended early: the figure would not be measured under a hung read")
    source.release.set()
    call.result()
    return summary_ms(times)


def _measure(base: Path, rounds: int) -> dict[str, Any]:
    gpus = 8
    root = Path(tempfile.mkdtemp(prefix="gs-bench-", dir=base))
    try:
        info = SimulatedInventory.from_file(node_file(root, gpus=gpus)).discover()
        config = parse_config(
            {"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 48, "backend": "mps"}]}
        )
        state = NodeState()
        paths = PluginPaths(root / "registry", root / "plugins", DRIVER)
        paths.data_dir.mkdir(parents=True)
        driver = Driver(
            DRIVER,
            NODE,
            Checkpoint(paths.checkpoint),
            CdiWriter(root / "cdi", DRIVER),
            state,
            SerialLock(paths.data_dir / "serialize.lock"),
        )
        driver.on_config(config, build_resources(config, info))
        bodies = [_claim(i, gpus) for i in range(BESIDE + rounds)]
        configured = [_with_sharing_config(_claim(i, gpus)) for i in range(len(bodies), len(bodies) + rounds)]
        by_uid = {b["metadata"]["uid"]: b for b in bodies + configured}
        source = _Warm(by_uid)
        plugin = KubeletPlugin(driver, source, state, paths)
        plugin.start()
        try:
            with grpc.insecure_channel(f"unix://{paths.dra_socket}") as channel:
                stub = pb_grpc.DRAPluginStub(channel)

                def refs(body: dict[str, Any]) -> list[Any]:
                    meta = body["metadata"]
                    return [pb.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])]

                for body in bodies[:BESIDE]:
                    assert (
                        not stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=refs(body)))
                        .claims[body["metadata"]["uid"]]
                        .error
                    )
                prepare, repeat, unprepare = [], [], []
                for body in bodies[BESIDE:]:
                    request = pb.NodePrepareResourcesRequest(claims=refs(body))
                    answer: list[Any] = []
                    prepare.append(timed(lambda: answer.append(stub.NodePrepareResources(request))))
                    assert not answer[0].claims[body["metadata"]["uid"]].error, answer[0]
                    repeat.append(timed(lambda: stub.NodePrepareResources(request)))
                    unprepare.append(
                        timed(lambda: stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=refs(body))))
                    )
                assert len(driver.prepared()) == BESIDE
                with_config = []
                for body in configured:
                    request = pb.NodePrepareResourcesRequest(claims=refs(body))
                    answer = []
                    with_config.append(timed(lambda: answer.append(stub.NodePrepareResources(request))))
                    assert not answer[0].claims[body["metadata"]["uid"]].error, answer[0]
                    stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=refs(body)))
                during = _while_a_read_hangs(stub, source, refs, bodies, rounds)
        finally:
            source.release.set()
            plugin.stop()
        return {
            "directory": str(base),
            "fsync_1kib": _fsync_ms(root),
            "prepare_one_claim": summary_ms(prepare),
            "prepare_again_same_claim": summary_ms(repeat),
            "unprepare_one_claim": summary_ms(unprepare),
            "prepare_with_sharing_config": summary_ms(with_config),
            "prepare_again_while_a_read_hangs": during,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)

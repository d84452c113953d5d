"""The scheduler extender: filter + prioritize for one pod over 1,000 and 5,000 nodes, cache memory, annotation size.

    python -m benchmarks.extender [--smoke]

Nodes have 8 GPUs of 10 shares with random use; the pod asks for 2 shares (the captured scheduler request).
Timed in-process (the verbs on decoded JSON; wall time and the thread's CPU time; the first call, which
builds every node's view, apart) and over real HTTP on loopback to the extender in its own process (JSON
both ways, one kept-alive connection, as kube-scheduler calls it). Memory: tracemalloc of the cache filled with 5,000
nodes x 8 GPUs. Hostile bodies: the extender process's peak RSS while 8 clients at once send the largest body it reads,
made of empty JSON lists (the costliest to parse), and while 8 send twice that (refused unread); answers by status.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import random
import socket
import sys
import threading
import time
import tracemalloc

from prometheus_client import CollectorRegistry

from deviceplugin.alloc.plan import build_resources
from deviceplugin.config.parse import parse_config
from deviceplugin.extender.cache import ClusterCache
from deviceplugin.extender.http import MAX_BODY_BYTES, ExtenderHTTPServer
from deviceplugin.extender.metrics import ExtenderMetrics
from deviceplugin.extender.score import Scorer
from deviceplugin.extender.verbs import Extender
from deviceplugin.extender.watch import settle_heap
from deviceplugin.kube.labels import InventoryAnnotation
from deviceplugin.model.node import Gpu, MigDevice, NodeInfo
from deviceplugin.model.usage import ContainerShare, Usage

from .common import rss_mib, summary_ms

SHARE = "example.com/gpu-share"
POD = {
    "metadata": {"name": "bench", "namespace": "bench", "uid": "bench-uid"},
    "spec": {
        "containers": [{"name": "c", "resources": {"limits": {SHARE: "2"}, "requests": {"cpu": "10m", SHARE: "2"}}}]
    },
}


def node_annotation(rng: random.Random, gpus: int = 8, shares: int = 10) -> str:
    units = []
    for i in range(gpus):
        used = rng.randint(0, shares)
        units.append(
            {
                "uuid": f"GPU-bench000-0000-4000-8000-{rng.getrandbits(40):012x}",
                "gpu": i,
                "total": shares,
                "used": used,
                "free": shares - used,
                "health": "Healthy",
            }
        )
    return json.dumps(
        {
            "version": 2,
            "generation": 1,
            "gpus": [],
            "pods": [f"{rng.getrandbits(32):08x}" for _ in range(gpus)],
            "resources": {
                SHARE: {"pool": "shared", "allowSpanGPUs": False, "allocationPolicy": "binpack", "units": units}
            },
        }
    )


def filled(nodes: int, seed: int = 1) -> ClusterCache:
    rng = random.Random(seed)
    cache = ClusterCache()
    for i in range(nodes):
        cache.set_node(f"node-{i:05d}", node_annotation(rng))
    settle_heap()  # as the extender does after each full list
    return cache


def _extender(nodes: int) -> Extender:
    cache = filled(nodes)
    return Extender(
        cache,
        Scorer("binpack"),
        lambda n: n.startswith("example.com/"),
        ExtenderMetrics(CollectorRegistry(), cache.counts),
    )


def _serve(nodes: int, pipe) -> None:
    """The extender over HTTP in its own process (kube-scheduler is another process): port out, any message stops it."""
    extender = _extender(nodes)
    server = ExtenderHTTPServer(extender, extender.metrics, lambda: (True, "ready"), port=0, host="127.0.0.1")
    server.start()
    pipe.send(server.port)
    pipe.recv()
    server.stop()


def time_verbs(nodes: int, rounds: int) -> dict:
    extender = _extender(nodes)
    names = [f"node-{i:05d}" for i in range(nodes)]
    args = {"Pod": POD, "Nodes": None, "NodeNames": names}
    in_process, cpu, over_http = [], [], []
    for _ in range(rounds + 1):
        started, started_cpu = time.perf_counter(), time.thread_time()
        passed = extender.filter(args)["NodeNames"]
        extender.prioritize({"Pod": POD, "Nodes": None, "NodeNames": passed})
        in_process.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
    first = in_process.pop(0)  # builds every node's view (as the first call after a relist does)
    cpu.pop(0)
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(nodes, theirs), daemon=True)
    server.start()
    try:
        connection = http.client.HTTPConnection(
            "127.0.0.1", ours.recv(), timeout=10
        )  # kept alive, as kube-scheduler does
        for _ in range(rounds + 1):
            started = time.perf_counter()
            passed = _post(connection, "/filter", args)["NodeNames"]
            _post(connection, "/prioritize", {"Pod": POD, "Nodes": None, "NodeNames": passed})
            over_http.append(time.perf_counter() - started)
        connection.close()
    finally:
        ours.send("stop")
        server.join(timeout=10)
    over_http.pop(0)
    return {
        "nodes": nodes,
        "passed": len(passed),
        "first_call_ms": round(1000 * first, 3),
        "in_process": summary_ms(in_process),
        "in_process_cpu": summary_ms(cpu),  # the thread's own CPU time: what other processes' load does not inflate
        "over_http": summary_ms(
            over_http
        ),  # the extender in its own process, JSON both ways, one kept-alive connection
    }


def _post(connection: http.client.HTTPConnection, path: str, body: dict) -> dict:
    connection.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"POST {path}: HTTP {response.status}: {response.read()[:200]!r}")
    return json.loads(response.read())


def cache_memory(nodes: int) -> dict:
    """The cache's allocations (tracemalloc) and the process's RSS before and after filling it."""
    rss_before = rss_mib(os.getpid())
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = filled(nodes)
    for i in range(nodes):  # the free-share views the verbs build
        cache.node(f"node-{i:05d}")
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "nodes": nodes,
        "gpus_per_node": 8,
        "cache_mib": round((after - before) / 2**20, 1),
        "per_node_kib": round((after - before) / nodes / 1024, 2),
        "rss_before_mib": round(rss_before, 1),
        "rss_after_mib": round(rss_mib(os.getpid()), 1),
    }


def annotation_bytes() -> dict:
    """The node plugin's annotation at 8 GPUs x 7 MIG instances, every instance holding one pod."""
    gpus = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-5d2e8b41-a1f0-4c3e-8d7a-00000000000{i}",
            model="NVIDIA A100-SXM4-80GB",
            memory_mib=81920,
            mig_enabled=True,
            mig_devices=tuple(
                MigDevice(
                    uuid=f"MIG-0{i}0{k}a0c4-7f3b-5e91-b2d8-6c4f1000{i}{k}00",
                    profile="1g.10gb",
                    memory_mib=9984,
                    gi_id=k + 7,
                    ci_id=0,
                    index=k,
                )
                for k in range(7)
            ),
        )
        for i in range(8)
    )
    node = NodeInfo(gpus=gpus, name="8x7")
    resources = build_resources(
        parse_config({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 4}]}), node
    )
    shares = tuple(
        ContainerShare(
            "team", f"pod-{n}", "main", SHARE, "s", u.uuid, u.gpu.uuid, (f"{u.uuid}::0", f"{u.uuid}::1"), 2, 0, True
        )
        for n, u in enumerate(resources[0].units)
    )
    text = json.dumps(
        InventoryAnnotation().build(node, resources, Usage(shares=shares), frozenset()),
        separators=(",", ":"),
        sort_keys=True,
    )
    return {"gpus": 8, "mig_instances": 56, "pods": len(shares), "bytes": len(text.encode())}


def agreement(trials: int, seed: int = 7) -> dict:
    """How often the node plugin's GetPreferredAllocation puts a pod on the unit the extender assumed.

    Random states of an 8-GPU node with 10 shares per GPU: the node plugin's annotation of that state, the
    extender's placement from it, and the plugin's own choice among the free device IDs, per allocationPolicy.
    """
    from deviceplugin.alloc.placement import preferred_allocation
    from deviceplugin.extender.fit import place
    from deviceplugin.extender.inputs import parse_annotation, pod_request

    rng = random.Random(seed)
    gpus = tuple(
        Gpu(index=i, uuid=f"GPU-agree000-0000-4000-8000-{i:012d}", model="NVIDIA H100 80GB HBM3", memory_mib=81559)
        for i in range(8)
    )
    node = NodeInfo(gpus=gpus, name="agree")
    out = {}
    for policy in ("binpack", "spread", "fgdstrand"):
        config = parse_config(
            {"version": "v1", "allocationPolicy": policy, "pools": [{"name": "s", "mode": "shared", "replicas": 10}]}
        )
        resource = build_resources(config, node)[0]
        same = placed = 0
        for trial in range(trials):
            held = {u.uuid: rng.randint(0, 10) for u in resource.units}
            shares = tuple(
                ContainerShare(
                    "t",
                    f"p{trial}-{i}",
                    "c",
                    SHARE,
                    "s",
                    u.uuid,
                    u.uuid,
                    tuple(f"{u.uuid}::{k}" for k in range(held[u.uuid])),
                    held[u.uuid],
                    0,
                    True,
                )
                for i, u in enumerate(resource.units)
                if held[u.uuid]
            )
            annotation = parse_annotation(
                "agree", json.dumps(InventoryAnnotation().build(node, [resource], Usage(shares=shares), frozenset()))
            )
            count = rng.randint(1, 8)
            pod = {
                "metadata": {"name": "x", "namespace": "t"},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {SHARE: str(count)}}}]},
            }
            fit = place(
                pod_request(pod, lambda r: r == SHARE),
                annotation,
                {SHARE: [u.free for u in annotation.resources[SHARE].units]},
            )
            if not fit.ok:
                continue
            placed += 1
            assumed = annotation.resources[SHARE].units[fit.placements[0].unit].uuid
            free_ids = [d for d in resource.devices if int(d.split("::")[1]) >= held[d.split("::")[0]]]
            chosen = {resource.devices[i].unit.uuid for i in preferred_allocation(resource, free_ids, [], count)}
            same += chosen == {assumed}
        out[policy] = {"pods": placed, "agree_percent": round(100 * same / max(placed, 1), 2)}
    return out


def _peak_rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status").read().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM")


def _send(port: int, body: bytes, answers: list[str]) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            answers.append(sock.recv(64).split(b" ")[1].decode())
    except OSError as err:  # refused unread: the server closed while the rest was on its way
        answers.append(type(err).__name__)


def hostile_bodies(clients: int = 8) -> list[dict]:
    """Peak RSS of the extender process while `clients` send big bodies at once: at the limit, and twice it."""
    rows = []
    for size in (MAX_BODY_BYTES, 2 * MAX_BODY_BYTES):
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        server = multiprocessing.get_context("spawn").Process(target=_serve, args=(10, theirs), daemon=True)
        server.start()
        try:
            port = ours.recv()
            idle = _peak_rss_mib(server.pid or 0)
            body = b"[" + b"[]," * ((size - 4) // 3) + b"[]]"
            answers: list[str] = []
            senders = [threading.Thread(target=_send, args=(port, body, answers)) for _ in range(clients)]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join(timeout=60)
            rows.append(
                {
                    "clients": clients,
                    "body_bytes": len(body),
                    "idle_peak_rss_mib": idle,
                    "peak_rss_mib": _peak_rss_mib(server.pid or 0),
                    "answers": ",".join(f"{a}x{answers.count(a)}" for a in sorted(set(answers))),
                }
            )
        finally:
            ours.send("stop")
            server.join(timeout=10)
    return rows


def run(smoke: bool = False) -> dict:
    sizes, rounds = ((50, 200), 5) if smoke else ((1000, 5000), 100)
    return {
        "filter_prioritize": [time_verbs(n, rounds) for n in sizes],
        "memory": cache_memory(200 if smoke else 5000),
        "annotation": annotation_bytes(),
        "node_choice_agreement": agreement(200 if smoke else 5000),
        "hostile_bodies": hostile_bodies(2 if smoke else 8),
    }


if __name__ == "__main__":
    print(json.dumps(run(smoke="--smoke" in sys.argv), indent=2))

"""Hostile input: CPU time and peak memory to refuse the worst configs, and the plugin's threads, fds, memory and
scrape latency while 1,000 idle or half-sent connections sit on its metrics port, and while a client keeps opening
more."""

from __future__ import annotations

import collections
import resource
import socket
import statistics
import threading
import time
import tracemalloc
import urllib.request
from dataclasses import replace

from deviceplugin.alloc.plan import build_resources
from deviceplugin.config.parse import parse_config_text
from deviceplugin.config.types import ConfigError
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.limits import MAX_CONFIG_BYTES
from deviceplugin.model.node import NodeInfo

from .common import open_fds, percentile, plugin_process, rss_mib, threads

NODE = "examples/nodes/8xH100-80GB.yaml"
ATTACKER = "127.0.0.2"  # another client address than the scraper's 127.0.0.1, as another pod would be


def _pool(**keys) -> str:
    return (
        "version: v1\npools:\n  - {"
        + ", ".join(f"{k}: {v}" for k, v in {"name": "a", "mode": "shared", **keys}.items())
        + "}\n"
    )


def _configs() -> dict[str, tuple[str, NodeInfo | None]]:
    h100 = SimulatedInventory.from_file(NODE).discover()
    wide = NodeInfo(
        gpus=tuple(replace(h100.gpus[0], index=i, uuid=f"{h100.gpus[0].uuid[:-3]}{i:03d}") for i in range(64))
    )
    merges = (
        "version: v1\nx: &big {"
        + ", ".join(f"k{i}: 0" for i in range(1000))
        + "}\ny: {<<: ["
        + ", ".join(["*big"] * 10)
        + "]}\n"
    )
    pools = "".join(f"  - {{name: p{i}, mode: shared, gpus: {{indexes: [{i % 8}]}}}}\n" for i in range(3000))
    return {
        "replicas 100000 (8 GPUs)": (_pool(replicas=100_000), h100),
        "replicas 1000000 (8 GPUs)": (_pool(replicas=1_000_000), h100),
        "memoryPerShare 1Mi (8x80 GB)": (_pool(memoryPerShare="1Mi"), h100),
        "replicas 1024 on 64 GPUs (over the list budget)": (_pool(replicas=1024), wide),
        "pools nested 5000 deep": ("version: v1\npools: " + "[" * 5000 + "\n", None),
        "3000 pools (node limit)": ("version: v1\npools:\n" + pools, None),
        "merge keys copying 10x1000 keys": (merges, None),
        "1 MiB comment, then an error": ("#" * (MAX_CONFIG_BYTES - 100) + "\nversion: v2\npools: []\n", None),
    }


def _refuse(text: str, node: NodeInfo | None) -> str:
    try:
        config = parse_config_text(text, "bench.yaml")
        if node is not None:
            build_resources(config, node)
    except ConfigError as err:
        return " | ".join(err.problems)[:160]
    return "not refused"


def _refusals(repeats: int) -> list[dict]:
    rows = []
    for name, (text, node) in _configs().items():
        cpu = []
        for _ in range(repeats):
            started = time.process_time()
            message = _refuse(text, node)
            cpu.append(time.process_time() - started)
        tracemalloc.start()
        _refuse(text, node)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rows.append(
            {
                "config": name,
                "bytes": len(text),
                "cpu_ms": round(statistics.median(cpu) * 1000, 2),
                "peak_mib": round(peak / 2**20, 2),
                "refused_with": message,
            }
        )
    return rows


def _scrape(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as response:
        response.read()
    return time.perf_counter() - started


def _wait_for_endpoint(url: str, timeout: float = 30.0) -> None:
    """The exporter starts after registration: wait for it to answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _scrape(url)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _abuse(connections: int, scrapes: int, flood_seconds: float) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, connections + 256)), hard))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with plugin_process(
        gpus=8, replicas=64, extra=("--metrics-port", str(port), "--metrics-bind-address", "127.0.0.1")
    ) as (_, process, _dir):
        url = f"http://127.0.0.1:{port}/metrics"
        _wait_for_endpoint(url)
        baseline = [_scrape(url) for _ in range(scrapes)]
        before = {
            "threads": threads(process.pid),
            "fds": open_fds(process.pid),
            "rss_mib": round(rss_mib(process.pid), 1),
        }
        held = []
        for i in range(connections):
            conn = socket.create_connection(("127.0.0.1", port), source_address=(ATTACKER, 0))
            if i % 2:
                conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a request head that never ends
            held.append(conn)
        time.sleep(0.5)
        during = {
            "threads": threads(process.pid),
            "fds": open_fds(process.pid),
            "rss_mib": round(rss_mib(process.pid), 1),
        }
        held_scrapes = [_scrape(url) for _ in range(scrapes)]
        flood = _Flood(port, connections)
        flood.start()
        try:
            flooded, failed = [], 0
            until = time.monotonic() + flood_seconds
            while time.monotonic() < until:
                try:
                    flooded.append(_scrape(url))
                except OSError:
                    failed += 1
                time.sleep(0.05)
            during_flood = {
                "threads": threads(process.pid),
                "fds": open_fds(process.pid),
                "rss_mib": round(rss_mib(process.pid), 1),
            }
        finally:
            flood.stop()
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
        dropped = {
            line.split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in body.splitlines()
            if line.startswith("gpushare_metrics_connections_dropped_total{")
        }
        for conn in held:
            conn.close()
    return {
        "connections": connections,
        "before": before,
        "holding": during,
        "flooding": {
            **during_flood,
            "seconds": flood_seconds,
            "connections_opened": flood.opened,
            "scrapes": len(flooded),
            "scrapes_failed": failed,
        },
        "scrape_ms_idle": _ms(baseline),
        "scrape_ms_holding": _ms(held_scrapes),
        "scrape_ms_flooding": _ms(flooded),
        "dropped": dropped,
    }


def _ms(seconds: list[float]) -> dict:
    return {
        "median": round(statistics.median(seconds) * 1000, 2),
        "p90": round(percentile(seconds, 90) * 1000, 2),
        "max": round(max(seconds) * 1000, 2),
    }


class _Flood(threading.Thread):
    """Keeps opening connections that send half a request head, holding the newest `hold` of them."""

    def __init__(self, port: int, hold: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.hold = hold
        self.opened = 0
        self._stop_flag = threading.Event()

    def run(self) -> None:
        ring: collections.deque[socket.socket] = collections.deque()
        while not self._stop_flag.is_set():
            try:
                conn = socket.create_connection(("127.0.0.1", self.port), timeout=1, source_address=(ATTACKER, 0))
                conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                continue
            self.opened += 1
            ring.append(conn)
            if len(ring) > self.hold:
                ring.popleft().close()
        for conn in ring:
            conn.close()

    def stop(self) -> None:
        self._stop_flag.set()
        self.join()


def run(smoke: bool = False) -> dict:
    return {
        "refusals": _refusals(1 if smoke else 5),
        "metrics_abuse": _abuse(100 if smoke else 1000, 5 if smoke else 30, 0.5 if smoke else 5.0),
    }

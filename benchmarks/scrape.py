"""Metrics scrape time with 8 GPUs and 100 containers, each with a GPU process (the whole node agent path)."""

from __future__ import annotations

import socket
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from deviceplugin.agent.loop import AgentSettings
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.plugin.server import Timings
from deviceplugin.runtime.daemon import build_daemon
from deviceplugin.runtime.options import DaemonOptions
from deviceplugin.sim.kubelet import Container, KubeletSimulator, Pod

from .common import config_file, node_file

RESOURCE = "example.com/gpu-share"


def run(smoke: bool = False) -> dict:
    containers = 20 if smoke else 100
    scrapes = 5 if smoke else 50
    with tempfile.TemporaryDirectory(prefix="gsb-", dir="/tmp") as tmp:
        directory = Path(tmp)
        kubelet = KubeletSimulator(directory / "dp")
        kubelet.start()
        inventory = SimulatedInventory.from_file(node_file(directory, 8), proc_root=directory / "proc")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        options = DaemonOptions(
            config_file=str(config_file(directory, 16)),
            plugin_dir=directory / "dp",
            pod_resources_socket=kubelet.pod_resources_socket,
            metrics_port=port,
            metrics_host="127.0.0.1",
            proc_root=str(directory / "proc"),
            timings=Timings(watch_interval=0.2),
            agent=AgentSettings(interval=3600),
        )
        daemon = build_daemon(inventory, options, pod_directory=kubelet.pod_directory())
        daemon.start()
        try:
            kubelet.wait_for(lambda st: RESOURCE in st and st[RESOURCE].allocatable > 0, timeout=15)
            for i in range(containers):
                pod = Pod(f"p{i}", [Container("c", {RESOURCE: 1})], namespace=f"ns{i % 7}")
                kubelet.admit(pod)
                uuid = kubelet.allocated(pod)["c"][RESOURCE][0].split("::")[0]
                cid = pod.container_ids["c"].split("://")[1]
                cgroup = (
                    f"0::/kubepods.slice/kubepods-pod{pod.uid.replace('-', '_')}.slice/cri-containerd-{cid}.scope\n"
                )
                inventory.add_process(10_000 + i, uuid, 1000 + i, cgroup=cgroup)
            sync = []
            for _ in range(5):
                started = time.perf_counter()
                daemon.agent.sync()
                sync.append(time.perf_counter() - started)
            wall, server, size = [], [], 0
            url = f"http://127.0.0.1:{port}/metrics"
            for _ in range(scrapes):
                started = time.perf_counter()
                with urllib.request.urlopen(url, timeout=10) as response:
                    size = len(response.read())
                wall.append(time.perf_counter() - started)
                server.append(daemon.metrics_server.last_scrape_seconds)
        finally:
            daemon.stop()
            kubelet.stop()
    return {
        "gpus": 8,
        "containers": containers,
        "scrape_wall_ms_median": round(statistics.median(wall) * 1000, 2),
        "scrape_wall_ms_max": round(max(wall) * 1000, 2),
        "render_ms_median": round(statistics.median(server) * 1000, 2),
        "body_bytes": size,
        "agent_round_ms_median": round(statistics.median(sync) * 1000, 2),
    }

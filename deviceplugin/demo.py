"""`gpu-share demo`: the plugin and the built-in kubelet on a simulated node, in a temporary directory."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

from .allocator import ENV_COMPUTE_PERCENT, ENV_MEMORY_LIMIT, ENV_SHARE_COUNT, ENV_SHARE_TOTAL
from .config import load_config
from .kubelet_sim import AdmissionError, Container, KubeletSimulator, Pod
from .manager import PluginManager
from .resources import SHARE_SEPARATOR, build_resources
from .server import Timings
from .simulated import SimulatedInventory

SAMPLE_PODS = [
    Pod("trainer", [Container("main", {"example.com/gpu": 1})]),
    Pod("isolated", [Container("main", {"example.com/mig-3g.40gb": 1})]),
    Pod("chat-small", [Container("server", {"example.com/gpu-share": 1})]),
    Pod("chat-large", [Container("server", {"example.com/gpu-share": 3})]),
    Pod("too-big", [Container("server", {"example.com/gpu-share": 12})]),
]


def run_demo(node_file: str, config_file: str, out=print) -> int:
    inventory = SimulatedInventory.from_file(node_file)
    node = inventory.discover()
    resources = build_resources(load_config(config_file), node)
    index_of = {g.uuid: g.index for g in node.gpus} | {m.uuid: g.index for g in node.gpus for m in g.mig_devices}
    with tempfile.TemporaryDirectory(prefix="gpu-share-demo-") as tmp:
        plugin_dir = Path(tmp) / "device-plugins"
        kubelet = KubeletSimulator(plugin_dir, seed=1)
        kubelet.start()
        manager = PluginManager(resources, plugin_dir, Timings(watch_interval=0.1))
        manager.start()
        try:
            names = {r.name for r in resources}
            if not kubelet.wait_for(lambda st: names <= {n for n, s in st.items() if s.allocatable}, timeout=15):
                out("the plugin did not register with the built-in kubelet within 15 s")
                return 1
            out(f"Node {node.name}: {len(node.gpus)} GPUs; plugin registered {len(resources)} resources\n")
            _capacity_table(kubelet, out)
            out("\nAdmitting sample pods:")
            rows = [("POD", "REQUEST", "GPU", "DEVICES", "ENV / ERROR")]
            for pod in SAMPLE_PODS:
                request = ", ".join(f"{r}: {n}" for c in pod.containers for r, n in c.requests.items())
                try:
                    results = kubelet.admit(pod)
                except AdmissionError as err:
                    rows.append((pod.name, request, "-", "-", f"REFUSED: {err}"))
                    continue
                for container, by_resource in kubelet.allocated(pod).items():
                    for resource, ids in by_resource.items():
                        envs = results[container][resource].envs
                        gpus = sorted({index_of[i.split(SHARE_SEPARATOR)[0]] for i in ids})
                        rows.append((pod.name, request, ",".join(map(str, gpus)), _short(ids), _env_summary(envs)))
            _table(rows, out)
            out("\nShares in use per GPU (binpack keeps GPUs whole for larger requests):")
            used = Counter(i.split(SHARE_SEPARATOR)[0] for pod in SAMPLE_PODS for c in kubelet.allocated(pod).values() for ids in c.values() for i in ids if SHARE_SEPARATOR in i)
            for resource in resources:
                if resource.pool.shared:
                    for unit in resource.units:
                        out(f"  GPU {unit.gpu.index}: {used[unit.uuid]}/{unit.replicas} shares used")
        finally:
            manager.stop()
            kubelet.stop()
        inventory.close()
    out("\nDone: sockets removed, temporary directory cleaned up.")
    return 0


def _capacity_table(kubelet: KubeletSimulator, out) -> None:
    rows = [("RESOURCE", "CAPACITY", "ALLOCATABLE")]
    rows += [(name, str(s.capacity), str(s.allocatable)) for name, s in sorted(kubelet.resources().items())]
    _table(rows, out)


def _env_summary(envs) -> str:
    parts = [f"NVIDIA_VISIBLE_DEVICES={envs['NVIDIA_VISIBLE_DEVICES']}"]
    if ENV_SHARE_COUNT in envs:
        parts.append(f"shares {envs[ENV_SHARE_COUNT]}/{envs[ENV_SHARE_TOTAL]}, {envs[ENV_MEMORY_LIMIT]} MiB, {envs[ENV_COMPUTE_PERCENT]}% compute")
    return "; ".join(parts)


def _short(ids: list[str]) -> str:
    shares = sorted(i.split(SHARE_SEPARATOR)[1] for i in ids if SHARE_SEPARATOR in i)
    if shares:
        return "shares " + ",".join(shares)
    return "MIG instance" if ids[0].startswith("MIG-") else "whole GPU"


def _table(rows: list[tuple[str, ...]], out) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        out("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])

"""`gpu-share demo`: the plugin and the built-in kubelet on a simulated node, in a temporary directory."""

from __future__ import annotations

import socket
import tempfile
import urllib.request
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .agent import AgentSettings
from .allocator import ENV_COMPUTE_PERCENT, ENV_MEMORY_LIMIT, ENV_SHARE_COUNT, ENV_SHARE_TOTAL
from .daemon import DaemonOptions, PluginDaemon
from .kubelet_sim import AdmissionError, Container, KubeletSimulator, Pod
from .resources import SHARE_SEPARATOR
from .server import Timings
from .simulated import SimulatedInventory

MIB = 1024 * 1024

SAMPLE_PODS = [
    Pod("trainer", [Container("main", {"example.com/gpu": 1})]),
    Pod("isolated", [Container("main", {"example.com/mig-3g.40gb": 1})]),
    Pod("chat-small", [Container("server", {"example.com/gpu-share": 1})]),
    Pod("chat-large", [Container("server", {"example.com/gpu-share": 3})]),
    Pod("too-big", [Container("server", {"example.com/gpu-share": 12})]),
]


# Simulated GPU memory per pod (MiB): chat-large goes over the 24576 MiB its 3 shares allow.
PROCESS_MEMORY = {"trainer": 70000, "isolated": 30000, "chat-small": 6000, "chat-large": 26000}


def run_demo(node_file: str, config_file: str, out=print) -> int:
    with tempfile.TemporaryDirectory(prefix="gpu-share-demo-") as tmp:
        plugin_dir = Path(tmp) / "device-plugins"
        kubelet = KubeletSimulator(plugin_dir, seed=1)
        kubelet.start()
        inventory = SimulatedInventory.from_file(node_file, proc_root=Path(tmp) / "proc")
        options = DaemonOptions(
            config_file=config_file,
            plugin_dir=plugin_dir,
            pod_resources_socket=kubelet.pod_resources_socket,
            metrics_port=_free_port(),
            metrics_host="127.0.0.1",
            proc_root=str(Path(tmp) / "proc"),
            timings=Timings(watch_interval=0.1),
            agent=AgentSettings(interval=3600),  # the demo asks for one round itself
        )
        daemon = PluginDaemon(inventory, options, pod_directory=kubelet.pod_directory())
        node = daemon.node
        index_of = {g.uuid: g.index for g in node.gpus} | {m.uuid: g.index for g in node.gpus for m in g.mig_devices}
        daemon.start()
        try:
            resources = daemon.manager.resources
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
                        _run_process(inventory, pod, container, envs["CUDA_VISIBLE_DEVICES"].split(",")[0])
            _table(rows, out)
            out("\nShares in use per GPU (binpack keeps GPUs whole for larger requests):")
            used = Counter(i.split(SHARE_SEPARATOR)[0] for pod in SAMPLE_PODS for c in kubelet.allocated(pod).values() for ids in c.values() for i in ids if SHARE_SEPARATOR in i)
            for resource in resources:
                if resource.pool.shared:
                    for unit in resource.units:
                        out(f"  GPU {unit.gpu.index}: {used[unit.uuid]}/{unit.replicas} shares used")
            daemon.agent.sync()
            _usage_table(f"http://127.0.0.1:{options.metrics_port}/metrics", out)
        finally:
            daemon.stop()
            kubelet.stop()
    out("\nDone: sockets removed, temporary directory cleaned up.")
    return 0


_next_pid = iter(range(4000, 5000))


def _run_process(inventory: SimulatedInventory, pod: Pod, container: str, unit_uuid: str) -> None:
    """A simulated CUDA process in the container, with a real-looking cgroup for the process mapper."""
    gpu = next(g for g in inventory.discover().gpus if unit_uuid in (g.uuid, *(m.uuid for m in g.mig_devices)))
    container_id = pod.container_ids[container].split("://")[1]
    cgroup = f"0::/kubepods.slice/kubepods-pod{pod.uid.replace('-', '_')}.slice/cri-containerd-{container_id}.scope\n"
    mig = unit_uuid if unit_uuid != gpu.uuid else None
    inventory.add_process(next(_next_pid), gpu.uuid, PROCESS_MEMORY.get(pod.name, 1000), mig_uuid=mig, cgroup=cgroup)


def _usage_table(url: str, out) -> None:
    """Per-pod shares, limit and real use, as a Prometheus scrape of the plugin shows them."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values: dict[tuple[str, str, str], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("gpushare_container_"):
            for sample in family.samples:
                key = (sample.labels["pod"], sample.labels["container"], sample.labels["resource"])
                values.setdefault(key, {})[sample.name] = sample.value
    out(f"\nPer-pod GPU use, read from the metrics endpoint ({url}):")
    rows = [("POD", "CONTAINER", "RESOURCE", "SHARES", "LIMIT MiB", "USED MiB", "")]
    for (pod, container, resource), v in sorted(values.items()):
        over = "OVER LIMIT (reported by the memory watchdog)" if v.get("gpushare_container_over_limit") else ""
        rows.append((pod, container, resource, f"{v['gpushare_container_shares']:.0f}", f"{v['gpushare_container_memory_limit_bytes'] / MIB:.0f}", f"{v.get('gpushare_container_memory_used_bytes', 0) / MIB:.0f}", over))
    _table(rows, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

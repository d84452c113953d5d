"""`gpu-share demo`: the plugin and the built-in kubelet on a simulated node, in a temporary directory."""

from __future__ import annotations

import socket
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from ..agent.loop import AgentSettings
from ..alloc.check import collect_warnings
from ..alloc.modes import ENV_COMPUTE_PERCENT, ENV_MEMORY_LIMIT, ENV_SHARE_COUNT, ENV_SHARE_TOTAL
from ..config.types import ConfigError
from ..config.yamlfile import YamlProblem, decode, load_yaml, read_bounded
from ..discovery.simulated import SimulatedInventory
from ..health.monitor import HealthSettings
from ..model.devices import SHARE_SEPARATOR, Resource
from ..model.node import MIB
from ..model.shares import share_memory_mib
from ..mps.computemode import ComputeModes
from ..mps.control import MpsDaemon
from ..plugin.server import Timings
from ..runtime.daemon import build_daemon
from ..runtime.options import DaemonOptions
from . import mps_control
from .kubelet import AdmissionError, Container, KubeletSimulator, Pod
from .scheduler import run_scheduler_step

POLICY_NOTES = {  # what each allocationPolicy does with the sample pods' shares
    "binpack": "binpack keeps GPUs whole for larger requests",
    "spread": "spread puts each container on the emptiest GPU",
    "fgdstrand": "fgdstrand picks the GPU the cluster packing policy would",
}


@dataclass(frozen=True)
class Sample:
    """One sample pod: what it shows, what it asks for, and how much GPU memory its simulated process uses."""

    pod: Pod
    shows: str
    resource: Resource
    count: int
    use: float  # simulated memory use as a fraction of what the pod is given (>1: over its limit)


def sample_pods(resources: list[Resource]) -> list[Sample]:
    """Pods built from what the config yields on the node: a whole GPU, a MIG instance, one share, several shares,
    and one that cannot fit; each only where the node has such a resource."""
    by_mode: dict[str, list[Resource]] = {"exclusive": [], "mig": [], "shared": []}
    for r in resources:
        by_mode[r.pool.mode].append(r)
    samples = []

    def add(name: str, shows: str, resource: Resource, count: int, use: float) -> None:
        samples.append(Sample(Pod(name, [Container("main", {resource.name: count})]), shows, resource, count, use))

    if by_mode["exclusive"]:
        add("trainer", "a whole GPU", by_mode["exclusive"][0], 1, 0.85)
    if by_mode["mig"]:
        add("isolated", "one MIG instance", by_mode["mig"][0], 1, 0.6)
    if by_mode["shared"]:
        shared = by_mode["shared"][0]
        most = max(u.replicas for u in shared.units)
        add("chat-small", "one share", shared, 1, 0.75)
        if most >= 2 and shared.pool.mps:  # MPS refuses allocations past CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
            add(
                "chat-large",
                f"{min(3, most)} shares, asking more memory than they allow: MPS holds them to it",
                shared,
                min(3, most),
                1.0,
            )
        elif most >= 2:
            add("chat-large", f"{min(3, most)} shares, using more memory than they allow", shared, min(3, most), 1.1)
        too_many = len(shared.devices) + 1 if shared.pool.allow_span else most + 1
        add(
            "too-big",
            f"more shares ({too_many}) than {'the node' if shared.pool.allow_span else 'one GPU'} has",
            shared,
            too_many,
            0,
        )
    else:
        whole = (by_mode["exclusive"] or by_mode["mig"])[0]
        add("too-big", f"more devices ({len(whole.devices) + 1}) than the node has", whole, len(whole.devices) + 1, 0)
    return samples


def run_demo(node_file: str, config_file: str | None, out=print, profile: str | None = None) -> int:
    """`config_file` None: `run`'s default config."""
    with tempfile.TemporaryDirectory(prefix="gpu-share-demo-") as tmp:
        plugin_dir = Path(tmp) / "device-plugins"
        kubelet = KubeletSimulator(plugin_dir, seed=1)
        kubelet.start()
        try:
            return _demo(kubelet, Path(tmp), node_file, config_file, profile, out)
        finally:
            kubelet.stop()


def _demo(
    kubelet: KubeletSimulator, tmp: Path, node_file: str, config_file: str | None, profile: str | None, out
) -> int:
    inventory = SimulatedInventory.from_file(node_file, proc_root=tmp / "proc")
    control = mps_control.wrapper(tmp)
    options = DaemonOptions(
        config_file=_with_mps_root(config_file, tmp) if config_file else None,
        mps_control=str(control),
        profile=profile,
        plugin_dir=kubelet.plugin_dir,
        pod_resources_socket=kubelet.pod_resources_socket,
        metrics_port=_free_port(),
        metrics_host="127.0.0.1",
        proc_root=str(tmp / "proc"),
        timings=Timings(watch_interval=0.1, stop_grace=0.1),
        health=HealthSettings(check_interval=0.1),  # stopping waits for one check interval
        agent=AgentSettings(interval=3600),  # the demo asks for one round itself
    )
    with collect_warnings() as warnings:
        try:
            daemon = build_daemon(inventory, options, pod_directory=kubelet.pod_directory())
        except ConfigError as err:
            out(f"The plugin refuses this config on node {inventory.discover().name}, as `gpu-share run` would:")
            out("  " + "\n  ".join(err.problems))
            out(
                f"(`gpu-share config check {config_file or 'CONFIG'} --node {node_file}` shows the same; pick "
                "another --node or --config)"
            )
            return 2
    node = daemon.node
    index_of = {g.uuid: g.index for g in node.gpus} | {m.uuid: g.index for g in node.gpus for m in g.mig_devices}
    resources = list(daemon.manager.resources)
    # `gpu-share mps`'s supervisor, with a simulated control daemon: the MPS pools become ready as on a node.
    daemons = [
        MpsDaemon(
            r,
            r.settings.mps_root,
            binary=str(control),
            start_timeout=5,
            probe_interval=0.5,
            compute_modes=_ShownModes(),
        )
        for r in resources
        if r.pool.mps
    ]
    for mps in daemons:
        mps.start()
    daemon.start()
    try:
        names = {r.name for r in resources}
        out(
            f"Node {node.name} ({node_file}): {len(node.gpus)} GPUs; "
            f"config {config_file or 'the default (every GPU shared in 10, as `gpu-share run` without --config)'}"
        )
        for warning in warnings:
            out(f"  warning: {warning}")
        for mps in daemons:
            held = mps.paths.log / mps_control.LIMITS_FILE
            if not _wait(mps.paths.ready.exists, 10):
                out(f"the MPS control daemon of pool {mps.resource.pool.name} was not ready within 10 s")
                return 1
            limits = held.read_text().split("\n")[:-1] if held.exists() else []
            out(
                f"  MPS pool {mps.resource.pool.name} ({mps.resource.name}, "
                f"mpsLimits {mps.resource.pool.mps_limits}): a simulated control daemon "
                f"serves GPUs {', '.join(str(g.index) for g in mps.resource.gpus)}; daemon-wide "
                f"limits: {'; '.join(limits) or 'none (each client gets its own CUDA_MPS_* limits)'}"
            )
            if mps.resource.pool.exclusive_process:
                out(
                    "    exclusiveProcess: gpu-share mps puts these GPUs in EXCLUSIVE_PROCESS while it serves "
                    "and restores their mode on quit (not simulated)"
                )
        if not resources:
            out("Nothing to show: this config advertises no resource on this node.")
            return 2
        if not kubelet.wait_for(lambda st: names <= {n for n, s in st.items() if s.allocatable}, timeout=15):
            out("the plugin did not register with the built-in kubelet within 15 s")
            return 1
        out(f"The plugin registered {len(resources)} resources with the built-in kubelet:\n")
        _capacity_table(kubelet, out)
        samples = sample_pods(resources)
        out("\nAdmitting sample pods built from these resources:")
        rows = [("POD", "SHOWS", "REQUEST", "GPU", "DEVICES", "ENV / ERROR")]
        for sample in samples:
            request = f"{sample.resource.name}: {sample.count}"
            try:
                results = kubelet.admit(sample.pod)
            except AdmissionError as err:
                rows.append((sample.pod.name, sample.shows, request, "-", "-", f"REFUSED: {err}"))
                continue
            for container, by_resource in kubelet.allocated(sample.pod).items():
                for resource_name, ids in by_resource.items():
                    envs = results[container][resource_name].envs
                    gpus = sorted({index_of[i.split(SHARE_SEPARATOR)[0]] for i in ids})
                    rows.append(
                        (
                            sample.pod.name,
                            sample.shows,
                            request,
                            ",".join(map(str, gpus)),
                            _short(ids),
                            _env_summary(envs, sample.resource),
                        )
                    )
                    _run_process(inventory, sample, container, ids)
        _table(rows, out)
        shared = [r for r in resources if r.pool.shared]
        if shared:
            out(f"\nShares in use per GPU ({POLICY_NOTES[shared[0].allocation_policy]}):")
        admitted = [s.pod for s in samples if kubelet.allocated(s.pod)]
        used = Counter(
            i.split(SHARE_SEPARATOR)[0]
            for pod in admitted
            for c in kubelet.allocated(pod).values()
            for ids in c.values()
            for i in ids
            if SHARE_SEPARATOR in i
        )
        for resource in shared:
            for unit in resource.units:
                where = f"GPU {unit.gpu.index}" + (f" MIG {unit.mig.profile} {unit.uuid}" if unit.mig else "")
                out(f"  {resource.name} {where}: {used[unit.uuid]}/{unit.replicas} shares used")
        daemon.agent.sync()
        _usage_table(f"http://127.0.0.1:{options.metrics_port}/metrics", out)
        too_big = next(s for s in samples if s.pod.name == "too-big")
        run_scheduler_step(resources, out, (too_big.resource, too_big.count))
    finally:
        daemon.stop()
        for mps in daemons:
            mps.stop()
    out("\nDone: sockets removed, temporary directory cleaned up.")
    return 0


class _ShownModes(ComputeModes):
    """No NVML in the demo: compute modes are described (above), not set."""

    def make_exclusive(self, uuids: list[str]) -> dict[str, int]:
        return {}


def _with_mps_root(config_file: str, tmp: Path) -> str:
    """A copy of the config with `mpsRoot` in the demo's directory (its MPS pipes and markers) when a pool has backend
    mps; else the file itself, so the plugin reports its problems with their lines (an unreadable file too)."""
    try:
        data, _ = load_yaml(decode(read_bounded(config_file)))
    except (OSError, YamlProblem):
        return config_file
    if not isinstance(data, dict):
        return config_file
    profiles = data.get("profiles")
    bodies = [data, *(profiles.values() if isinstance(profiles, dict) else ())]
    pools = [
        p for body in bodies if isinstance(body, dict) and isinstance(body.get("pools"), list) for p in body["pools"]
    ]
    if not any(isinstance(p, dict) and p.get("backend") == "mps" for p in pools):
        return config_file
    copy = tmp / "config.yaml"
    copy.write_text(yaml.safe_dump({**data, "mpsRoot": str(tmp / "mps")}, sort_keys=False))
    return str(copy)


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


_next_pid = iter(range(4000, 1 << 22))


def _run_process(inventory: SimulatedInventory, sample: Sample, container: str, ids: list[str]) -> None:
    """A simulated CUDA process in the container, using `sample.use` of the memory it was given, with a real-looking
    cgroup for the process mapper."""
    unit_uuid = ids[0].split(SHARE_SEPARATOR)[0]
    unit = next(u for u in sample.resource.units if u.uuid == unit_uuid)
    given = share_memory_mib(unit, len(ids))
    pod = sample.pod
    container_id = pod.container_ids[container].split("://")[1]
    cgroup = f"0::/kubepods.slice/kubepods-pod{pod.uid.replace('-', '_')}.slice/cri-containerd-{container_id}.scope\n"
    mig = unit.uuid if unit.mig else None
    inventory.add_process(next(_next_pid), unit.gpu.uuid, int(given * sample.use), mig_uuid=mig, cgroup=cgroup)


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
    out(f"\nPer-pod GPU use, read from the metrics endpoint ({url}).")
    out("GPU memory use is simulated: each sample pod's process uses a fixed fraction of what it was given.")
    rows = [("POD", "CONTAINER", "RESOURCE", "SHARES", "LIMIT MiB", "USED MiB (simulated)", "")]
    for (pod, container, resource), v in sorted(values.items()):
        over = "OVER LIMIT (reported by the memory watchdog)" if v.get("gpushare_container_over_limit") else ""
        rows.append(
            (
                pod,
                container,
                resource,
                f"{v['gpushare_container_shares']:.0f}",
                f"{v['gpushare_container_memory_limit_bytes'] / MIB:.0f}",
                f"{v.get('gpushare_container_memory_used_bytes', 0) / MIB:.0f}",
                over,
            )
        )
    _table(rows, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _capacity_table(kubelet: KubeletSimulator, out) -> None:
    rows = [("RESOURCE", "CAPACITY", "ALLOCATABLE")]
    rows += [(name, str(s.capacity), str(s.allocatable)) for name, s in sorted(kubelet.resources().items())]
    _table(rows, out)


def _env_summary(envs, resource: Resource) -> str:
    parts = [f"NVIDIA_VISIBLE_DEVICES={envs['NVIDIA_VISIBLE_DEVICES']}"]
    if ENV_SHARE_COUNT in envs:
        parts.append(
            f"shares {envs[ENV_SHARE_COUNT]}/{envs[ENV_SHARE_TOTAL]}, {envs[ENV_MEMORY_LIMIT]} "
            f"MiB, {envs[ENV_COMPUTE_PERCENT]}% compute"
        )
        if not resource.pool.mps:
            parts[-1] += " (time-sliced: a fair turn, not enforced)"
        elif "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in envs:
            parts.append(
                f"MPS enforces CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={envs['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']} "
                f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={envs['CUDA_MPS_PINNED_DEVICE_MEM_LIMIT']}"
            )
        else:
            parts.append("MPS enforces the daemon-wide limits")
    return "; ".join(parts)


def _short(ids: list[str]) -> str:
    shares = sorted((i.split(SHARE_SEPARATOR)[1] for i in ids if SHARE_SEPARATOR in i), key=int)
    if shares:
        return f"{len(shares)} ({SHARE_SEPARATOR}{','.join(shares)})"
    return "MIG instance" if ids[0].startswith("MIG-") else "whole GPU"


def _table(rows: Sequence[Sequence[str]], out: Callable[[str], None]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        out("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])

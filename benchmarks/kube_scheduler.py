"""A sample of the openb trace through a real kube-apiserver + kube-scheduler, with and without the extender.

    python -m benchmarks.kube_scheduler [--trace default] [--nodes 16] [--seed 42] [--configs all|shipped|KEY,...]
        [--pace] [--shapes trace|learned] [--json FILE]   # ~40 s a configuration on 2 cores

Needs the control-plane binaries (`KUBEBUILDER_ASSETS`, as the tests; skipped without). The sample: `--nodes`
nodes drawn from the trace's GPU node list (their GPUs, CPU and memory), and the trace's pod list shuffled and
inflated to 130 % of the sample's GPU capacity exactly as `gpu-share simulate` draws arrivals (same seed, same
pods), requests rounded to shares of 1/10 GPU. A pod that accepts only some GPU models (the trace's `gpu_spec`)
asks for them by node affinity on the nodes' model label, as a pod would on GFD's `gpu.product`.
Every pod asks for its CPU and memory; a fractional pod for k shares of one GPU, a pod of g whole GPUs for g
containers of 10 shares (device plugin) or a claim of g devices of 10 shares (DRA); CPU-only pods too.

Per configuration, on fresh nodes: the pods up to 100 % of the GPU capacity are created while no scheduler runs
(named in arrival order, which is the order kube-scheduler's queue takes them at start), then kube-scheduler
starts; once it has settled, the rest (to 130 %) arrive as a burst. "Settled": every pod is bound or unschedulable,
no node has a republish pending, and nothing changed for `QUIET` seconds. Reported: the GPU allocation ratio
(the trace's milli-GPUs of bound pods over capacity) at 100 % and 130 % demand, failed admissions (device plugin:
a container's shares that fit on no single GPU of its node, as the kubelet would fail it), the scheduler's first
pass over the first wave in pods per second (from its first binding until every pod of the wave is bound or marked
unschedulable once), and `gpu-share simulate`'s fgdstrand on the same sample and arrivals.

Device plugin: stand-in node plugins (benchmarks/standin.py) admit bound pods with GetPreferredAllocation and
republish the inventory annotation 2-5 s later. DRA: each node's ResourceSlice (DraDevice.to_api), one
ResourceClaim per GPU pod; kube-scheduler allocates the claims itself. The extender runs as its own process
(`gpu-share extender --policy fgdstrand --dra-class gpu-share-shares`), with `--workload` the trace's pod list
rounded to shares, the task shapes `simulate` uses (`--shapes trace`), or learning them from the pods bound
(`--shapes learned`). `simulate` also runs on 8 more node orders of the sample: its own spread over tie-breaks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.cluster import MILLI, Node, PodDemand
from deviceplugin.cluster.simulator import Experiment, arrivals, node_order, share_rounded
from deviceplugin.cluster.traces import DEFAULT_NODES, POD_FILE, load_nodes, load_pods, resolve

from .standin import (
    DRA_CLASS,
    GpuNode,
    StandInPlugins,
    claim_pod_body,
    create_node,
    device_class,
    every_pod_entry,
    model_affinity,
    resource_slice,
    scheduler_config,
    share_pod_body,
)

REPLICAS = 10
QUIET = 4.0  # seconds without change that count as settled
WAVE_TIMEOUT = 180.0
BURST_REPUBLISH = (2.0, 5.0)  # the stand-in nodes' republish delay, seconds: an agent round and a debounce
TIE_ORDERS = 8  # node orders simulate is run with besides the sample's own
PACE_TIMEOUT = 30.0  # paced: the longest wait for one pod's decision, its republish and the extender's cache
SHIPPED_FILE = Path(__file__).resolve().parents[1] / "daemonset/extender/scheduler/second-scheduler.yaml"


def shipped_entry(path: Path = SHIPPED_FILE) -> dict:
    """The extender settings the project ships (the second scheduler's KubeSchedulerConfiguration, which the chart
    renders alike): each entry's weight (0: absent) and NodeResourcesFit's strategy (LeastAllocated: kube-scheduler's
    default)."""
    import yaml

    config_map = next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "ConfigMap")
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    share = next((e["weight"] for e in config.get("extenders", []) if e.get("managedResources")), 0)
    every = next((e["weight"] for e in config.get("extenders", []) if not e.get("managedResources")), 0)
    strategy = "LeastAllocated"
    for arg in (a for p in config["profiles"] for a in p.get("pluginConfig", []) if a["name"] == "NodeResourcesFit"):
        strategy = arg["args"]["scoringStrategy"]["type"]
    return {"share": share, "every": every, "strategy": strategy}


def _entry(share: int, every: int, strategy: str) -> dict:
    return {"share": share, "every": every, "strategy": strategy}


# key: (label, path, extender settings or None: the share entry's weight, the every-pod entry's (0: none),
# NodeResourcesFit's strategy)
CONFIGS: dict[str, tuple[str, str, dict | None]] = {
    "dp-none": ("device plugin, no extender", "dp", None),
    "dp-shipped": ("device plugin, as shipped (daemonset/extender/scheduler)", "dp", None),  # filled by shipped_entry()
    "dp-w5-least": ("device plugin, share entry weight 5, LeastAllocated", "dp", _entry(5, 0, "LeastAllocated")),
    "dp-w5-most": ("device plugin, share entry weight 5, MostAllocated", "dp", _entry(5, 0, "MostAllocated")),
    "dp-w5e5-least": ("device plugin, both entries weight 5, LeastAllocated", "dp", _entry(5, 5, "LeastAllocated")),
    "dp-w5e5-most": ("device plugin, both entries weight 5, MostAllocated", "dp", _entry(5, 5, "MostAllocated")),
    "dp-w20-least": ("device plugin, share entry weight 20, LeastAllocated", "dp", _entry(20, 0, "LeastAllocated")),
    "dp-w20-most": ("device plugin, share entry weight 20, MostAllocated", "dp", _entry(20, 0, "MostAllocated")),
    "dp-w20e20-least": (
        "device plugin, both entries weight 20, LeastAllocated",
        "dp",
        _entry(20, 20, "LeastAllocated"),
    ),
    "dp-w20e20-most": ("device plugin, both entries weight 20, MostAllocated", "dp", _entry(20, 20, "MostAllocated")),
    "dra-none": ("DRA, no extender (first fit)", "dra", None),
    "dra-shipped": (
        "DRA, as shipped (the every-pod entry of daemonset/extender/scheduler)",
        "dra",
        None,
    ),  # filled by shipped_entry()
    "dra-e5-least": ("DRA, every-pod entry weight 5, LeastAllocated", "dra", _entry(0, 5, "LeastAllocated")),
    "dra-e20-least": ("DRA, every-pod entry weight 20, LeastAllocated", "dra", _entry(0, 20, "LeastAllocated")),
    "dra-e20-most": ("DRA, every-pod entry weight 20, MostAllocated", "dra", _entry(0, 20, "MostAllocated")),
}
ALIASES = {"shipped": "dp-shipped"}


def config_keys(text: str) -> list[str]:
    """`all`, or comma-separated keys of CONFIGS (`shipped`: dp-shipped); an unknown key is an error naming it."""
    keys = list(CONFIGS) if text == "all" else [ALIASES.get(k.strip(), k.strip()) for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown or not keys:
        raise SystemExit(
            f"--configs: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join([*ALIASES, *CONFIGS])}"
        )
    return keys


def settings(key: str) -> tuple[str, str, dict | None]:
    label, path, entry = CONFIGS[key]
    if key.endswith("-shipped"):
        entry = shipped_entry()
        if path == "dra":
            entry["share"] = 0
        label = f"{label}: share {entry['share']}, every-pod {entry['every']}, {entry['strategy']}"
    return label, path, entry


@dataclass(frozen=True)
class Sample:
    nodes: list[Node]
    pods: list[PodDemand]  # in arrival order, rounded to shares
    original: list[PodDemand]  # the same, as the trace asks (the KPI counts these)
    simulated: dict[str, float]  # fgdstrand in the simulator: allocation at 100 % and 130 %, and over tie orders
    workload: list[PodDemand]  # the trace's pod list rounded to shares: the task shapes simulate learns


def sample(trace_dir: str | None, nodes: int, seed: int, trace: str = "default") -> Sample:
    """`nodes` nodes and the arrivals of the pod list `trace` (a name of the trace directory's
    openb_pod_list_<name>.csv, or a path)."""
    rng = random.Random(seed)
    all_nodes = load_nodes(resolve(DEFAULT_NODES, trace_dir, "openb_node_list_{}.csv"))
    chosen = [n for n in rng.sample(list(all_nodes), nodes)]
    pods = [
        PodDemand(p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, p.gpu_models, name=p.name)
        for p in load_pods(resolve(trace, trace_dir, POD_FILE))
    ]
    experiment = Experiment(chosen, pods, replicas=REPLICAS)
    run_rng = random.Random(seed)  # drawn exactly as Experiment.run draws
    capacity = MILLI * experiment.gpus
    arrived = arrivals(experiment.pods, capacity, experiment.inflate, run_rng)
    node_order(len(chosen), run_rng)
    result = experiment.run("fgdstrand", seed)
    orders, orders100 = [], []  # the same arrivals with other node orders: simulate's own spread over its tie-breaks
    for k in range(TIE_ORDERS):
        shuffled = list(chosen)
        random.Random(f"{seed}/{k}").shuffle(shuffled)
        curve = Experiment(shuffled, pods, replicas=REPLICAS).run("fgdstrand", seed).curve
        orders.append(100 * curve[-1])
        orders100.append(100 * curve[min(100, len(curve) - 1)])
    simulated = {
        "100": 100 * result.curve[min(100, len(result.curve) - 1)],
        "130": 100 * result.curve[-1],
        "kpi130": 100 * result.allocation,
        "orders100": sum(orders100) / len(orders100),
        "orders130": sum(orders) / len(orders),
        "orders130_min": min(orders),
        "orders130_max": max(orders),
    }
    workload = [experiment.scheduled[p] for p in experiment.pods]
    return Sample(chosen, [share_rounded(p, REPLICAS) for p in arrived], arrived, simulated, workload)


def write_workload(pods: list[PodDemand], path: Path) -> Path:
    """The pod list as `gpu-share extender --workload` reads it."""
    lines = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli"]
    lines += [f"w{i},{p.cpu_milli},{p.memory_mib},{p.num_gpu},{p.gpu_milli}" for i, p in enumerate(pods)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _shares(pod: PodDemand) -> int:
    return pod.gpu_milli * REPLICAS // MILLI


class Run:
    """One configuration on fresh nodes."""

    def __init__(
        self,
        cp,
        api,
        extender_url: str,
        key: str,
        data: Sample,
        paced: bool = False,
        republish: tuple[float, float] = BURST_REPUBLISH,
    ) -> None:
        from kubernetes import client

        self.cp, self.api, self.key, self.data = cp, api, key, data
        self.label, self.path, self.entry = settings(key)
        self.core, self.resource = client.CoreV1Api(api), client.ResourceV1Api(api)
        run = secrets.token_hex(2)
        self.ns = f"bench-{key}-{run}"
        self.scheduler = f"bench-{key}-{run}"
        self.labels = {"gpu-share-bench": self.ns}
        self.nodes = [
            GpuNode(f"{self.ns}-{i}", len(n.gpu_free), n.cpu_milli, n.memory_mib, model=n.model)
            for i, n in enumerate(data.nodes)
        ]
        self.extender_url = extender_url
        self.paced, self.republish = paced, republish
        self.pace_timeouts = 0
        self.plugins: StandInPlugins | None = None
        self.capacity = MILLI * sum(n.gpus for n in self.nodes)
        self.created = 0

    def setup(self) -> None:
        self.core.create_namespace({"metadata": {"name": self.ns}})
        self.core.create_namespaced_service_account(self.ns, {"metadata": {"name": "default"}})
        if self.path == "dp":
            self.plugins = StandInPlugins(
                self.api, self.nodes, self.labels, REPLICAS, "fgdstrand", republish=self.republish, seed=1
            )
            self.plugins.create_nodes()
            self.plugins.start()
        else:
            for node in self.nodes:
                create_node(self.core, node, self.labels, {})
                self.resource.create_resource_slice(resource_slice(node, REPLICAS))

    def config(self) -> dict:
        if self.entry is None:
            return scheduler_config(self.scheduler, None)
        share = self.path == "dp" and self.entry["share"] > 0
        config = scheduler_config(
            self.scheduler, self.extender_url if share else None, self.entry["share"] or 1, self.entry["strategy"]
        )
        if self.entry["every"]:
            config["extenders"] = config.get("extenders", []) + [
                every_pod_entry(self.extender_url, self.entry["every"])
            ]
        return config

    def create(self, index: int, pod: PodDemand) -> None:
        name = f"p{index:05d}"
        if self.path == "dp" or not pod.num_gpu:
            body = share_pod_body(name, 0, pod.cpu_milli, pod.memory_mib, self.scheduler, self.labels)
            if pod.num_gpu:
                count = _shares(pod)
                containers = [
                    {
                        "name": f"c{i}",
                        "image": "registry.invalid/none",
                        "resources": {"limits": {"example.com/gpu-share": str(count)}},
                    }
                    for i in range(pod.num_gpu)
                ]
                containers[0]["resources"]["requests"] = body["spec"]["containers"][0]["resources"]["requests"]
                body["spec"]["containers"] = containers
        else:
            claim = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "exactly": {
                                    "deviceClassName": DRA_CLASS,
                                    "count": pod.num_gpu,
                                    "capacity": {"requests": {"shares": str(_shares(pod))}},
                                },
                            }
                        ]
                    }
                },
            }
            self.resource.create_namespaced_resource_claim(self.ns, claim)
            body = claim_pod_body(name, name, pod.cpu_milli, pod.memory_mib, self.scheduler, self.labels)
        if pod.gpu_models:
            body["spec"]["affinity"] = model_affinity(pod.gpu_models)
        self.core.create_namespaced_pod(self.ns, body)
        self.created += 1

    def bound(self) -> tuple[set[str], int]:
        """Names of the bound pods that hold their resources (not failed at admission), and how many pods are
        decided: bound (admitted or failed) or marked unschedulable."""
        pods = self.core.list_namespaced_pod(self.ns).items
        failed = sum(1 for p in pods if p.spec.node_name and p.status.phase == "Failed")
        bound = {p.metadata.name for p in pods if p.spec.node_name and p.status.phase != "Failed"}
        unschedulable = sum(
            1
            for p in pods
            if not p.spec.node_name
            and any(c.type == "PodScheduled" and c.status == "False" for c in p.status.conditions or [])
        )
        return bound, len(bound) + failed + unschedulable

    def wait_scheduler(self) -> None:
        """Paced: wait until kube-scheduler serves (its first pod must not wait in a queue it has not listed yet)."""
        deadline = time.monotonic() + 60
        probe = share_pod_body("probe", 0, 1, 1, self.scheduler, self.labels)
        probe["spec"]["nodeSelector"] = {"gpu-share-bench-probe": "none"}  # fits nowhere: only its decision counts
        self.core.create_namespaced_pod(self.ns, probe)
        try:
            while time.monotonic() < deadline and not self._decided(self.core.read_namespaced_pod("probe", self.ns)):
                time.sleep(0.05)
        finally:
            self.core.delete_namespaced_pod("probe", self.ns, grace_period_seconds=0)

    @staticmethod
    def _decided(pod) -> bool:
        return bool(pod.spec.node_name) or any(
            c.type == "PodScheduled" and c.status == "False" for c in pod.status.conditions or []
        )

    def wait_decided(self, name: str) -> None:
        """Paced: wait until pod `name` is bound and admitted or marked unschedulable, no node has a republish
        pending, and the extender's cache holds no reservation and no pod its node's annotation does not list yet:
        the next pod meets the cluster exactly as this one left it, as in the simulator (PACE_TIMEOUT at most,
        counted in `pace_timeouts`)."""
        deadline = time.monotonic() + PACE_TIMEOUT
        while time.monotonic() < deadline:
            pod = self.core.read_namespaced_pod(name, self.ns)
            admitted = not pod.spec.node_name or self.plugins is None or self.plugins.holds(pod.metadata.uid, name)
            if self._decided(pod) and admitted and not (self.plugins and self.plugins.pending_republish()):
                cache = extender_cache(self.extender_url)
                if cache.get("reservations", 1) == 0 and cache.get("assumed_pods", 1) == 0:
                    return
            time.sleep(0.02)
        self.pace_timeouts += 1

    def settle(self, started: float, wave: int = 0) -> tuple[set[str], float]:
        """Wait until settled; (bound pods, seconds from `started` until every pod of the `wave` was decided once:
        bound or marked unschedulable, the scheduler's first pass over them)."""
        last_change, seen, first_pass = time.monotonic(), -1, None
        deadline = time.monotonic() + WAVE_TIMEOUT
        while time.monotonic() < deadline:
            bound, decided = self.bound()
            if first_pass is None and decided >= wave:
                first_pass = time.monotonic() - started
            busy = decided < self.created or (self.plugins is not None and self.plugins.pending_republish())
            if len(bound) != seen or busy:
                seen, last_change = len(bound), time.monotonic()
            elif time.monotonic() - last_change >= QUIET:
                break
            time.sleep(0.2)
        return bound, first_pass if first_pass is not None else float("nan")

    def pending_reasons(self) -> dict[str, int]:
        """The scheduler's message on each pending pod, counted (the first 160 characters)."""
        out: dict[str, int] = {}
        for pod in self.core.list_namespaced_pod(self.ns).items:
            if pod.spec.node_name:
                continue
            message = next(
                (c.message or c.reason or "" for c in pod.status.conditions or [] if c.type == "PodScheduled"),
                "no condition",
            )
            out[message[:160]] = out.get(message[:160], 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1])[:5])

    def ratio(self, bound: set[str], upto: int) -> float:
        milli = sum(p.gpu_request for i, p in enumerate(self.data.original[:upto]) if f"p{i:05d}" in bound)
        return 100 * milli / self.capacity

    def run(self) -> dict:
        self.setup()
        demand, wave1 = 0, 0
        for pod in self.data.original:  # the first wave: up to 100 % of capacity
            if demand + pod.gpu_request > self.capacity:
                break
            demand += pod.gpu_request
            wave1 += 1
        if not self.paced:
            for i, pod in enumerate(self.data.pods[:wave1]):
                self.create(i, pod)
        started = time.monotonic()
        self.cp.scheduler(self.config(), self.scheduler)
        try:
            if self.paced:
                self.wait_scheduler()
                for i, pod in enumerate(self.data.pods[:wave1]):
                    self.create(i, pod)
                    self.wait_decided(f"p{i:05d}")
            first: set[str] = set()
            while not first and time.monotonic() - started < 60:  # throughput counts from the first binding
                first = self.bound()[0]
                time.sleep(0.05)
            t_first = time.monotonic()
            bound, seconds = self.settle(t_first, wave1)
            at100 = self.ratio(bound, wave1)
            why100 = self.pending_reasons()
            paced_or_none = self.paced or seconds <= 0  # paced: the arrivals set the pace, not the scheduler
            throughput = float("nan") if paced_or_none else (wave1 - len(first)) / seconds
            for i, pod in enumerate(self.data.pods[wave1:], start=wave1):
                self.create(i, pod)
                if self.paced:
                    self.wait_decided(f"p{i:05d}")
            bound, _ = self.settle(time.monotonic())
            at130 = self.ratio(bound, len(self.data.pods))
            gpu_pods = [i for i, p in enumerate(self.data.pods) if p.num_gpu]
            pending_gpu = sum(1 for i in gpu_pods if f"p{i:05d}" not in bound)
            why = self.pending_reasons()
        finally:
            self.cp.stop_process(f"kube-scheduler#{self.scheduler}")
            if self.plugins is not None:
                self.plugins.stop()
        failures = len(self.plugins.failures) if self.plugins is not None else 0
        order, refusals = self.decisions()
        return {
            "config": self.key,
            "label": self.label,
            "allocation_100": round(at100, 2),
            "allocation_130": round(at130, 2),
            "failed_admissions": failures,
            "pods_per_second": round(throughput, 1),
            "pods": len(self.data.pods),
            "gpu_pods_pending": pending_gpu,
            "pending_reasons": why,
            "pending_reasons_100": why100,
            "standin_errors": self.plugins.errors[:3] if self.plugins is not None else [],
            "mode": "paced" if self.paced else "burst",
            "pace_timeouts": self.pace_timeouts,
            "bindings": order,
            "unschedulable_attempts": refusals,
        }

    def decisions(self) -> tuple[list[list], dict[str, int]]:
        """From kube-scheduler's log (--v=2): the bindings in order, each [pod, node index], and per pod how often
        it was found unschedulable (pods never refused are left out); what differs between two runs."""
        path = self.cp.work / "logs" / f"kube-scheduler#{self.scheduler}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        prefix = f'pod="{self.ns}/'
        order: list[list] = []
        refusals: dict[str, int] = {}
        for line in text.splitlines():
            start = line.find(prefix)
            if start < 0:
                continue
            pod = line[start + len(prefix) :].split('"', 1)[0]
            if "Successfully bound pod to node" in line:
                node = line.split(f'node="{self.ns}-', 1)[-1].split('"', 1)[0]
                order.append([pod, int(node) if node.isdigit() else -1])
            elif "Unable to schedule pod" in line:
                refusals[pod] = refusals.get(pod, 0) + 1
        return order, refusals


def extender_cache(url: str) -> dict[str, int]:
    """The extender's `gpushare_extender_cache` gauges (reservations, assumed_pods, ...) from its /metrics."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith('gpushare_extender_cache{kind="'):
            kind, value = line[len('gpushare_extender_cache{kind="') :].split('"} ')
            out[kind] = int(float(value))
    return out


def start_extender(cp, port: int, workload: Path | None) -> subprocess.Popen:
    """`workload`: the extender's --workload file (None: it learns the task shapes from the pods bound)."""
    command = [
        sys.executable,
        "-m",
        "deviceplugin.cli",
        "extender",
        "--kubeconfig",
        str(cp.admin_kubeconfig),
        "--port",
        str(port),
        "--policy",
        "fgdstrand",
        "--dra-class",
        DRA_CLASS,
        *(["--workload", str(workload)] if workload is not None else []),
    ]
    log = open(cp.work / "logs" / "extender.log", "wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/readyz", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"extender at {url} not ready after {timeout:g} s")


def republish_delay(text: str | None, paced: bool) -> tuple[float, float]:
    """`--republish LOW,HIGH` (seconds, 0 <= LOW <= HIGH <= 60); default 2,5, or 0,0 when paced."""
    if text is None:
        return (0.0, 0.0) if paced else BURST_REPUBLISH
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--republish: LOW,HIGH seconds, not {text!r}") from None
    if not 0 <= low <= high <= 60:
        raise SystemExit(f"--republish: 0 <= LOW <= HIGH <= 60 seconds, not {text!r}")
    return low, high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace-dir")
    parser.add_argument("--nodes", type=int, default=16, help="nodes sampled from the trace (default %(default)s)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--trace",
        default="default",
        help="the pod list: openb_pod_list_<TRACE>.csv of the trace directory, or a CSV path (default %(default)s)",
    )
    parser.add_argument(
        "--configs", default="all", help=f"comma-separated, of {', '.join([*ALIASES, *CONFIGS])} (default all)"
    )
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument(
        "--pace",
        action="store_true",
        help="paced: each pod arrives once the previous one is decided, republished and in the extender's cache, "
        "in arrival order, as the simulator places them (default: the first wave at once, then the burst)",
    )
    parser.add_argument(
        "--republish",
        help="the stand-in nodes' republish delay, LOW,HIGH seconds (default 2,5; paced: 0,0, it is waited for)",
    )
    parser.add_argument(
        "--shapes",
        choices=("trace", "learned"),
        default="trace",
        help="where the extender's fgdstrand takes the task shapes from: the trace's pod list as simulate does "
        "(--workload), or learned from the pods bound (default %(default)s)",
    )
    parser.add_argument(
        "--logs", type=Path, help="copy the control plane's, kube-scheduler's and the extender's logs to this folder"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings(
        "ignore", message="Unverified HTTPS request"
    )  # the loopback API server's self-signed certificate
    keys = config_keys(args.configs)
    republish = republish_delay(args.republish, args.pace)
    from tests.support.controlplane import ControlPlane, _free_port, assets_dir

    bin_dir = assets_dir()
    if bin_dir is None:
        print("skipped: needs the control-plane binaries (KUBEBUILDER_ASSETS)")
        return 0
    data = sample(args.trace_dir, args.nodes, args.seed, args.trace)
    gpus = sum(len(n.gpu_free) for n in data.nodes)
    print(
        f"sample: {len(data.nodes)} nodes, {gpus} GPUs, {len(data.pods)} pods "
        f"({sum(1 for p in data.pods if p.num_gpu)} GPU pods); trace {args.trace}, seed {args.seed}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"gpu-share simulate, fgdstrand, same sample: {data.simulated['100']:.2f} % at 100 %, "
        f"{data.simulated['130']:.2f} % at 130 % ({TIE_ORDERS} other node orders: mean "
        f"{data.simulated['orders100']:.2f} at 100 %, {data.simulated['orders130']:.2f} at 130 %, "
        f"{data.simulated['orders130_min']:.2f}-"
        f"{data.simulated['orders130_max']:.2f});"
        f" extender task shapes: {args.shapes}"
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below: stop what this run started
    cp = ControlPlane.start(bin_dir)
    port = _free_port()
    workload = write_workload(data.workload, cp.work / "workload.csv") if args.shapes == "trace" else None
    extender = start_extender(cp, port, workload)
    results = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
        from kubernetes import client

        api = cp.api_client()
        client.ResourceV1Api(api).create_device_class(device_class())
        print(
            "| configuration | allocation % at 100 % demand | at 130 % | failed admissions | pods/s (first pass) "
            "| GPU pods left pending |"
        )
        print("|---|---|---|---|---|---|")
        for key in keys:
            result = Run(cp, api, url, key, data, args.pace, republish).run()
            results.append(result)
            print(
                f"| {result['label']} | {result['allocation_100']:.2f} | {result['allocation_130']:.2f} "
                f"| {result['failed_admissions']} | "
                f"{result['pods_per_second']} | {result['gpu_pods_pending']} |",
                flush=True,
            )
    finally:
        extender.terminate()
        extender.wait(10)
        if args.logs:
            shutil.copytree(cp.work / "logs", args.logs, dirs_exist_ok=True)
        cp.stop()
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "trace": args.trace,
                    "seed": args.seed,
                    "nodes": len(data.nodes),
                    "gpus": gpus,
                    "simulated": data.simulated,
                    "shapes": args.shapes,
                    "results": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

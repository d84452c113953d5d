"""The packing simulator driving the scheduler extender's code path: allocation ratio and node-plugin agreement.

    python -m benchmarks.extender_replay [--pods default] [--policies binpack,fgdstrand] [--seeds 42-44] [--replicas 10]
    # seconds:
    python -m benchmarks.extender_replay --trace-dir tests/traces --nodes toy_nodes.csv --pods toy --seeds 1-2

The simulator's protocol (deviceplugin/cluster/simulator.py: the same arrivals, node order and KPI per seed), but
each GPU pod is placed as kube-scheduler with the extender would place it: kube-scheduler's own filters (CPU,
memory, pod count, GPU model), then the extender's `filter` and `prioritize` verbs on its cache, the node with the
highest extender score (ties to the first in node order), and on that node the units the kubelet gets from the
node plugin's GetPreferredAllocation (deviceplugin/alloc/placement.py) on a built Resource. After each binding the
node republishes its annotation. A fractional pod asks for its request rounded up to shares of 1/`replicas`
GPU; a pod of k whole GPUs has k containers of `replicas` shares each; every pod asks for its CPU and memory.
CPU-only pods go through the extender's every-pod entry (`prioritize(..., every_pod=True)`, scored by the GPUs they
would strand) after kube-scheduler's own filters, the node with the highest score taking them. Every
bound pod reaches the extender's cache as its pod watch would deliver it, and each node's allocatable is the
trace's, so the extender sees each node's free CPU and memory. The task shapes the extender learns are those of
the pod list (the workload the cluster runs), as the simulator's: from the pods' shares, CPU and memory, without
GPU-model constraints (a pod's requests do not say them).

Printed per policy, mean over the seeds: the allocation ratio through the extender beside the simulator's
(the policy alone at the same `replicas`), and how often the node plugin took the unit the extender assumed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache

from prometheus_client import CollectorRegistry

from deviceplugin.alloc.placement import preferred_allocation
from deviceplugin.alloc.plan import build_resources
from deviceplugin.cluster import MILLI, Node, PodDemand, place
from deviceplugin.cluster.capacity import host_fits
from deviceplugin.cluster.report import parse_policies, parse_seeds
from deviceplugin.cluster.simulator import Experiment, arrivals, node_order
from deviceplugin.cluster.traces import DEFAULT_NODES, POD_FILE, load_nodes, load_pods, resolve
from deviceplugin.config.parse import parse_config
from deviceplugin.extender.cache import ClusterCache, PodState
from deviceplugin.extender.fit import place as extender_place
from deviceplugin.extender.inputs import HostCapacity, pod_demand, pod_request
from deviceplugin.extender.metrics import ExtenderMetrics
from deviceplugin.extender.score import Scorer
from deviceplugin.extender.verbs import Extender
from deviceplugin.kube.annotation import pod_digest
from deviceplugin.model.devices import Resource
from deviceplugin.model.node import Gpu, NodeInfo

SHARE = "example.com/gpu-share"
# The node plugin's allocationPolicy beside each extender --policy: the GPU choice on the node closest to the
# simulator's (binpack for the best-fit family, spread's worst fit, the cluster policy fgdstrand for fgd*).
NODE_POLICY = {"spread": "spread", "fgd": "fgdstrand", "fgdstrand": "fgdstrand"}


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    seed: int
    allocation: float  # through the extender
    alone: float  # the simulator: the policy alone, same seed and replicas
    share_pods: int  # fractional pods the extender placed
    share_agree: int  # of them, the node plugin took the unit the extender assumed
    whole_pods: int
    whole_agree: int


@lru_cache(maxsize=16)
def node_resource(gpus: int, replicas: int, policy: str) -> Resource:
    """The node plugin's shared resource on a node of `gpus` GPUs (what GetPreferredAllocation works on)."""
    node = NodeInfo(
        gpus=tuple(
            Gpu(index=i, uuid=f"GPU-replay00-0000-4000-8000-{i:012d}", model="sim", memory_mib=81920)
            for i in range(gpus)
        ),
        name="replay",
    )
    config = parse_config(
        {
            "version": "v1",
            "allocationPolicy": policy,
            "pools": [{"name": "s", "mode": "shared", "resource": "gpu-share", "replicas": replicas}],
        }
    )
    return build_resources(config, node)[0]


def annotation(resource: Resource, used: list[int], policy: str, pods: list[str] | tuple[str, ...] = ()) -> str:
    units = [
        {"uuid": u.uuid, "gpu": i, "total": u.replicas, "used": n, "free": u.replicas - n, "health": "Healthy"}
        for i, (u, n) in enumerate(zip(resource.units, used, strict=True))
    ]
    return json.dumps(
        {
            "version": 2,
            "generation": 1,
            "gpus": [],
            "pods": list(pods),
            "resources": {SHARE: {"pool": "s", "allowSpanGPUs": False, "allocationPolicy": policy, "units": units}},
        }
    )


def share_pod(pod: PodDemand, replicas: int, uid: str) -> dict:
    """The Pod object kube-scheduler would send for a cluster-model pod (its CPU and memory on the first container)."""
    if pod.fractional:
        counts = [-(-pod.gpu_milli * replicas // MILLI)]
    else:
        counts = [replicas] * pod.num_gpu
    containers: list[dict] = [
        {"name": f"c{i}", "resources": {"limits": {SHARE: str(n)}}} for i, n in enumerate(counts)
    ] or [{"name": "c0", "resources": {}}]
    containers[0]["resources"]["requests"] = {"cpu": f"{pod.cpu_milli}m", "memory": f"{pod.memory_mib}Mi"}
    return {"metadata": {"name": uid, "namespace": "replay", "uid": uid}, "spec": {"containers": containers}}


def host(node: Node) -> HostCapacity:
    return HostCapacity(node.cpu_milli, node.memory_mib, node.max_pods)


def learned_workload(experiment: Experiment, replicas: int) -> list[PodDemand]:
    """The pod list as the extender's cache turns bound pods into cluster-model pods (what it learns shapes from)."""
    managed = lambda r: r == SHARE  # noqa: E731
    out = []
    for pod in experiment.pods:
        request = pod_request(share_pod(pod, replicas, "w"), managed)
        out.append(PodDemand(pod.cpu_milli, pod.memory_mib) if request.empty else pod_demand(request, replicas))
    return out


def replay(experiment: Experiment, policy_name: str, seed: int) -> ReplayResult:
    replicas = experiment.replicas or 100
    node_policy = NODE_POLICY.get(policy_name, "binpack")
    rng = random.Random(seed)  # drawn exactly as Experiment.run draws
    capacity = MILLI * experiment.gpus
    pods = arrivals(experiment.pods, capacity, experiment.inflate, rng)
    nodes = [experiment.nodes[i].copy() for i in node_order(len(experiment.nodes), rng)]
    workload = learned_workload(experiment, replicas)
    cache = ClusterCache()
    extender = Extender(
        cache,
        Scorer(policy_name, workload=lambda: workload),
        lambda r: r == SHARE,
        ExtenderMetrics(CollectorRegistry(), cache.counts),
    )
    used = [[0] * len(n.gpu_free) for n in nodes]
    digests: list[list[str]] = [[] for _ in nodes]  # the share pods each node's annotation lists
    index = {n.name: i for i, n in enumerate(nodes)}
    for i, node in enumerate(nodes):
        text = (
            annotation(node_resource(len(node.gpu_free), replicas, node_policy), used[i], node_policy)
            if node.gpu_free
            else None
        )
        cache.set_node(node.name, text, host(node))
    target = int(100 * experiment.inflate + 0.5)
    arrived = allocated = 0
    at_target: list[int] = []
    counts = {"share": [0, 0], "whole": [0, 0]}
    for k, pod in enumerate(pods):
        uid = f"p{k}"
        if pod.num_gpu == 0:
            chosen = _cpu_through_extender(extender, pod, nodes, index, replicas, uid)
        else:
            chosen = _through_extender(extender, pod, nodes, index, used, digests, replicas, node_policy, uid, counts)
        if chosen is not None:
            request = pod_request(
                share_pod(pod, replicas, uid), extender.managed
            )  # the pod watch delivers the bound pod
            cache.set_pod(
                PodState(uid, nodes[chosen].name, request, "" if request.empty else pod_digest("replay", uid))
            )
            allocated += pod.gpu_request
        arrived += pod.gpu_request
        if int(100 * arrived / capacity + 0.5) == target:
            at_target.append(allocated)
    allocation = (sum(at_target) / len(at_target) if at_target else allocated) / capacity
    alone = experiment.run(policy_name, seed).allocation
    return ReplayResult(policy_name, seed, allocation, alone, *counts["share"], *counts["whole"])


def _cpu_through_extender(
    extender: Extender, pod: PodDemand, nodes: list[Node], index: dict[str, int], replicas: int, uid: str
) -> int | None:
    """A CPU-only pod: kube-scheduler's own filters, then the every-pod entry's scores (ties to the first in order)."""
    candidates = [n.name for n in nodes if host_fits(pod, n)]
    if not candidates:
        return None
    scores = extender.prioritize(
        {"Pod": share_pod(pod, replicas, uid), "Nodes": None, "NodeNames": candidates}, every_pod=True
    )
    top = max(s["Score"] for s in scores)
    i = index[next(s["Host"] for s in scores if s["Score"] == top)]
    place(pod, nodes[i], ())
    return i


def _through_extender(
    extender: Extender,
    pod: PodDemand,
    nodes: list[Node],
    index: dict[str, int],
    used: list[list[int]],
    digests: list[list[str]],
    replicas: int,
    node_policy: str,
    uid: str,
    counts: dict,
) -> int | None:
    candidates = [
        n.name for n in nodes if n.gpu_free and host_fits(pod, n) and pod.accepts(n.model)
    ]  # kube-scheduler's own filters
    body = share_pod(pod, replicas, uid)
    passed = extender.filter({"Pod": body, "Nodes": None, "NodeNames": candidates})["NodeNames"]
    if not passed:
        return None
    scores = extender.prioritize({"Pod": body, "Nodes": None, "NodeNames": passed})
    top = max(s["Score"] for s in scores)
    name = next(s["Host"] for s in scores if s["Score"] == top)
    i = index[name]
    inventory, free = extender.cache.node(name, exclude=uid)
    request = pod_request(body, extender.managed)
    assumed = [p.unit for p in extender_place(request, inventory, dict(free)).placements]
    resource = node_resource(len(nodes[i].gpu_free), replicas, node_policy)
    taken = []
    for container in request.together:  # the kubelet asks for each container in turn
        ((_, count),) = container.shares
        available = [
            d.id for d in resource.devices.values() if d.share >= used[i][d.gpu.index]
        ]  # shares 0..used-1 are taken
        chosen = {resource.devices[d].gpu.index for d in preferred_allocation(resource, available, [], count)}
        (unit,) = chosen
        used[i][unit] += count
        taken.append(unit)
    kind = counts["share" if pod.fractional else "whole"]
    kind[0] += 1
    kind[1] += sorted(taken) == sorted(assumed)
    extender.cache.forget_reservation(uid)  # bound: the node republishes its annotation
    digests[i].append(pod_digest("replay", uid))
    extender.cache.set_node(name, annotation(resource, used[i], node_policy, digests[i]), host(nodes[i]))
    want = PodDemand(
        pod.cpu_milli,
        pod.memory_mib,
        pod.num_gpu,
        count * MILLI // replicas if pod.fractional else MILLI,
        name=pod.name,
    )
    place(want, nodes[i], tuple(sorted(taken)) if not pod.fractional else (taken[0],))
    return i


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace-dir")
    parser.add_argument("--nodes", default=DEFAULT_NODES)
    parser.add_argument("--pods", default="default", help="the pod list (openb_pod_list_NAME.csv)")
    parser.add_argument("--policies", type=parse_policies, default=parse_policies("binpack,fgdstrand"))
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("42-44"))
    parser.add_argument("--replicas", type=int, default=10)
    args = parser.parse_args(argv)
    experiment = Experiment(
        load_nodes(resolve(args.nodes, args.trace_dir, "openb_node_list_{}.csv")),
        load_pods(resolve(args.pods, args.trace_dir, POD_FILE)),
        replicas=args.replicas,
    )
    print(
        f"{args.pods}: {len(experiment.nodes)} nodes, {experiment.gpus} GPUs; replicas {args.replicas}; "
        f"seeds {args.seeds[0]}-{args.seeds[-1]}"
    )
    print(
        "| policy | allocation % through the extender | the policy alone | share pods: node plugin took the "
        "assumed unit | whole-GPU pods |"
    )
    print("|---|---|---|---|---|")
    for policy in args.policies:
        results = [replay(experiment, policy, seed) for seed in args.seeds]
        print(
            f"| {policy} | {_mean(r.allocation for r in results)} | {_mean(r.alone for r in results)} | "
            f"{_rate(results, 'share')} | {_rate(results, 'whole')} |",
            flush=True,
        )
    return 0


def _mean(values) -> str:
    values = [100 * v for v in values]
    return f"{statistics.fmean(values):.2f} ± {statistics.pstdev(values):.2f}"


def _rate(results: list[ReplayResult], kind: str) -> str:
    pods = sum(getattr(r, f"{kind}_pods") for r in results)
    agree = sum(getattr(r, f"{kind}_agree") for r in results)
    return f"{100 * agree / max(pods, 1):.2f} % of {pods}"


if __name__ == "__main__":
    sys.exit(main())

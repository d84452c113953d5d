"""The extender's verbs on a cache: filter with the reason each node fails, prioritize by the packing policy (fgd's
learned shapes, fgdstrand's CPU), DRA claims."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from deviceplugin.cluster import PodDemand
from deviceplugin.extender.cache import ClusterCache, pod_state
from deviceplugin.extender.inputs import HostCapacity, pod_request
from deviceplugin.extender.metrics import ExtenderMetrics
from deviceplugin.extender.score import Scorer
from deviceplugin.extender.verbs import Extender
from tests.support.extender import SHARE, annotation, args, extender, host_pod, managed, pod


def reasons(nodes: dict[str, str], p: dict) -> dict:
    result = extender(nodes).filter(args(p, *nodes))
    return {
        "passed": result["NodeNames"],
        **result["FailedNodes"],
        **{k: "UNRESOLVABLE " + v for k, v in result["FailedAndUnresolvableNodes"].items()},
    }


def test_failure_reasons_name_what_blocks_the_pod():
    got = reasons(
        {
            "split": annotation((4, 2), (4, 2)),
            "unhealthy": annotation((4, 0, "Unhealthy"), (4, 2)),
            "quarantined": annotation((4, 0, "Quarantined"), (4, 3)),
            "mig": annotation((2, 0, "Healthy", "1g.10gb"), (2, 1, "Healthy", "1g.10gb")),
            "small": annotation((2, 0)),
            "full": annotation((4, 3), (4, 4)),
            "no-resource": annotation((4, 0), resource="example.com/gpu"),
            "no-annotation": None,
            "old-plugin": json.dumps([{"uuid": "GPU-0", "sharesTotal": 4}]),
            "fits": annotation((4, 3), (4, 1)),
        },
        pod("p", {SHARE: 3}),
    )
    assert got["passed"] == ["fits"]
    assert (
        got["split"]
        == "gpu-share: container c0 asks for 3 shares of example.com/gpu-share on one GPU; the most free on one "
        "GPU is 2 (free 2+2 on 2 GPUs)"
    )
    assert (
        got["unhealthy"]
        == "gpu-share: container c0 asks for 3 shares of example.com/gpu-share; GPU 0 would have room but is Unhealthy"
    )
    assert "GPU 0 would have room but is quarantined (a finished tenant's memory is still on it)" in got["quarantined"]
    assert (
        got["mig"]
        == "UNRESOLVABLE gpu-share: container c0 asks for 3 shares of example.com/gpu-share; each MIG instance "
        "of this node has at most 2"
    )
    assert got["small"].startswith("UNRESOLVABLE") and "each GPU of this node has at most 2" in got["small"]
    assert got["full"] == "gpu-share: container c0 asks for 3 shares of example.com/gpu-share; the node has 1 free"
    assert (
        got["no-resource"]
        == "UNRESOLVABLE gpu-share: node has no example.com/gpu-share (not in its gpu-share inventory)"
    )
    assert "no gpu-share inventory annotation" in got["no-annotation"]
    assert "annotation must be a JSON object" in got["old-plugin"]


def test_mig_split_reason_and_every_container_on_one_unit():
    nodes = {"mig": annotation((4, 1, "Healthy", "3g.40gb"), (4, 1, "Healthy", "3g.40gb"))}
    assert (
        "on one MIG instance; the most free on one MIG instance is 3 (free 3+3 on 2 MIG instances)"
        in reasons(nodes, pod("p", {SHARE: 4}))["mig"]
    )
    # Two containers of 3: one on each instance.
    assert reasons(nodes, pod("p", {SHARE: 3}, {SHARE: 3}))["passed"] == ["mig"]
    assert "container c2" in reasons(nodes, pod("p", {SHARE: 3}, {SHARE: 3}, {SHARE: 1}))["mig"]


def test_allow_span_gpus_and_init_containers():
    spanning = {"span": annotation((4, 1), (4, 1), span=True)}
    assert reasons(spanning, pod("p", {SHARE: 6}))["passed"] == ["span"]
    assert "the node has 6 free" in reasons(spanning, pod("p", {SHARE: 7}))["span"]
    node = {"n": annotation((4, 0), (4, 2))}
    # An init container runs alone before the others: 4 then 4 + 2 fits; a 5-share init container does not.
    assert reasons(node, pod("p", {SHARE: 4}, {SHARE: 2}, init=({SHARE: 4},)))["passed"] == ["n"]
    assert "container c9 asks for 5 shares" in reasons(node, pod("p", {SHARE: 1}, init=({SHARE: 5},)))["n"]


def test_binpack_and_spread_choose_the_unit_as_the_node_plugin_does():
    cache = ClusterCache()
    cache.set_node("binpack", annotation((4, 0), (4, 2)))
    cache.set_node("spread", annotation((4, 0), (4, 2), policy="spread"))
    for name, taken in (("binpack", [4, 1]), ("spread", [3, 2])):
        cache.set_pod(
            pod_state(
                pod("a", {SHARE: 1}, node=name, uid=f"a-{name}"),
                pod_request(pod("a", {SHARE: 1}, uid=f"a-{name}"), managed),
            )
        )
        assert cache.node(name)[1] == {SHARE: taken}


def test_fgd_learns_task_shapes_from_bound_pods_and_falls_back_to_binpack():
    clock = [0.0]
    cache = ClusterCache()
    scorer = Scorer("fgd", workload=cache.workload, refresh=60, clock=lambda: clock[0])
    ext = Extender(cache, scorer, managed, ExtenderMetrics(CollectorRegistry(), cache.counts))
    # a: one GPU with 4 free of 10; b: an empty GPU. A 4-share pod.
    cache.set_node("a", annotation((10, 6), (10, 10)))
    cache.set_node("b", annotation((10, 0), (10, 10)))
    p = pod("p", {SHARE: 4})
    assert scorer.policy.name == "binpack"  # no bound share pods yet: nothing to learn from
    binpack = {s["Host"]: s["Score"] for s in ext.prioritize(args(p, "a", "b"))}
    assert binpack["a"] > binpack["b"]
    # The workload is made of 6-share pods: keeping b's whole GPU free for them is what fgd prefers.
    for i in range(5):
        cache.set_pod(pod_state(pod(f"w{i}", {SHARE: 6}, node="c"), pod_request(pod(f"w{i}", {SHARE: 6}), managed)))
    cache.set_node("c", annotation((10, 10), (10, 10), (10, 10)))
    clock[0] = 61.0
    fgd = {s["Host"]: s["Score"] for s in ext.prioritize(args(p, "a", "b"))}
    assert scorer.policy.name == "fgd" and fgd["a"] > fgd["b"]
    assert cache.workload() == [PodDemand(0, 0, num_gpu=1, gpu_milli=600)] * 5


def test_fgdstrand_through_the_extender_keeps_cpu_for_the_idle_gpus():
    """Two nodes of 8 idle GPUs; one has 30 cores free, the other 96. A 1-share pod asking for 16 cores would leave
    the first 14 cores for 8 GPUs (the workload asks 12 per GPU): fgdstrand sends it to the other. FGD sees no
    difference: both nodes still run every shape afterwards."""
    cache = ClusterCache()
    gpus = [(10, 0)] * 8
    cache.set_node("tight", annotation(*gpus), HostCapacity(30_000, 400_000, 110))
    cache.set_node("roomy", annotation(*gpus), HostCapacity(96_000, 400_000, 110))
    cache.set_node("busy", annotation((10, 10)), HostCapacity(96_000, 400_000, 110))
    for i in range(4):  # the workload: 1 GPU and 12 cores each
        body = host_pod(f"w{i}", "12", "40Gi", node="busy", shares=10)
        cache.set_pod(pod_state(body, pod_request(body, managed)))
    learned = cache.workload()
    assert learned == [PodDemand(12_000, 40_960, num_gpu=1, gpu_milli=1000)] * 4
    heavy = host_pod("heavy", "16", "8Gi", shares=1)
    scores = {}
    for policy in ("fgd", "fgdstrand"):
        ext = Extender(
            cache, Scorer(policy, workload=cache.workload), managed, ExtenderMetrics(CollectorRegistry(), cache.counts)
        )
        scores[policy] = {s["Host"]: s["Score"] for s in ext.prioritize(args(heavy, "tight", "roomy"))}
    assert scores["fgdstrand"] == {"roomy": 10, "tight": 9}
    assert sorted(scores["fgd"].values()) == [9, 10]  # alike to fgd: one alone on top (score.tie_winner)
    # The same node for every pod alike (one order of the nodes, not a pick per pod UID).
    tops = set()
    for k in range(16):
        alike = host_pod(f"heavy-{k}", "16", "8Gi", shares=1)
        ranks = {s["Host"]: s["Score"] for s in ext.prioritize(args(alike, "tight", "roomy"))}
        tops.add(max(ranks, key=ranks.__getitem__))
    assert len(tops) == 1


def test_dra_claims_are_scored_by_the_policy_on_the_nodes_devices_first_fit():
    from benchmarks.standin import DRA_CLASS, DRA_DRIVER, GpuNode, claim_pod_body, resource_slice, share_claim
    from deviceplugin.extender.dra import claim_info, slice_info

    cache = ClusterCache(driver=DRA_DRIVER, classes=frozenset({DRA_CLASS}))
    for name in ("a", "b"):
        cache.set_node(name, None, HostCapacity(64_000, 262_144, 110))
        cache.set_slice(f"{name}-slice", slice_info(resource_slice(GpuNode(name, 2, 64_000, 262_144)), DRA_DRIVER))
    # a: gpu-0 holds 6 shares (an allocated claim); b: empty.
    held = share_claim("held", 6)
    held["metadata"].update(namespace="team", uid="uid-held")
    held["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": DRA_DRIVER,
                        "pool": "a",
                        "device": "gpu-0",
                        "shareID": "0b0c0d0e-0000-4000-8000-000000000001",
                        "consumedCapacity": {"shares": "6", "memory": "48Gi"},
                    }
                ]
            }
        },
        "reservedFor": [{"resource": "pods", "name": "x", "uid": "uid-x"}],
    }
    cache.set_claim(("team", "held"), claim_info(held, DRA_DRIVER, frozenset({DRA_CLASS})))
    assert cache.node("a")[1] == {DRA_DRIVER: [4, 10]} and cache.node("b")[1] == {DRA_DRIVER: [10, 10]}
    want = share_claim("want", 4)
    want["metadata"].update(namespace="team", uid="uid-want")
    cache.set_claim(("team", "want"), claim_info(want, DRA_DRIVER, frozenset({DRA_CLASS})))
    ext = Extender(cache, Scorer("binpack"), managed, ExtenderMetrics(CollectorRegistry(), cache.counts))
    body = claim_pod_body("p", "want", 1000, 1024, "s", {})
    body["metadata"].update(namespace="team", uid="uid-p")
    # The device-plugin entry has nothing to judge; the DRA entry sends it where it fills gpu-0 (first fit there).
    assert ext.filter(args(body, "a", "b"))["NodeNames"] == ["a", "b"]
    assert {s["Host"]: s["Score"] for s in ext.prioritize(args(body, "a", "b"), every_pod=True)} == {"a": 10, "b": 9}
    assert ext.filter(args(body, "a", "b"), every_pod=True)["NodeNames"] == ["a", "b"]  # and reserves 4 shares on both
    assert cache.node("a")[1] == {DRA_DRIVER: [0, 10]}
    # Allocated on a and reserved for the pod: counted once, by the claim; the reservation ends.
    want["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": DRA_DRIVER,
                        "pool": "a",
                        "device": "gpu-0",
                        "shareID": "0b0c0d0e-0000-4000-8000-000000000002",
                        "consumedCapacity": {"shares": "4"},
                    }
                ]
            }
        },
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "uid-p"}],
    }
    cache.set_claim(("team", "want"), claim_info(want, DRA_DRIVER, frozenset({DRA_CLASS})))
    assert cache.node("a")[1] == {DRA_DRIVER: [0, 10]} and cache.node("b")[1] == {DRA_DRIVER: [10, 10]}
    assert cache.dra_request(body) == ()
    # The pod bound: fgd and fgdstrand learn its shape from what its claim holds (4 of 10 shares), with its CPU.
    bound = claim_pod_body("p", "want", 1000, 1024, "s", {})
    bound["metadata"].update(namespace="team", uid="uid-p")
    bound["spec"]["nodeName"] = "a"
    cache.set_pod(pod_state(bound, pod_request(bound, managed)))
    assert cache.workload() == [PodDemand(1000, 1024, num_gpu=1, gpu_milli=400)]
    # A claim that fits no single device is filtered out with the reason; a pod without claims passes untouched.
    big = share_claim("big", 11)
    big["metadata"].update(namespace="team", uid="uid-big")
    cache.set_claim(("team", "big"), claim_info(big, DRA_DRIVER, frozenset({DRA_CLASS})))
    result = ext.filter(
        args(
            claim_pod_body("q", "big", 0, 0, "s", {})
            | {"metadata": {"namespace": "team", "name": "q", "uid": "uid-q"}},
            "b",
        ),
        every_pod=True,
    )
    assert "each GPU of this node has at most 10" in result["FailedAndUnresolvableNodes"]["b"]
    assert ext.prioritize(args(pod("share", {SHARE: 1}), "a", "b"), every_pod=True) == [
        {"Host": "a", "Score": 0},
        {"Host": "b", "Score": 0},
    ]


def test_every_pod_entry_sends_a_cpu_only_pod_where_it_strands_no_gpu():
    """fgdstrand on a 16-core pod without GPUs: a node of 8 idle GPUs and 30 free cores would be left unable to feed
    them; a node whose GPUs are all used, or one without GPUs, loses nothing."""
    cache = ClusterCache()
    cache.set_node("gpus", annotation(*[(10, 0)] * 8), HostCapacity(30_000, 400_000, 110))
    cache.set_node("full", annotation(*[(10, 10)] * 8), HostCapacity(30_000, 400_000, 110))
    cache.set_node("cpu", None, HostCapacity(64_000, 256_000, 110))
    for i in range(4):  # the workload: 1 GPU and 12 cores each
        body = host_pod(f"w{i}", "12", "40Gi", node="busy", shares=10)
        cache.set_pod(pod_state(body, pod_request(body, managed)))
    cache.set_node("busy", annotation((10, 10)), HostCapacity(96_000, 400_000, 110))
    ext = Extender(
        cache, Scorer("fgdstrand", workload=cache.workload), managed, ExtenderMetrics(CollectorRegistry(), cache.counts)
    )
    plain = host_pod("plain", "16", "8Gi")
    assert ext.filter(args(plain, "gpus", "full", "cpu"), every_pod=True)["NodeNames"] == ["gpus", "full", "cpu"]
    assert cache.counts()["reservations"] == 0  # nothing of ours to reserve
    assert {s["Host"]: s["Score"] for s in ext.prioritize(args(plain, "gpus", "full", "cpu"), every_pod=True)} == {
        "gpus": 9,
        "full": 10,
        "cpu": 10,
    }  # no idle GPU on either: alike, no tie winner for a CPU-only pod (kube-scheduler's own scores decide)
    assert {s["Host"]: s["Score"] for s in ext.prioritize(args(plain, "gpus", "full"))} == {
        "gpus": 0,
        "full": 0,
    }  # the share entry: not its pod

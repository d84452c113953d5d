"""The extender's cache: assumed pods and in-flight reservations, cached views, and every pod's CPU, memory and slot."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from deviceplugin.extender.cache import ClusterCache, pod_state
from deviceplugin.extender.inputs import HostCapacity, pod_request
from deviceplugin.extender.metrics import ExtenderMetrics
from deviceplugin.extender.score import Scorer
from deviceplugin.extender.verbs import Extender
from deviceplugin.kube.annotation import pod_digest
from tests.support.extender import SHARE, annotation, args, extender, host_pod, managed, pod


def test_two_pods_in_one_annotation_period_do_not_take_the_last_shares():
    ext = extender({"n": annotation((4, 2), (4, 4)), "m": annotation((4, 0), (4, 0))})
    first, second = pod("first", {SHARE: 2}), pod("second", {SHARE: 2})
    assert ext.filter(args(first, "n"))["NodeNames"] == ["n"]
    # `first` is bound to n; the annotation does not count it yet.
    ext.cache.set_pod(pod_state(pod("first", {SHARE: 2}, node="n"), pod_request(first, managed)))
    result = ext.filter(args(second, "n", "m"))
    assert result["NodeNames"] == ["m"] and "the node has 0 free" in result["FailedNodes"]["n"]
    # The node publishes: first's shares are in `used` and its digest in `pods`; nothing is counted twice.
    ext.cache.set_node("n", annotation((4, 4), (4, 4), pods=(pod_digest("team", "first"),)))
    assert ext.cache.node("n")[1] == {SHARE: [0, 0]}
    assert ext.cache.counts()["assumed_pods"] == 0
    # first ends (deleted): the annotation frees its shares in the next round.
    ext.cache.delete_pod("uid-first")
    ext.cache.set_node("n", annotation((4, 2), (4, 4)))
    assert ext.filter(args(second, "n"))["NodeNames"] == ["n"]


def test_in_flight_reservation_until_the_binding_shows():
    clock = [0.0]
    ext = extender(
        {"n": annotation((4, 2), (4, 4)), "m": annotation((4, 0))}, reservation_ttl=30, clock=lambda: clock[0]
    )
    first, second = pod("first", {SHARE: 2}), pod("second", {SHARE: 2})
    assert ext.filter(args(first, "n"))["NodeNames"] == ["n"]  # the scheduler now binds first, asynchronously
    assert ext.filter(args(second, "n", "m"))["NodeNames"] == ["m"]  # first's binding not seen yet: n is taken
    assert ext.filter(args(first, "n"))["NodeNames"] == ["n"]  # filtered again: its own reservation does not count
    assert ext.prioritize(args(first, "n"))[0]["Score"] > 0
    clock[0] = 31.0  # never bound: the reservation expires
    assert ext.filter(args(second, "n"))["NodeNames"] == ["n"]
    # A nominated pod (preemption) counts on its node, but not against itself.
    ext.cache.set_pod(pod_state(pod("first", {SHARE: 2}, nominated="n"), pod_request(first, managed)))
    assert ext.filter(args(second, "n"))["NodeNames"] == []
    assert ext.filter(args(first, "n"))["NodeNames"] == ["n"]
    assert ext.cache.counts() == {"nodes": 2, "nodes_with_inventory": 2, "assumed_pods": 1, "reservations": 0}


def test_cached_views_and_scores_follow_the_annotation_and_assumed_pods():
    ext = extender({"n": annotation((10, 2), (10, 8)), "m": annotation((10, 0), (10, 0))})
    one = pod("one", {SHARE: 2})

    def raw(*names: str) -> list[int]:
        return ext.scorer.raw_scores(pod_request(one, managed), ext.cache.views(list(names), exclude="uid-one"))

    assert {s["Host"]: s["Score"] for s in ext.prioritize(args(one, "n", "m"))} == {
        "n": 10,
        "m": 9,
    }  # binpack: the fuller node
    before = raw("m")[0]
    ext.cache.set_node("n", annotation((10, 10), (10, 9)))  # republished: full, 1 free
    assert {s["Host"]: s["Score"] for s in ext.prioritize(args(one, "n", "m"))} == {"n": 0, "m": 10}
    assert ext.filter(args(one, "n", "m"))["NodeNames"] == ["m"]
    # An assumed pod on m replaces m's view: 8 of 20 shares taken scores higher than none.
    ext.cache.set_pod(pod_state(pod("big", {SHARE: 8}, node="m"), pod_request(pod("big", {SHARE: 8}), managed)))
    assert ext.cache.node("m")[1] == {SHARE: [0, 10]}  # and the filter reserved `one` there
    assert ext.cache.node("m", exclude="uid-one")[1] == {SHARE: [2, 10]}
    assert raw("m")[0] > before


def test_reservations_are_bounded():
    ext = extender({"n": annotation((100, 0))}, max_reservations=3, max_reservation_nodes=2)
    for i in range(10):
        ext.filter(args(pod(f"p{i}", {SHARE: 1}), "n", "x", "y"))
    assert ext.cache.counts()["reservations"] == 3
    assert ext.cache.node("n")[1] == {SHARE: [97]}


def test_views_count_every_pods_cpu_memory_and_slot_and_the_reservations():
    cache = ClusterCache()
    cache.set_node("n", annotation((10, 0)), HostCapacity(8000, 32768, 4))
    for name, cpu in (("web", "1500m"), ("batch", "2")):  # no shares: still on the node's CPU, memory and slots
        body = host_pod(name, cpu, node="n")
        cache.set_pod(pod_state(body, pod_request(body, managed)))
    assert cache.views(["n"])[0].host_free == (4500, 30720, 2)
    ext = Extender(cache, Scorer("binpack"), managed, ExtenderMetrics(CollectorRegistry(), cache.counts))
    inflight = host_pod("inflight", "4", "8Gi", shares=2)
    assert ext.filter(args(inflight, "n"))["NodeNames"] == ["n"]  # reserved until its binding shows
    assert cache.views(["n"])[0].host_free == (500, 22528, 1)
    assert cache.views(["n"], exclude="uid-inflight")[0].host_free == (4500, 30720, 2)
    cache.delete_pod("uid-web")
    assert cache.views(["n"])[0].host_free == (2000, 23552, 2)

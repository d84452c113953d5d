"""`gpu-share extender`: kube-scheduler's filter/prioritize over real HTTP, fit and its reasons, assumed pods, watches."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from deviceplugin.cluster import PodDemand
from deviceplugin.extender.cache import ClusterCache, pod_state
from deviceplugin.extender.http import ExtenderHTTPServer
from deviceplugin.extender.inputs import HostCapacity, InputError, host_capacity, host_request, pod_request
from deviceplugin.extender.metrics import ExtenderMetrics
from deviceplugin.extender.score import Scorer
from deviceplugin.extender.service import ExtenderOptions, ExtenderService
from deviceplugin.extender.verbs import Extender
from deviceplugin.extender.watch import WatchSettings
from deviceplugin.kube.annotation import pod_digest

from .conftest import GPU_CLI, get
from .support.fake_kube import FakeCluster

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "kube-scheduler-extender"
SHARE = "example.com/gpu-share"
KEY = "example.com/gpu-share.inventory"


def managed(name: str) -> bool:
    return name.startswith("example.com/")


def annotation(*units: tuple, resource: str = SHARE, pods: tuple[str, ...] = (), span: bool = False, policy: str = "binpack", generation: int = 1) -> str:
    """units: (total, used) or (total, used, health) or (total, used, health, profile)."""
    entries = []
    for i, unit in enumerate(units):
        total, used, *rest = unit
        health, profile = (rest + ["Healthy", ""][len(rest):])[:2]
        entry = {"uuid": f"{'MIG' if profile else 'GPU'}-{i}", "gpu": i, "total": total, "used": used, "free": total - used if health == "Healthy" else 0, "health": health}
        if profile:
            entry["profile"] = profile
        entries.append(entry)
    return json.dumps({"version": 2, "generation": generation, "gpus": [], "pods": list(pods),
                       "resources": {resource: {"pool": "shared", "allowSpanGPUs": span, "allocationPolicy": policy, "units": entries}}})


def pod(name: str, *containers: dict, uid: str | None = None, node: str = "", nominated: str = "", init: tuple[dict, ...] = ()) -> dict:
    def spec(i: int, requests: dict) -> dict:
        return {"name": f"c{i}", "resources": {"limits": {k: str(v) for k, v in requests.items()}}}

    body = {"metadata": {"name": name, "namespace": "team", "uid": uid or f"uid-{name}"},
            "spec": {"containers": [spec(i, c) for i, c in enumerate(containers)], "initContainers": [spec(9, c) for c in init]},
            "status": {"phase": "Pending"}}
    if node:
        body["spec"]["nodeName"] = node
    if nominated:
        body["status"]["nominatedNodeName"] = nominated
    return body


def args(p: dict, *names: str) -> dict:
    return {"Pod": p, "Nodes": None, "NodeNames": list(names)}


def extender(nodes: dict[str, str], **cache_kw) -> Extender:
    cache = ClusterCache(**cache_kw)
    for name, text in nodes.items():
        cache.set_node(name, text)
    return Extender(cache, Scorer("binpack"), managed, ExtenderMetrics(CollectorRegistry(), cache.counts))


def post(url: str, body: bytes | dict, content_length: int | None = None) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def serve():
    servers = []

    def start(ext: Extender, ready=lambda: (True, "ready"), **kw) -> str:
        server = ExtenderHTTPServer(ext, ext.metrics, ready, port=0, host="127.0.0.1", **kw)
        server.start()
        servers.append(server)
        return f"http://127.0.0.1:{server.port}"

    yield start
    for server in servers:
        server.stop()


# --- the HTTP API with kube-scheduler's own request bodies ------------------------------------------


def test_filter_and_prioritize_answer_the_captured_scheduler_requests(serve):
    ext = extender({
        "smoke-node-a": annotation((4, 3), (4, 3)),  # 1 + 1 free: the 2-share pod does not fit one GPU
        "smoke-node-b": annotation((4, 0), (4, 0)),  # empty
        "smoke-node-c": annotation((4, 2), (4, 4)),  # one GPU with exactly 2 free: binpack's favourite
    })
    url = serve(ext)
    status, result = post(url + "/filter", (FIXTURES / "extender-filter-request.json").read_bytes())
    assert status == 200
    assert set(result) == {"NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert result["NodeNames"] == ["smoke-node-b", "smoke-node-c"] and result["Error"] == ""
    assert result["FailedNodes"] == {
        "smoke-node-a": "gpu-share: container c asks for 2 shares of example.com/gpu-share on one GPU; the most free on one GPU is 1 (free 1+1 on 2 GPUs)"
    }
    assert result["FailedAndUnresolvableNodes"] == {}
    status, scores = post(url + "/prioritize", (FIXTURES / "extender-prioritize-request.json").read_bytes())
    assert status == 200 and [s["Host"] for s in scores] == ["smoke-node-b", "smoke-node-c"]
    assert all(set(s) == {"Host", "Score"} and 0 <= s["Score"] <= 10 for s in scores)
    by_host = {s["Host"]: s["Score"] for s in scores}
    assert by_host["smoke-node-c"] > by_host["smoke-node-b"]  # binpack: the fuller node
    status, text = get(url + "/metrics")
    assert 'gpushare_extender_requests_total{outcome="ok",verb="filter"} 1.0' in text
    assert 'gpushare_extender_filtered_out_nodes_total{reason="split-shares"} 1.0' in text
    assert 'gpushare_extender_request_duration_seconds_count{verb="prioritize"} 1.0' in text


def test_bad_requests_get_clear_answers_and_bounds_hold(serve):
    ext = extender({"n": annotation((4, 0))})
    url = serve(ext, max_body=4096)
    status, text = post(url + "/filter", b"x" * 5000)
    assert status == 413 and "over the 4096 byte limit" in text
    status, text = post(url + "/filter", b"{not json")
    assert status == 400 and "bad filter request" in text
    status, result = post(url + "/filter", {"Pod": pod("p", {SHARE: 1}), "Nodes": {"items": []}, "NodeNames": None})
    assert status == 200 and "nodeCacheCapable: true" in result["Error"] and result["NodeNames"] is None
    status, result = post(url + "/filter", args(pod("p", {SHARE: "1.5"}), "n"))
    assert "Pod.spec.containers[0].resources.example.com/gpu-share: '1.5' is not a whole number" in result["Error"]
    status, text = post(url + "/prioritize", {"Pod": pod("p", {SHARE: 1})})
    assert status == 400 and "NodeNames: missing" in text
    assert get(url + "/nope")[0] == 404 and get(url + "/healthz") == (200, "ok\n")
    # A pod asking for none of the managed resources passes everywhere, untouched.
    status, result = post(url + "/filter", args(pod("cpu-only", {"cpu": 1}), "n", "unknown"))
    assert result["NodeNames"] == ["n", "unknown"] and not result["FailedNodes"]


def test_a_slow_client_does_not_hold_the_server(serve):
    url = serve(extender({"n": annotation((4, 0))}), workers=1, read_timeout=0.3)
    host, port = url.removeprefix("http://").split(":")
    slow = socket.create_connection((host, int(port)))
    slow.sendall(b"POST /filter HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")  # and never the rest
    started = time.monotonic()
    status, result = post(url + "/filter", args(pod("p", {SHARE: 1}), "n"))
    assert status == 200 and result["NodeNames"] == ["n"]
    assert time.monotonic() - started < 3
    slow.close()


# --- fit and its reasons ------------------------------------------------------------------------------


def reasons(nodes: dict[str, str], p: dict) -> dict:
    result = extender(nodes).filter(args(p, *nodes))
    return {"passed": result["NodeNames"], **result["FailedNodes"], **{k: "UNRESOLVABLE " + v for k, v in result["FailedAndUnresolvableNodes"].items()}}


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
    assert got["split"] == "gpu-share: container c0 asks for 3 shares of example.com/gpu-share on one GPU; the most free on one GPU is 2 (free 2+2 on 2 GPUs)"
    assert got["unhealthy"] == "gpu-share: container c0 asks for 3 shares of example.com/gpu-share; GPU 0 would have room but is Unhealthy"
    assert "GPU 0 would have room but is quarantined (a finished tenant's memory is still on it)" in got["quarantined"]
    assert got["mig"] == "UNRESOLVABLE gpu-share: container c0 asks for 3 shares of example.com/gpu-share; each MIG instance of this node has at most 2"
    assert got["small"].startswith("UNRESOLVABLE") and "each GPU of this node has at most 2" in got["small"]
    assert got["full"] == "gpu-share: container c0 asks for 3 shares of example.com/gpu-share; the node has 1 free"
    assert got["no-resource"] == "UNRESOLVABLE gpu-share: node has no example.com/gpu-share (not in its gpu-share inventory)"
    assert "no gpu-share inventory annotation" in got["no-annotation"]
    assert "annotation must be a JSON object" in got["old-plugin"]


def test_mig_split_reason_and_every_container_on_one_unit():
    nodes = {"mig": annotation((4, 1, "Healthy", "3g.40gb"), (4, 1, "Healthy", "3g.40gb"))}
    assert "on one MIG instance; the most free on one MIG instance is 3 (free 3+3 on 2 MIG instances)" in reasons(nodes, pod("p", {SHARE: 4}))["mig"]
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
        cache.set_pod(pod_state(pod("a", {SHARE: 1}, node=name, uid=f"a-{name}"), pod_request(pod("a", {SHARE: 1}, uid=f"a-{name}"), managed)))
        assert cache.node(name)[1] == {SHARE: taken}


# --- assumed pods and reservations --------------------------------------------------------------------


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
    ext = extender({"n": annotation((4, 2), (4, 4)), "m": annotation((4, 0))}, reservation_ttl=30, clock=lambda: clock[0])
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

    assert {s["Host"]: s["Score"] for s in ext.prioritize(args(one, "n", "m"))} == {"n": 10, "m": 9}  # binpack: the fuller node
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


# --- watches against a fake API server over real HTTP ----------------------------------------------


def node_object(name: str, text: str | None) -> dict:
    return {"metadata": {"name": name, "annotations": {KEY: text} if text else {}}}


def wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def cluster(tmp_path):
    fake = FakeCluster().start()
    yield fake, fake.write_kubeconfig(tmp_path / "kubeconfig")
    fake.stop()


def service_for(kubeconfig: Path) -> ExtenderService:
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(kubeconfig))
    options = ExtenderOptions(port=0, host="127.0.0.1", watch=WatchSettings(watch_timeout=2, request_timeout=5, backoff_initial=0.05, backoff_max=0.2))
    return ExtenderService(client.CoreV1Api(api_client), options)


def test_watches_follow_nodes_and_pods_and_reconnect_after_a_drop(cluster):
    fake, kubeconfig = cluster
    for i in range(3):  # three nodes: the initial list takes two pages
        fake.put("nodes", node_object(f"n{i}", annotation((4, 0))))
    fake.put("nodes", node_object("plain", None))
    service = service_for(kubeconfig)
    url = f"http://127.0.0.1:{service.server.port}"
    assert service.watch.ready() == (False, "not ready: waiting for the first list of nodes, pods")
    service.start()
    try:
        assert wait(lambda: service.watch.ready()[0])
        assert get(url + "/readyz") == (200, "ready\n")
        assert service.cache.counts()["nodes"] == 4 and service.cache.counts()["nodes_with_inventory"] == 3
        # A bound share pod that the annotation does not count yet, over the pod watch.
        fake.put("pods", pod("bound", {SHARE: 3}, node="n0"))
        assert wait(lambda: service.cache.node("n0")[1] == {SHARE: [1]})
        fake.drop_watches()  # the API server cuts every watch
        fake.put("nodes", node_object("n1", annotation((4, 4))))
        fake.put("pods", pod("other", {SHARE: 1}, node="n2"))
        assert wait(lambda: service.cache.node("n1")[1] == {SHARE: [0]} and service.cache.node("n2")[1] == {SHARE: [3]})
        assert 'gpushare_extender_watch_restarts_total{kind="nodes"} 0.0' not in get(url + "/metrics")[1]
        # History compacted: the next watch gets 410 Gone and the extender lists again.
        lists = fake.lists
        fake.compact()
        fake.drop_watches()
        fake.delete("nodes", "n2")
        fake.delete("pods", "uid-bound")
        assert wait(lambda: service.cache.node("n2")[0] is None and service.cache.node("n0")[1] == {SHARE: [4]})
        assert fake.lists > lists
        status, result = post(url + "/filter", args(pod("p", {SHARE: 4}), "n0", "n1"))
        assert result["NodeNames"] == ["n0"] and "the node has 0 free" in result["FailedNodes"]["n1"]
    finally:
        service.stop()


def test_cli_refuses_an_unknown_policy(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "clusters": [{"name": "x", "cluster": {"server": "http://127.0.0.1:1"}}],
                                      "users": [{"name": "x", "user": {}}], "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}], "current-context": "x"}))
    result = subprocess.run([*GPU_CLI, "extender", "--kubeconfig", str(kubeconfig), "--policy", "nope", "--port", "0"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "--policy: 'nope' is not one of" in result.stderr


def test_the_extenders_assumption_is_the_node_plugins_choice():
    """On random node states, GetPreferredAllocation takes the unit the extender assumed (every allocationPolicy)."""
    from benchmarks.extender import agreement

    result = agreement(300, seed=3)
    assert all(r["pods"] > 250 and r["agree_percent"] == 100.0 for r in result.values()), result


def test_the_simulator_through_the_extender_packs_as_the_policy_alone():
    """The toy traces replayed through filter + prioritize and GetPreferredAllocation (benchmarks/extender_replay.py)."""
    from benchmarks.extender_replay import replay
    from deviceplugin.cluster.simulator import Experiment
    from deviceplugin.cluster.traces import load_nodes, load_pods

    traces = Path(__file__).parent / "traces"
    experiment = Experiment(load_nodes(traces / "toy_nodes.csv"), load_pods(traces / "openb_pod_list_toy.csv"), replicas=10)
    for policy in ("binpack", "fgdstrand", "spread"):
        for seed in (1, 2, 3):
            result = replay(experiment, policy, seed)
            assert result.share_pods > 0 and result.share_agree == result.share_pods and result.whole_agree == result.whole_pods, result
            assert result.allocation == result.alone, result  # ranked scores: the policy's choice is the extender's top node


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


# --- the whole node: CPU, memory and pod slots -------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [
    ({"containers": [{"resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}, {"resources": {"limits": {"cpu": "500m", "memory": "1e9"}}}]},
     (1500, 1024 + 954)),
    # ordinary init containers run alone (with the sidecars started before them); sidecars run with the containers
    ({"containers": [{"resources": {"requests": {"cpu": "1"}}}],
      "initContainers": [{"resources": {"requests": {"cpu": "4"}}}, {"restartPolicy": "Always", "resources": {"requests": {"cpu": "1", "memory": "1Mi"}}},
                         {"resources": {"requests": {"cpu": "3500m", "memory": "3Gi"}}}]},
     (4500, 3073)),
    ({"containers": [{"resources": {"requests": {"cpu": "2"}}}], "overhead": {"cpu": "250m", "memory": "64Mi"}}, (2250, 64)),
    ({"containers": [{"resources": {"requests": {"cpu": "2"}}}], "resources": {"requests": {"cpu": "3", "memory": "0.5Gi"}}}, (3000, 512)),
    ({"containers": [{}]}, (0, 0)),
])
def test_host_request_counts_as_kube_scheduler_does(spec, expected):
    assert host_request(spec) == expected


def test_bad_quantities_and_missing_allocatable():
    with pytest.raises(InputError, match=r"Pod.spec.containers\[0\].resources.cpu: '1x' is not a quantity"):
        host_request({"containers": [{"resources": {"requests": {"cpu": "1x"}}}]})
    assert host_capacity({"status": {"allocatable": {"cpu": "95500m", "memory": "1Gi", "pods": "110"}}}) == HostCapacity(95500, 1024, 110)
    assert host_capacity({"status": {"allocatable": {"cpu": "9" * 80}}}) == HostCapacity()  # unreadable: unlimited


def host_pod(name: str, cpu: str, memory: str = "1Gi", node: str = "", shares: int = 0) -> dict:
    body = pod(name, {SHARE: shares} if shares else {}, node=node)
    body["spec"]["containers"][0]["resources"]["requests"] = {"cpu": cpu, "memory": memory}
    return body


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
        ext = Extender(cache, Scorer(policy, workload=cache.workload), managed, ExtenderMetrics(CollectorRegistry(), cache.counts))
        scores[policy] = {s["Host"]: s["Score"] for s in ext.prioritize(args(heavy, "tight", "roomy"))}
    assert scores["fgdstrand"] == {"roomy": 10, "tight": 9}
    assert scores["fgd"] == {"roomy": 10, "tight": 10}


# --- DRA claims ----------------------------------------------------------------------------------------


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
    held["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRA_DRIVER, "pool": "a", "device": "gpu-0", "shareID": "0b0c0d0e-0000-4000-8000-000000000001",
         "consumedCapacity": {"shares": "6", "memory": "48Gi"}}]}}, "reservedFor": [{"resource": "pods", "name": "x", "uid": "uid-x"}]}
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
    want["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRA_DRIVER, "pool": "a", "device": "gpu-0", "shareID": "0b0c0d0e-0000-4000-8000-000000000002",
         "consumedCapacity": {"shares": "4"}}]}}, "reservedFor": [{"resource": "pods", "name": "p", "uid": "uid-p"}]}
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
    result = ext.filter(args(claim_pod_body("q", "big", 0, 0, "s", {}) | {"metadata": {"namespace": "team", "name": "q", "uid": "uid-q"}}, "b"), every_pod=True)
    assert "each GPU of this node has at most 10" in result["FailedAndUnresolvableNodes"]["b"]
    assert ext.prioritize(args(pod("share", {SHARE: 1}), "a", "b"), every_pod=True) == [{"Host": "a", "Score": 0}, {"Host": "b", "Score": 0}]


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
    ext = Extender(cache, Scorer("fgdstrand", workload=cache.workload), managed, ExtenderMetrics(CollectorRegistry(), cache.counts))
    plain = host_pod("plain", "16", "8Gi")
    assert ext.filter(args(plain, "gpus", "full", "cpu"), every_pod=True)["NodeNames"] == ["gpus", "full", "cpu"]
    assert cache.counts()["reservations"] == 0  # nothing of ours to reserve
    assert {s["Host"]: s["Score"] for s in ext.prioritize(args(plain, "gpus", "full", "cpu"), every_pod=True)} == {"gpus": 9, "full": 10, "cpu": 10}
    assert {s["Host"]: s["Score"] for s in ext.prioritize(args(plain, "gpus", "full"))} == {"gpus": 0, "full": 0}  # the share entry: not its pod


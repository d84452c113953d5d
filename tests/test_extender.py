"""`gpu-share extender`: kube-scheduler's filter/prioritize over real HTTP, the watches against a fake API server, the
command, and the extender against the node plugin and the simulator (the pure parts: tests/unit/extender/)."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deviceplugin.extender.http import ExtenderHTTPServer
from deviceplugin.extender.service import ExtenderOptions, ExtenderService
from deviceplugin.extender.verbs import Extender
from deviceplugin.extender.watch import WatchSettings
from tests.support.extender import SHARE, annotation, args, extender, pod

from .conftest import GPU_CLI, get, wait_until
from .support.fake_kube import FakeCluster

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "kube-scheduler-extender"
KEY = "example.com/gpu-share.inventory"


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
    ext = extender(
        {
            "smoke-node-a": annotation((4, 3), (4, 3)),  # 1 + 1 free: the 2-share pod does not fit one GPU
            "smoke-node-b": annotation((4, 0), (4, 0)),  # empty
            "smoke-node-c": annotation((4, 2), (4, 4)),  # one GPU with exactly 2 free: binpack's favourite
        }
    )
    url = serve(ext)
    status, result = post(url + "/filter", (FIXTURES / "extender-filter-request.json").read_bytes())
    assert status == 200
    assert set(result) == {"NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert result["NodeNames"] == ["smoke-node-b", "smoke-node-c"] and result["Error"] == ""
    assert result["FailedNodes"] == {
        "smoke-node-a": "gpu-share: container c asks for 2 shares of example.com/gpu-share on one GPU; the most "
        "free on one GPU is 1 (free 1+1 on 2 GPUs)"
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


class Dripper:
    """A client that sends `head`, then one byte every 20 ms (at most `limit`), until the server cuts it off."""

    def __init__(self, url: str, head: bytes, limit: int = 2000) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.sendall(head)
        self.sent = 0
        self.cut = threading.Event()
        self.thread = threading.Thread(target=self._drip, args=(limit,), daemon=True)
        self.thread.start()

    def _drip(self, limit: int) -> None:
        try:
            for _ in range(limit):
                readable, _, _ = select.select([self.sock], [], [], 0.02)
                if readable and self.sock.recv(4096) == b"":
                    break  # the server closed the connection
                self.sock.sendall(b"a")
                self.sent += 1
            else:
                return
        except OSError:
            pass
        self.cut.set()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=10)


def raw(url: str, request: bytes) -> bytes:
    """Send `request` on a fresh connection; everything the server answers until it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


@pytest.mark.parametrize(
    "head",
    [
        b"POST /filter HTTP/1.1\r\nHost: x\r\nX-Slow: ",  # a head that never ends
        b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{",  # a body that never ends
    ],
    ids=["head", "body"],
)
def test_dripping_clients_holding_every_worker_are_cut_off_and_filter_answers_meanwhile(serve, head):
    """A byte every 20 ms never trips a per-read timeout: the deadline is for the whole head, and for the whole body."""
    url = serve(extender({"n": annotation((4, 0))}), workers=2, read_timeout=0.5)
    drippers = [Dripper(url, head) for _ in range(2)]
    try:
        assert wait_until(lambda: all(d.sent for d in drippers))  # both workers hold a dripping connection
        status, result = post(url + "/filter", args(pod("p", {SHARE: 1}), "n"))
        assert status == 200 and result["NodeNames"] == ["n"]
        assert wait_until(lambda: all(d.cut.is_set() for d in drippers), timeout=10)
        assert all(d.sent < 2000 for d in drippers)
    finally:
        for dripper in drippers:
            dripper.close()


def test_an_oversized_or_unsized_body_is_refused_without_being_read(serve):
    url = serve(extender({"n": annotation((4, 0))}))
    answer = raw(
        url, b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n"
    )  # 100 MiB announced, none sent
    assert (
        answer.startswith(b"HTTP/1.1 413 ")
        and b"request body of 104857600 bytes is over the 4194304 byte limit" in answer
    )
    answer = raw(url, b"POST /filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 411 ") and b"Content-Length is required" in answer
    status, text = get(url + "/metrics")
    assert 'gpushare_extender_requests_total{outcome="error",verb="filter"} 2.0' in text


# --- watches against a fake API server over real HTTP ----------------------------------------------


def node_object(name: str, text: str | None) -> dict:
    return {"metadata": {"name": name, "annotations": {KEY: text} if text else {}}}


@pytest.fixture
def cluster(tmp_path):
    fake = FakeCluster().start()
    yield fake, fake.write_kubeconfig(tmp_path / "kubeconfig")
    fake.stop()


def service_for(kubeconfig: Path) -> ExtenderService:
    from deviceplugin.kube.rest import RestClient, load_kubeconfig

    options = ExtenderOptions(
        port=0,
        host="127.0.0.1",
        watch=WatchSettings(watch_timeout=2, request_timeout=5, backoff_initial=0.05, backoff_max=0.2),
    )
    return ExtenderService(RestClient(load_kubeconfig(kubeconfig)), options)


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
        assert wait_until(lambda: service.watch.ready()[0], timeout=10)
        assert get(url + "/readyz") == (200, "ready\n")
        assert service.cache.counts()["nodes"] == 4 and service.cache.counts()["nodes_with_inventory"] == 3
        # A bound share pod that the annotation does not count yet, over the pod watch.
        fake.put("pods", pod("bound", {SHARE: 3}, node="n0"))
        assert wait_until(lambda: service.cache.node("n0")[1] == {SHARE: [1]}, timeout=10)
        fake.drop_watches()  # the API server cuts every watch
        fake.put("nodes", node_object("n1", annotation((4, 4))))
        fake.put("pods", pod("other", {SHARE: 1}, node="n2"))
        assert wait_until(
            lambda: service.cache.node("n1")[1] == {SHARE: [0]} and service.cache.node("n2")[1] == {SHARE: [3]},
            timeout=10,
        )
        assert 'gpushare_extender_watch_restarts_total{kind="nodes"} 0.0' not in get(url + "/metrics")[1]
        # History compacted: the next watch gets 410 Gone and the extender lists again.
        lists = fake.lists
        fake.compact()
        fake.drop_watches()
        fake.delete("nodes", "n2")
        fake.delete("pods", "uid-bound")
        assert wait_until(
            lambda: service.cache.node("n2")[0] is None and service.cache.node("n0")[1] == {SHARE: [4]}, timeout=10
        )
        assert fake.lists > lists
        status, result = post(url + "/filter", args(pod("p", {SHARE: 4}), "n0", "n1"))
        assert result["NodeNames"] == ["n0"] and "the node has 0 free" in result["FailedNodes"]["n1"]
    finally:
        service.stop()


def test_cli_refuses_an_unknown_policy(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "x", "cluster": {"server": "http://127.0.0.1:1"}}],
                "users": [{"name": "x", "user": {}}],
                "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}],
                "current-context": "x",
            }
        )
    )
    result = subprocess.run(
        [*GPU_CLI, "extender", "--kubeconfig", str(kubeconfig), "--policy", "nope", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "--policy: 'nope' is not one of" in result.stderr


def test_the_extenders_assumption_is_the_node_plugins_choice():
    """On random node states, GetPreferredAllocation takes the unit the extender assumed (every allocationPolicy)."""
    from benchmarks.extender import agreement

    result = agreement(300, seed=3)
    assert all(r["pods"] > 250 and r["agree_percent"] == 100.0 for r in result.values()), result


def test_the_simulator_through_the_extender_packs_as_the_policy_alone():
    """The toy traces replayed through filter + prioritize and GetPreferredAllocation
    (benchmarks/extender_replay.py)."""
    from benchmarks.extender_replay import replay
    from deviceplugin.cluster.simulator import Experiment
    from deviceplugin.cluster.traces import load_nodes, load_pods

    traces = Path(__file__).parent / "traces"
    experiment = Experiment(
        load_nodes(traces / "toy_nodes.csv"), load_pods(traces / "openb_pod_list_toy.csv"), replicas=10
    )
    for policy in ("binpack", "fgdstrand", "spread"):
        for seed in (1, 2, 3):
            result = replay(experiment, policy, seed)
            assert (
                result.share_pods > 0
                and result.share_agree == result.share_pods
                and result.whole_agree == result.whole_pods
            ), result
            assert result.allocation == result.alone, (
                result
            )  # ranked scores: the policy's choice is the extender's top node

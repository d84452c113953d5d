"""The node's Node object and pods through the (fake) Kubernetes API: label publishing, owned keys, the pod list."""

from __future__ import annotations

import json

from deviceplugin.config.parse import parse_config
from deviceplugin.config.types import default_config
from deviceplugin.kube.client import NodeClient
from deviceplugin.kube.labels import NodePublisher, label_value, node_labels
from tests.conftest import node
from tests.support.resources import resources_of

T4 = node("2xT4")


def test_publisher_debounces_and_removes_only_labels_it_wrote(fake_kube):
    api, kubeconfig = fake_kube
    api.labels = {"example.com/old-pool.replicas": "8", "example.com/gpu.count": "1", "team": "ml"}
    api.annotations = {"example.com/gpu-share.labels": '["example.com/old-pool.replicas","example.com/gpu.count"]'}
    publisher = NodePublisher(NodeClient.connect(api.node_name, str(kubeconfig)), "example.com", min_interval=60)
    assert publisher.publish({"example.com/gpu.count": "2"}, [])
    assert api.labels == {"example.com/gpu.count": "2", "team": "ml"}  # ours replaced, others untouched
    assert api.annotations["example.com/gpu-share.labels"] == '["example.com/gpu.count"]'
    assert not publisher.publish({"example.com/gpu.count": "3"}, [])  # within the debounce interval
    assert label_value("NVIDIA A100-SXM4-80GB") == "NVIDIA-A100-SXM4-80GB"


def test_with_domain_nvidia_com_gfd_labels_are_left_alone(fake_kube):
    api, kubeconfig = fake_kube
    gfd = {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "Tesla-T4",
        "nvidia.com/gpu.machine": "g4dn",
        "nvidia.com/mig.capable": "false",
    }
    api.labels = dict(gfd)
    client = NodeClient.connect(api.node_name, str(kubeconfig))
    labels = node_labels("nvidia.com", node("2xT4"), resources_of(default_config(), node("2xT4")))
    first = NodePublisher(client, "nvidia.com", min_interval=0)
    assert first.publish(labels, [])
    assert {k: api.labels[k] for k in gfd} == gfd  # GFD's keys: neither overwritten nor deleted
    ours = json.loads(api.annotations["nvidia.com/gpu-share.labels"])
    assert not set(ours) & set(gfd) and "nvidia.com/gpu.count" in ours and api.labels["nvidia.com/gpu.count"] == "2"
    # A restart knows its own keys from the annotation; a smaller label set removes only ours.
    again = NodePublisher(client, "nvidia.com", min_interval=0)
    assert again.publish({"nvidia.com/gpu.count": "2"}, [])
    assert api.labels == {**gfd, "nvidia.com/gpu.count": "2"}
    assert json.loads(api.annotations["nvidia.com/gpu-share.labels"]) == ["nvidia.com/gpu.count"]


def _api_pod(name: str, uid: str, node_name: str, phase: str = "Running", statuses: list | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": uid},
        "spec": {"nodeName": node_name, "containers": [{"name": "app", "image": "x"}]},
        "status": {"phase": phase, "containerStatuses": statuses or []},
    }


def _status(cid: str, *, terminated: bool = False, previous: str | None = None) -> dict:
    state = {"terminated": {"exitCode": 0, "containerID": f"containerd://{cid}"}} if terminated else {"running": {}}
    last = {"terminated": {"exitCode": 1, "containerID": f"containerd://{previous}"}} if previous else {}
    return {
        "name": "app",
        "containerID": f"containerd://{cid}",
        "ready": True,
        "restartCount": 0,
        "image": "x",
        "imageID": "x",
        "state": state,
        "lastState": last,
    }


def test_pod_listing_reads_the_api_cache_for_this_node_only(fake_kube):
    """One LIST per poll, `spec.nodeName` selected and `resourceVersion=0` (the watch cache, not a quorum read)."""
    api, kubeconfig = fake_kube
    a, b, old = "a" * 64, "b" * 64, "c" * 64
    api.pods = [
        _api_pod("runs", "11111111-1111-1111-1111-111111111111", api.node_name, statuses=[_status(a, previous=old)]),
        _api_pod(
            "done",
            "22222222-2222-2222-2222-222222222222",
            api.node_name,
            phase="Succeeded",
            statuses=[_status(b, terminated=True)],
        ),
        _api_pod("elsewhere", "33333333-3333-3333-3333-333333333333", "other-node"),
    ]
    client = NodeClient.connect(api.node_name, str(kubeconfig))
    pods = {p.name: p for p in client.pods()}
    assert api.pod_queries == [{"fieldSelector": [f"spec.nodeName={api.node_name}"], "resourceVersion": ["0"]}]
    assert set(pods) == {"runs", "done"}
    assert pods["runs"].containers == {a: "app"} and pods["runs"].ended == {old} and not pods["runs"].finished
    assert pods["done"].finished and pods["done"].ended == {b}


def test_a_domain_change_before_the_first_publish_removes_what_an_earlier_run_owned(fake_kube):
    """The old domain's keys are read from its annotation first, then retired in the same patch as the new labels."""
    api, kubeconfig = fake_kube
    api.labels = {"example.com/gpu.count": "2", "example.com/foreign": "x"}
    api.annotations = {
        "example.com/gpu-share.labels": '["example.com/gpu.count"]',
        "example.com/gpu-share.inventory": "{}",
    }
    publisher = NodePublisher(NodeClient.connect(api.node_name, str(kubeconfig)), "example.com", min_interval=0)
    publisher.on_config(
        parse_config({"version": "v1", "domain": "acme.io", "pools": [{"name": "w", "mode": "exclusive"}]}), []
    )
    assert publisher.publish_node(T4, [], {"version": 2})
    assert len(api.patches) == 1
    assert api.labels["example.com/foreign"] == "x" and "example.com/gpu.count" not in api.labels  # only ours removed
    assert api.labels["acme.io/gpu.count"] == "2" and set(api.annotations) == {
        "acme.io/gpu-share.labels",
        "acme.io/gpu-share.inventory",
    }

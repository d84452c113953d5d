"""The built-in kubelet's pod-resources server: active pods only, Get, allocatable, its rate limit."""

from __future__ import annotations

import json

import grpc
import pytest

from deviceplugin.agent.usage import PodResourcesClient
from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.api import podresources_pb2_grpc as pr_grpc
from deviceplugin.sim.kubelet import Container, KubeletSimulator, Pod, TokenBucket
from tests.conftest import registered

SHARE = "example.com/gpu-share"


def test_pod_resources_serves_active_pods_only_and_rate_limits(plugin_dir, start_plugin):
    kubelet = KubeletSimulator(plugin_dir, rate_limit=TokenBucket(rate=1000, burst=10))
    kubelet.start()
    try:
        start_plugin({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 4}]})
        assert kubelet.wait_for(registered(SHARE), timeout=5)
        a = Pod("a", [Container("main", {SHARE: 2}), Container("sidecar", {})], namespace="team")
        b = Pod("b", [Container("main", {SHARE: 1})])
        kubelet.admit(a)
        kubelet.admit(b)
        client = PodResourcesClient(kubelet.pod_resources_socket)
        listed = {(p.namespace, p.name): p for p in client.list().pod_resources}
        assert set(listed) == {("team", "a"), ("default", "b")}
        entries = listed[("team", "a")].containers[0].devices  # as kubelet v1.36: one entry per ID and NUMA node
        assert sorted(i for e in entries for i in e.device_ids) == sorted(kubelet.allocated(a)["main"][SHARE])
        assert all(
            e.resource_name == SHARE and len(e.device_ids) == 1 and [n.ID for n in e.topology.nodes] == [0]
            for e in entries
        )
        assert all(
            not c.cpu_ids and not c.memory for c in listed[("team", "a")].containers
        )  # no CPU or memory manager policy
        assert [c.name for c in listed[("team", "a")].containers] == ["main", "sidecar"]
        kubelet.finish_pod(b.uid)
        assert [p.name for p in client.list().pod_resources] == ["a"]
        assert len(client.allocatable().devices) == 8
        stub = pr_grpc.PodResourcesListerStub(grpc.insecure_channel(f"unix:{kubelet.pod_resources_socket}"))
        with pytest.raises(grpc.RpcError) as err:
            stub.Get(pr.GetPodResourcesRequest(pod_name="b", pod_namespace="default"))
        assert (
            err.value.code() == grpc.StatusCode.UNKNOWN
            and err.value.details() == "pod b in namespace default not found"
        )
        kubelet.rate_limit = TokenBucket(rate=0.001, burst=2)
        client.list()
        client.list()
        with pytest.raises(grpc.RpcError) as err:
            client.list()
        assert (
            err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.details() == "rejected by rate limit"
        )
        client.close()
    finally:
        kubelet.stop()


def test_init_containers_sidecars_and_the_checkpoint_as_kubelet_v136_writes_them(plugin_dir, start_plugin):
    """Ordinary init containers hold devices (admitted first, checkpointed) but pod-resources does not list them;
    sidecars (restartable init containers) come first, then app containers. The checkpoint is Go's JSON: fields in
    order, no spaces, the IDs per NUMA node, `null` without entries."""
    kubelet = KubeletSimulator(plugin_dir, seed=1)
    kubelet.start()
    try:
        start_plugin({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 4}]})
        assert kubelet.wait_for(registered(SHARE), timeout=5)
        pod = Pod(
            "p",
            [Container("main", {SHARE: 2})],
            init_containers=[Container("setup", {SHARE: 1}), Container("proxy", {SHARE: 1}, restartable=True)],
        )
        kubelet.admit(pod)
        assert set(kubelet.allocated(pod)) == {"setup", "proxy", "main"}
        client = PodResourcesClient(kubelet.pod_resources_socket)
        (listed,) = client.list().pod_resources
        client.close()
        assert [c.name for c in listed.containers] == ["proxy", "main"]
        assert sorted(i for e in listed.containers[1].devices for i in e.device_ids) == sorted(
            kubelet.allocated(pod)["main"][SHARE]
        )
        text = (plugin_dir / "kubelet_internal_checkpoint").read_text()
        assert (
            text.startswith('{"Data":{"PodDeviceEntries":[{"PodUID":')
            and text.endswith(',"Checksum":0}')
            and ", " not in text
        )
        data = json.loads(text)["Data"]
        entries = {e["ContainerName"]: e for e in data["PodDeviceEntries"]}
        assert list(entries["main"]) == ["PodUID", "ContainerName", "ResourceName", "DeviceIDs", "AllocResp"]
        assert entries["main"]["DeviceIDs"] == {
            "0": kubelet.allocated(pod)["main"][SHARE]
        }  # the T4s are on NUMA node 0
        assert set(entries) == {"setup", "proxy", "main"} and len(data["RegisteredDevices"][SHARE]) == 8
        kubelet.delete_pod(pod.uid)
        assert json.loads((plugin_dir / "kubelet_internal_checkpoint").read_text())["Data"]["PodDeviceEntries"] is None
    finally:
        kubelet.stop()

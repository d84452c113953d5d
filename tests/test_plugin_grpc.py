"""The plugin against the built-in kubelet: real gRPC over real Unix sockets."""

from __future__ import annotations

import time

import grpc
import pytest

from deviceplugin.api import deviceplugin_pb2 as pb
from deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from deviceplugin.plugin.wire import OPTIONS
from deviceplugin.sim.kubelet import AdmissionError, Container, Pod

from .conftest import node, registered, wait_until

SHARE = "example.com/gpu-share"
GPU = "example.com/gpu"
T4 = node("2xT4")
UUID0, UUID1 = T4.gpus[0].uuid, T4.gpus[1].uuid
MIXED = {
    "version": "v1",
    "pools": [
        {"name": "training", "mode": "exclusive", "gpus": {"indexes": [0]}},
        {"name": "inference", "mode": "shared", "replicas": 4},
    ],
}


def allocate(kubelet, resource: str, *id_lists: list[str]) -> pb.AllocateResponse:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in id_lists])
    return kubelet.stub(resource).Allocate(request, timeout=5)


def test_registers_and_advertises_every_share(kubelet, start_plugin):
    start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    status = kubelet.resources()[SHARE]
    assert status.capacity == 20 and status.allocatable == 20
    assert sorted(status.healthy) == sorted(f"{u}::{k}" for u in (UUID0, UUID1) for k in range(10))
    # Every T4 reports NUMA node 0, so every device carries it.
    assert set(map(tuple, status.topology.values())) == {(0,)}
    request = kubelet.register_requests[-1]
    assert request.version == "v1beta1" and request.resource_name == SHARE
    assert "/" not in request.endpoint and request.endpoint.endswith(".sock")
    # The same options in RegisterRequest and GetDevicePluginOptions.
    assert request.options == kubelet.endpoint_options(SHARE) == OPTIONS
    assert OPTIONS.get_preferred_allocation_available and not OPTIONS.pre_start_required


def test_one_server_and_socket_per_resource(kubelet, start_plugin, plugin_dir):
    manager = start_plugin(MIXED)
    assert kubelet.wait_for(registered(SHARE, GPU), timeout=5)
    status = kubelet.resources()
    assert status[GPU].healthy == [UUID0]
    assert sorted(status[SHARE].healthy) == [f"{UUID1}::{k}" for k in range(4)]
    sockets = sorted(p.name for p in plugin_dir.glob("gpu-share-*.sock"))
    assert len(sockets) == 2 and {s.socket_path.name for s in manager.servers} == set(sockets)


def test_list_and_watch_sends_full_list_then_only_changes(kubelet, start_plugin):
    manager = start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    assert kubelet.resources()[SHARE].messages == 1
    manager.state.set_health({})  # no change: nothing sent
    manager.state.set_health({UUID1: "test"})
    assert kubelet.wait_for(lambda st: st[SHARE].messages == 2, timeout=2)
    status = kubelet.resources()[SHARE]
    assert status.capacity == 20 and status.allocatable == 10
    assert sorted(status.unhealthy) == [f"{UUID1}::{k}" for k in range(10)]
    manager.state.set_health({UUID1: "test"})  # unchanged again
    manager.state.set_health({})
    assert kubelet.wait_for(lambda st: st[SHARE].messages == 3 and st[SHARE].allocatable == 20, timeout=2)


def test_each_resource_sends_a_new_list_only_when_its_own_part_of_the_node_state_changes(kubelet, start_plugin):
    """One NodeState, many servers: a change elsewhere on the node (another resource's GPU, the agent's usage, an MPS
    pool it is not in) wakes no stream of this resource."""
    from deviceplugin.agent.observe import Observation

    manager = start_plugin(MIXED)  # GPU 0 whole (GPU), GPU 1 in 4 shares (SHARE)
    assert kubelet.wait_for(registered(SHARE, GPU), timeout=5)
    state = manager.state
    state.set_health({UUID0: "XID 79"})
    assert kubelet.wait_for(lambda st: st[GPU].allocatable == 0 and st[GPU].messages == 2, timeout=2)
    state.set_observation(Observation(last_sync=1.0))
    state.set_mps_ready("mps-pool", False)
    state.set_quarantine(frozenset({UUID0}), frozenset({UUID0}))  # GPU 0's free device: GPU's part only
    state.set_health({UUID0: "XID 79"}, xid_counts={UUID0: 1})
    state.set_quarantine(
        frozenset({UUID0, UUID1}), frozenset({UUID0, f"{UUID1}::3"})
    )  # the first change of SHARE's part
    assert kubelet.wait_for(lambda st: st[SHARE].allocatable == 3 and st[GPU].messages == 3, timeout=2)
    assert kubelet.resources()[SHARE].messages == 2  # the full list, then this one change
    assert kubelet.resources()[GPU].messages == 3  # its health, then its quarantined device (already Unhealthy)


def test_stream_health_strings_are_exact(kubelet, start_plugin):
    manager = start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    manager.state.set_health({UUID0: "test"})
    stream = kubelet.stub(SHARE).ListAndWatch(pb.Empty(), timeout=5)
    first = next(stream)
    stream.cancel()
    health = {d.ID: d.health for d in first.devices}
    assert {health[f"{UUID0}::{k}"] for k in range(10)} == {"Unhealthy"}
    assert {health[f"{UUID1}::{k}"] for k in range(10)} == {"Healthy"}


def test_preferred_allocation_keeps_shares_on_one_gpu(kubelet, start_plugin):
    start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    stub = kubelet.stub(SHARE)
    # GPU0 has 2 free shares, GPU1 has 7: binpack puts 2 on GPU0 (fullest that fits), 3 on GPU1.
    available = [f"{UUID0}::{k}" for k in (3, 8)] + [f"{UUID1}::{k}" for k in range(3, 10)]
    for size, gpu in ((2, UUID0), (3, UUID1)):
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=size)
            ]
        )
        ids = stub.GetPreferredAllocation(request, timeout=5).container_responses[0].deviceIDs
        assert len(ids) == size and {i.split("::")[0] for i in ids} == {gpu}
    # must_include is kept and completed on its own GPU.
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=[f"{UUID1}::9"], allocation_size=3
            )
        ]
    )
    ids = list(stub.GetPreferredAllocation(request, timeout=5).container_responses[0].deviceIDs)
    assert ids[0] == f"{UUID1}::9" and len(ids) == 3 and all(i.startswith(UUID1) for i in ids)


def test_admitted_pods_get_shares_on_one_gpu_and_envs(kubelet, start_plugin):
    start_plugin(MIXED)
    assert kubelet.wait_for(registered(SHARE, GPU), timeout=5)
    pod = Pod("chat", [Container("server", {SHARE: 3}), Container("whole", {GPU: 1})])
    results = kubelet.admit(pod)
    shares = results["server"][SHARE].envs
    assert shares["NVIDIA_VISIBLE_DEVICES"] == shares["CUDA_VISIBLE_DEVICES"] == UUID1
    assert shares["GPU_SHARE_COUNT"] == "3" and shares["GPU_SHARE_TOTAL"] == "4"
    assert shares["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(15360 * 3 // 4)
    assert shares["GPU_SHARE_COMPUTE_PERCENT"] == "75"
    whole = results["whole"][GPU].envs
    assert whole["NVIDIA_VISIBLE_DEVICES"] == whole["CUDA_VISIBLE_DEVICES"] == UUID0
    assert "GPU_SHARE_COUNT" not in whole
    assert kubelet.allocated(pod)["server"][SHARE] == [f"{UUID1}::{k}" for k in range(3)]


def test_allocate_is_deterministic_for_the_same_ids(kubelet, start_plugin):
    start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    ids = [f"{UUID0}::5", f"{UUID0}::2"]
    first = allocate(kubelet, SHARE, ids)
    again = allocate(kubelet, SHARE, list(reversed(ids)), ids)  # repeated IDs, two containers
    assert first.container_responses[0] == again.container_responses[0] == again.container_responses[1]


@pytest.mark.parametrize(
    "ids, code, message",
    [
        ([], grpc.StatusCode.INVALID_ARGUMENT, "no device IDs in the request for example.com/gpu-share"),
        (
            ["GPU-nope::1", f"{UUID0}::0"],
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown device IDs for example.com/gpu-share: GPU-nope::1",
        ),
        (
            [f"{UUID0}::0", f"{UUID1}::1"],
            grpc.StatusCode.INVALID_ARGUMENT,
            f"shares of example.com/gpu-share span 2 GPUs ({UUID0} 1 share; {UUID1} 1 share)",
        ),
    ],
)
def test_bad_allocate_is_refused_and_server_keeps_serving(kubelet, start_plugin, ids, code, message):
    start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        allocate(kubelet, SHARE, ids)
    assert err.value.code() == code
    assert message in err.value.details()
    ok = allocate(kubelet, SHARE, [f"{UUID0}::1"])
    assert ok.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == UUID0


def test_empty_allocate_request_and_unhealthy_devices_are_refused(kubelet, start_plugin):
    manager = start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.stub(SHARE).Allocate(pb.AllocateRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no container requests" in err.value.details()
    manager.state.set_health({UUID0: "test"})
    with pytest.raises(grpc.RpcError) as err:
        allocate(kubelet, SHARE, [f"{UUID0}::1"])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"devices on an unhealthy GPU for {SHARE}: {UUID0}::1" in err.value.details()


def test_quarantined_devices_are_refused_as_quarantined(kubelet, start_plugin):
    manager = start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    manager.state.set_quarantine(frozenset({UUID0}), frozenset({f"{UUID0}::1"}))
    with pytest.raises(grpc.RpcError) as err:
        allocate(kubelet, SHARE, [f"{UUID0}::1"])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        f"devices quarantined for {SHARE} (their GPU holds a finished container's memory): {UUID0}::1"
        in err.value.details()
    )
    assert allocate(kubelet, SHARE, [f"{UUID0}::2"]).container_responses  # only the quarantined devices


def test_pod_that_cannot_fit_on_one_gpu_fails_admission_cleanly(kubelet, start_plugin):
    start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    with pytest.raises(AdmissionError, match="InvalidArgument desc = shares of example.com/gpu-share span 2 GPUs"):
        kubelet.admit(Pod("huge", [Container("c", {SHARE: 12})]))
    with pytest.raises(AdmissionError, match="Requested: 21, Available: 20"):
        kubelet.admit(Pod("huger", [Container("c", {SHARE: 21})]))
    # Nothing stays allocated after a refusal: ten shares still fit on one GPU.
    results = kubelet.admit(Pod("fits", [Container("c", {SHARE: 10})]))
    assert results["c"][SHARE].envs["GPU_SHARE_COUNT"] == "10"


def test_reregisters_within_two_seconds_after_kubelet_restart(kubelet, start_plugin, plugin_dir):
    manager = start_plugin(MIXED)
    assert kubelet.wait_for(registered(SHARE, GPU), timeout=5)
    pod = Pod("survivor", [Container("c", {SHARE: 2})])
    kubelet.admit(pod)
    old_sockets = {s.socket_path for s in manager.servers}
    for _ in range(3):
        started = time.monotonic()
        kubelet.restart()
        assert kubelet.resources()[SHARE].allocatable == 0
        assert kubelet.wait_for(registered(SHARE, GPU), timeout=2), kubelet.resources()
        assert time.monotonic() - started < 2.0
    new_sockets = {s.socket_path for s in manager.servers}
    assert not old_sockets & new_sockets and all(p.exists() for p in new_sockets)
    assert manager.kubelet_restarts == 3
    # The kubelet kept the pod's allocation; the rest is still allocatable.
    assert len(kubelet.allocated(pod)["c"][SHARE]) == 2
    assert kubelet.admit(Pod("after", [Container("c", {SHARE: 2})]))["c"][SHARE].envs["GPU_SHARE_COUNT"] == "2"


def test_reregisters_when_its_own_socket_is_deleted(kubelet, start_plugin):
    manager = start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    before = len(kubelet.register_requests)
    manager.servers[0].socket_path.unlink()
    assert kubelet.wait_for(lambda st: len(kubelet.register_requests) > before and registered(SHARE)(st), timeout=2)
    assert manager.servers[0].socket_path.exists()


def test_registration_retries_until_kubelet_appears(plugin_dir, start_plugin):
    from deviceplugin.sim.kubelet import KubeletSimulator

    manager = start_plugin()
    assert wait_until(lambda: manager.servers[0].register_failures >= 3, timeout=5)  # kubelet.sock does not exist yet
    assert not manager.servers[0].registered.is_set()
    late = KubeletSimulator(plugin_dir)
    late.start()
    try:
        assert late.wait_for(registered(SHARE), timeout=2)
    finally:
        late.stop()


def test_reregisters_when_the_kubelet_drops_the_stream(kubelet, start_plugin):
    manager = start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    before = len(kubelet.register_requests)
    old_socket = manager.servers[0].socket_path
    kubelet.drop_connection(SHARE)  # the kubelet closing its connection (e.g. a broken transport)
    assert kubelet.wait_for(lambda st: len(kubelet.register_requests) > before and registered(SHARE)(st), timeout=2)
    assert manager.servers[0].socket_path == old_socket  # same socket, registered again


def test_stop_ends_streams_and_removes_sockets(kubelet, start_plugin, plugin_dir):
    manager = start_plugin(MIXED)
    assert kubelet.wait_for(registered(SHARE, GPU), timeout=5)
    manager.stop()
    assert kubelet.wait_for(lambda st: st[SHARE].allocatable == 0 and st[GPU].allocatable == 0, timeout=2)
    assert not list(plugin_dir.glob("gpu-share-*.sock"))


@pytest.mark.parametrize(
    "request_kwargs, message",
    [
        ({"version": "v1alpha2"}, 'requested API version "v1alpha2" is not supported by kubelet'),
        ({"resource_name": "gpu"}, 'the ResourceName "gpu" is invalid'),
        ({"resource_name": "nvidia.kubernetes.io/gpu"}, 'the ResourceName "nvidia.kubernetes.io/gpu" is invalid'),
        ({"endpoint": "/tmp/elsewhere/plugin.sock"}, "failed to dial device plugin"),
    ],
)
def test_kubelet_simulator_validates_register_like_the_kubelet(kubelet, request_kwargs, message, monkeypatch):
    import deviceplugin.sim.kubelet as sim

    monkeypatch.setattr(sim, "DIAL_TIMEOUT", 0.3)
    fields = {"version": "v1beta1", "endpoint": "missing.sock", "resource_name": "example.com/gpu", **request_kwargs}
    with grpc.insecure_channel(f"unix:{kubelet.socket}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.RegistrationStub(channel).Register(pb.RegisterRequest(**fields), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert message in err.value.details()


def test_preferred_allocation_tolerates_unknown_ids_and_short_supply(kubelet, start_plugin):
    start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    stub = kubelet.stub(SHARE)
    odd = [
        pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=["GPU-x::1", "junk"], allocation_size=2
        ),  # unknown IDs
        pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=[f"{UUID0}::1"], allocation_size=5
        ),  # more than available
    ]
    response = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=odd), timeout=5)
    assert [list(r.deviceIDs) for r in response.container_responses] == [[], [f"{UUID0}::1"]]
    assert (
        stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["anything"]), timeout=5)
        == pb.PreStartContainerResponse()
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"available_deviceIDs": [f"{UUID0}::1"], "allocation_size": 0}, "allocation_size must be at least 1, got 0"),
        ({"available_deviceIDs": [f"{UUID0}::1"], "allocation_size": -3}, "allocation_size must be at least 1, got -3"),
        (
            {
                "available_deviceIDs": [f"{UUID0}::1", f"{UUID0}::2"],
                "must_include_deviceIDs": [f"{UUID0}::1", f"{UUID0}::2"],
                "allocation_size": 1,
            },
            "must_include_deviceIDs has 2 IDs, more than allocation_size 1",
        ),
        (
            {"available_deviceIDs": [f"{UUID0}::1"], "must_include_deviceIDs": [f"{UUID0}::3"], "allocation_size": 1},
            "not in available_deviceIDs: GPU-",
        ),
        ({"available_deviceIDs": ["x" * 10240], "allocation_size": 1}, "a device ID of 10240 characters (at most 256)"),
    ],
)
def test_preferred_allocation_rejects_invalid_requests(kubelet, start_plugin, fields, message):
    start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    request = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(**fields)])
    with pytest.raises(grpc.RpcError) as err:
        kubelet.stub(SHARE).GetPreferredAllocation(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert len(err.value.details()) < 400


def test_huge_or_crafted_allocate_ids_get_short_escaped_errors(kubelet, start_plugin, caplog):
    start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    stub = kubelet.stub(SHARE)
    with pytest.raises(grpc.RpcError) as err:
        stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["y" * 10240])]), timeout=5
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.value.details()) < 400
    forged = "GPU-x\n2026-01-01 INFO forged line"
    with caplog.at_level("WARNING"), pytest.raises(grpc.RpcError) as err:
        stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[forged] * 50)]), timeout=5
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    refused = [r.getMessage() for r in caplog.records if "refused Allocate" in r.getMessage()]
    assert refused and all("\n" not in line and len(line) < 1000 for line in refused)


@pytest.mark.parametrize(
    "method", ["GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer"]
)
def test_an_undecodable_request_is_refused_as_invalid_with_what_it_should_have_been(
    kubelet, start_plugin, plugin_dir, method
):
    start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    sock = next(plugin_dir.glob("gpu-share-*.sock"))
    with grpc.insecure_channel(f"unix:{sock}") as channel:
        kind = channel.unary_stream if method == "ListAndWatch" else channel.unary_unary
        call = kind(f"/v1beta1.DevicePlugin/{method}", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            answer = call(b"\xff\xff\xff\xff", timeout=3)
            if method == "ListAndWatch":
                next(answer)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("the request is not a valid v1beta1.") and "Error" not in err.value.details()
    assert allocate(kubelet, SHARE, [f"{UUID0}::1"]).container_responses  # still serving


def test_a_flood_of_large_preferred_allocations_is_placed_one_at_a_time_and_bounded(kubelet, start_plugin, plugin_dir):
    """Large requests are placed off the event loop one at a time per resource; beyond MAX_PREFERRED_WAITING in
    flight the rest are refused with RESOURCE_EXHAUSTED and a message, and the admitted ones get the same answer as
    a lone request (so the loop stays free for every resource's Allocate)."""
    from deviceplugin.plugin.servicer import MAX_PREFERRED_WAITING

    manager = start_plugin(
        {"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 1024}]}, node_name="8xH100-80GB"
    )
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    ids = list(manager.resources[0].devices)
    request = pb.PreferredAllocationRequest(
        container_requests=[pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=3)]
    )
    stub = kubelet.stub(SHARE)
    alone = stub.GetPreferredAllocation(request, timeout=10).container_responses[0].deviceIDs
    calls = [stub.GetPreferredAllocation.future(request, timeout=30) for _ in range(4 * MAX_PREFERRED_WAITING)]
    answered, refused = [], []
    for call in calls:
        try:
            answered.append(list(call.result().container_responses[0].deviceIDs))
        except grpc.RpcError as err:
            refused.append((err.code(), err.details()))
    assert answered and all(a == list(alone) for a in answered) and len(alone) == 3
    assert refused and set(refused) == {
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{MAX_PREFERRED_WAITING} GetPreferredAllocation calls of {SHARE} are in flight already",
        )
    }
    assert manager.servers[0].preferred_waiting == 0

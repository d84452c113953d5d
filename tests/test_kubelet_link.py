"""The kubelet link when leaned on: dropped and held streams, restart storms, live sockets, long paths, signals."""

from __future__ import annotations

import dataclasses
import random
import signal
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from deviceplugin.api import deviceplugin_pb2 as pb
from deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from deviceplugin.config.types import default_config
from deviceplugin.plugin.manager import PluginManager, remove_stale_sockets
from deviceplugin.plugin.server import SocketPathError
from deviceplugin.plugin.servicer import MAX_OTHER_STREAMS
from deviceplugin.sim.kubelet import Container, KubeletSimulator, Pod
from tests.support.resources import resources_of

from .conftest import FAST, node, registered, start_run, wait_until

SHARE = "example.com/gpu-share"


def plugin_threads() -> int:
    """Threads of this process that are not the built-in kubelet's (its per-stream consumers and gRPC workers)."""
    return sum(not t.name.startswith(("lw-", "kubelet", "ThreadPoolExecutor")) for t in threading.enumerate())


def plugin_channel(manager: PluginManager) -> grpc.Channel:
    return grpc.insecure_channel(f"unix:{manager.servers[0].socket_path}")


def allocate_one(stub: pb_grpc.DevicePluginStub, device_id: str) -> pb.AllocateResponse:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[device_id])])
    return stub.Allocate(request, timeout=2)


@pytest.mark.parametrize("drops", [8, 100])
def test_dropped_streams_cost_nothing_and_never_re_register(kubelet, start_plugin, drops):
    manager = start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    registers = len(kubelet.register_requests)
    with plugin_channel(manager) as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        for _ in range(drops):
            stream = stub.ListAndWatch(pb.Empty())
            assert len(next(stream).devices) == 20
            stream.cancel()
        device = next(iter(manager.resources[0].devices))
        assert allocate_one(stub, device).container_responses[0].envs["GPU_SHARE_COUNT"] == "1"
        assert stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=[device], allocation_size=1)
                ]
            ),
            timeout=2,
        ).container_responses[0].deviceIDs == [device]
    time.sleep(0.2)  # the sleep is the test: in several watch rounds no Register is triggered
    assert len(kubelet.register_requests) == registers == 1
    assert kubelet.admit(Pod("after", [Container("c", {SHARE: 2})]))["c"][SHARE].envs["GPU_SHARE_COUNT"] == "2"


def test_held_open_streams_all_get_lists_and_updates_up_to_the_cap(kubelet, start_plugin):
    manager = start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    with plugin_channel(manager) as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        streams = [stub.ListAndWatch(pb.Empty()) for _ in range(MAX_OTHER_STREAMS)]
        assert all(len(next(s).devices) == 20 for s in streams)
        with pytest.raises(grpc.RpcError) as err:
            next(stub.ListAndWatch(pb.Empty()))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{MAX_OTHER_STREAMS} ListAndWatch streams of {SHARE} are open already" in err.value.details()
        device = next(iter(manager.resources[0].devices))
        for _ in range(20):
            assert allocate_one(stub, device).container_responses
        manager.state.set_health({manager.resources[0].units[0].uuid: "test"})
        updates = [next(s) for s in streams]
        assert all(sum(d.health == "Unhealthy" for d in u.devices) == 10 for u in updates)
        for s in streams:
            s.cancel()
    # The kubelet's own stream is not counted: it still gets the change, and nothing re-registered.
    assert kubelet.wait_for(lambda st: len(st[SHARE].unhealthy) == 10, timeout=2)
    assert len(kubelet.register_requests) == 1


def test_restart_storm_settles_with_one_register_per_generation_and_no_leaks(kubelet, start_plugin):
    manager = start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    threads = plugin_threads()
    rng = random.Random(3)
    restarts = 50
    for _ in range(restarts):
        kubelet.restart()
        time.sleep(rng.uniform(0, 0.06))  # the storm's timing is the test's input
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    time.sleep(0.3)  # the sleep is the test: a late attempt would land within it
    # At most one accepted Register per kubelet generation; every other call was refused by a dying kubelet.
    accepted = kubelet.accepted_registrations()
    assert accepted and max(accepted.values()) == 1
    assert len(kubelet.register_requests) <= manager.servers[0].register_calls
    # One registration channel per kubelet instance, never one per attempt: the churn that grew gRPC's memory.
    assert manager.kubelet_channel.opened <= restarts + 1
    assert registered(SHARE)(kubelet.resources())
    # Threads that outlive a round (a gRPC channel's, a probe's) end on their own: wait for them, then compare.
    wait_until(lambda: plugin_threads() <= threads, timeout=5)
    assert plugin_threads() <= threads, sorted(t.name for t in threading.enumerate())
    assert kubelet.admit(Pod("after", [Container("c", {SHARE: 1})]))["c"][SHARE].envs["GPU_SHARE_COUNT"] == "1"


class _SilentKubelet(pb_grpc.RegistrationServicer):
    """A kubelet that takes Register and never answers (it hangs, or died without closing the connection)."""

    def __init__(self) -> None:
        self.called = threading.Event()
        self.release = threading.Event()

    def Register(self, request, context):
        self.called.set()
        self.release.wait(30)
        context.abort(grpc.StatusCode.UNAVAILABLE, "gone")


def test_a_register_waiting_on_a_dead_kubelet_is_cancelled_when_kubelet_sock_is_replaced(plugin_dir, start_plugin):
    silent = _SilentKubelet()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RegistrationServicer_to_server(silent, server)
    server.add_insecure_port(f"unix:{plugin_dir / 'kubelet.sock'}")
    server.start()
    kubelet = KubeletSimulator(plugin_dir, seed=7)
    try:
        # A 60 s Register deadline: only the cancellation can bring the registration back within the wait below.
        manager = start_plugin(timings=dataclasses.replace(FAST, register_timeout=60.0))
        assert silent.called.wait(5)
        kubelet.start()  # a new kubelet.sock: the old kubelet's listener is left behind, as after a crash
        assert kubelet.wait_for(registered(SHARE), timeout=10)
        assert manager.kubelet_channel.opened == 2
        assert manager.servers[0].registered.is_set()
        manager.stop()
        assert manager.kubelet_channel.identity is None  # closed with the manager
    finally:
        silent.release.set()
        server.stop(0).wait()
        kubelet.stop()


def test_a_socket_another_live_process_serves_is_left_alone(kubelet, start_plugin, plugin_dir):
    first = start_plugin()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    live = first.servers[0].socket_path
    stale = plugin_dir / "gpu-share-old-1-1.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(stale))  # bound, never listening: nobody answers, as after a crash
    dead.close()
    remove_stale_sockets(plugin_dir)
    assert live.exists() and not stale.exists()
    with grpc.insecure_channel(f"unix:{live}") as channel:
        assert (
            pb_grpc.DevicePluginStub(channel)
            .GetDevicePluginOptions(pb.Empty(), timeout=2)
            .get_preferred_allocation_available
        )


def test_a_socket_path_over_the_kernel_limit_is_a_clear_error(tmp_path):
    long_dir = tmp_path / ("d" * 90)
    long_dir.mkdir()
    manager = PluginManager(resources_of(default_config(), node("2xT4")), long_dir, FAST)
    with pytest.raises(SocketPathError, match=r"pool default: socket path .* over the kernel's limit of 107"):
        manager.start()
    manager.stop()


def test_sigterm_with_many_streams_open_exits_within_the_grace_period(kubelet, plugin_dir):
    proc = start_run(plugin_dir)
    try:
        assert kubelet.wait_for(registered(SHARE), timeout=15)
        sock = next(plugin_dir.glob("gpu-share-*.sock"))
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            streams = [stub.ListAndWatch(pb.Empty()) for _ in range(MAX_OTHER_STREAMS)]
            assert all(next(s).devices for s in streams)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=10)
            assert time.monotonic() - started < 5
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=5)
    assert proc.returncode == 0
    assert not list(plugin_dir.glob("gpu-share-*.sock"))


class _HangingKubelet(pb_grpc.RegistrationServicer):
    """A kubelet whose Register never answers: the plugin's call stays in flight until cancelled."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.cancelled = threading.Event()

    def Register(self, request, context):
        context.add_callback(self.cancelled.set)
        self.entered.set()
        self.cancelled.wait(10)
        return pb.Empty()


def test_stopping_cancels_a_register_in_flight(plugin_dir):
    from concurrent import futures

    hanging = _HangingKubelet()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RegistrationServicer_to_server(hanging, server)
    server.add_insecure_port(f"unix:{plugin_dir / 'kubelet.sock'}")
    server.start()
    try:
        manager = PluginManager(resources_of(default_config(), node("2xT4")), plugin_dir, FAST)
        manager.start()
        assert hanging.entered.wait(5)
        started = time.monotonic()
        manager.stop()
        assert time.monotonic() - started < 2
        assert hanging.cancelled.wait(2)  # the kubelet saw the call cancelled, not left hanging for 30 s
        assert manager.readiness() == (False, "not registered: example.com/gpu-share")
    finally:
        server.stop(0)


def test_sigterm_while_start_up_hangs_still_ends_the_process(plugin_dir, tmp_path):
    import os
    import subprocess
    import sys

    fifo = tmp_path / "node.yaml"
    os.mkfifo(fifo)  # reading the node file blocks, as a wedged driver would
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deviceplugin.cli",
            "run",
            "--node",
            str(fifo),
            "--plugin-dir",
            str(plugin_dir),
            "--metrics-port",
            "0",
            "--shutdown-grace",
            "0.5",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Start-up blocks opening the FIFO, where nothing outside can see it (a writer opening the FIFO would end
        # the hang): a second is long enough to get there, and staying there is what the test needs.
        time.sleep(1.0)
        assert proc.poll() is None  # still hanging in start-up
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert (
        "SIGTERM received, shutting down" in err
        and "shutdown took longer than 0.5s (--shutdown-grace); exiting now" in err
    )

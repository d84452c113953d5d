"""Shared fixtures and helpers: a short temp plugin dir, the built-in kubelet, a plugin started in-process, a free
port, an HTTP GET, a container's cgroup line."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.config.types import Config
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.model.node import NodeInfo
from deviceplugin.plugin.manager import PluginManager
from deviceplugin.plugin.server import Timings
from deviceplugin.sim.kubelet import KubeletSimulator, Pod
from tests.support.resources import resources_of

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FAST = Timings(register_timeout=5.0, backoff_initial=0.05, backoff_max=0.2, watch_interval=0.05, stop_grace=0.2)
GPU_CLI = [sys.executable, "-m", "deviceplugin.cli"]


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: keep the directory short.
    path = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(plugin_dir: Path) -> Iterator[KubeletSimulator]:
    sim = KubeletSimulator(plugin_dir, seed=7)
    sim.start()
    yield sim
    sim.stop()


def node(name: str) -> NodeInfo:
    return SimulatedInventory.from_file(EXAMPLES / "nodes" / f"{name}.yaml").discover()


@pytest.fixture
def start_plugin(plugin_dir: Path) -> Iterator[Callable[..., PluginManager]]:
    """start_plugin(config=None|dict|Config, node_name="2xT4") -> a started PluginManager."""
    managers: list[PluginManager] = []

    def start(
        config: dict[str, Any] | Config | None = None, node_name: str = "2xT4", timings: Timings = FAST
    ) -> PluginManager:
        resources = resources_of(config, node(node_name))
        manager = PluginManager(resources, plugin_dir, timings)
        manager.start()
        managers.append(manager)
        return manager

    yield start
    for manager in managers:
        manager.stop()


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll `predicate` until it holds or `timeout` passes; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    """HTTP GET: (status, body), for error statuses too."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def cgroup(pod: Pod, container: str) -> str:
    """The /proc/<pid>/cgroup line of a process in this container (cgroup v2, systemd driver, containerd)."""
    cid = pod.container_ids[container].split("://")[1]
    uid = pod.uid.replace("-", "_")
    return f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/cri-containerd-{cid}.scope\n"


def start_run(plugin_dir: Path, *extra: str) -> subprocess.Popen:
    """`gpu-share run` as a subprocess on the simulated 2xT4 node, with a short watch interval and no metrics port."""
    return subprocess.Popen(
        [
            *GPU_CLI,
            "run",
            "--node",
            str(EXAMPLES / "nodes" / "2xT4.yaml"),
            "--plugin-dir",
            str(plugin_dir),
            "--watch-interval",
            "0.05",
            "--metrics-port",
            "0",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def registered(*names: str) -> Callable[[dict], bool]:
    """Predicate for KubeletSimulator.wait_for: these resources registered with healthy devices."""
    return lambda status: all(n in status and status[n].registered and status[n].allocatable > 0 for n in names)


@pytest.fixture
def fake_kube(tmp_path):
    """A fake Kubernetes API with one Node; yields (api, kubeconfig path)."""
    from .support.fake_kube import FakeKube

    api = FakeKube().start()
    yield api, api.write_kubeconfig(tmp_path / "kubeconfig")
    api.stop()


@pytest.fixture(scope="session")
def controlplane() -> Iterator[Any]:
    """One real kube-apiserver (with etcd) for the whole session; skipped without `KUBEBUILDER_ASSETS`."""
    from tests.support.controlplane import ControlPlane, assets_dir

    binaries = assets_dir()
    if binaries is None:
        pytest.skip(
            "needs the control-plane binaries: set KUBEBUILDER_ASSETS to a directory with etcd, kube-apiserver, "
            "kube-scheduler"
        )
    cp = ControlPlane.start(binaries)
    yield cp
    cp.stop()

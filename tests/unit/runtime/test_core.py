"""runtime.core: both front ends run on one NodeCore. The device plugin's PluginDaemon and the DRA driver's DraDaemon
each get the health monitor with the device-node check (deviceSpecs) and its first pass before serving, the one
NodeState their servers read, the node agent, hot reload with the core's consumers after their own, and the stop
order in which every step runs even when one fails."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.agent.watchdog import host_pid_namespace
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.dra.devices import ClaimError
from deviceplugin.runtime.daemon import PluginDaemon, build_daemon
from deviceplugin.runtime.dra import DraDaemon, DraOptions
from deviceplugin.runtime.options import DaemonOptions
from deviceplugin.runtime.plan import read_config
from deviceplugin.sim.kubelet import KubeletSimulator
from tests.conftest import EXAMPLES, FAST, node
from tests.support.dra import claim, result

T4 = node("2xT4")
U0, U1 = T4.gpus[0].uuid, T4.gpus[1].uuid


@pytest.fixture
def front_ends(kubelet: KubeletSimulator, plugin_dir: Path, tmp_path: Path) -> Iterator[Callable[[str], Any]]:
    """Either front end on the 2xT4 node with deviceSpecs on a host root that lacks /dev/nvidia1; not started."""
    root = tmp_path / "host"
    (root / "dev").mkdir(parents=True)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0"):
        (root / "dev" / name).touch()
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "version": "v1",
                "deviceSpecs": True,
                "deviceRoot": str(root),
                "pools": [{"name": "w", "mode": "exclusive"}],
            }
        )
    )
    options = DaemonOptions(
        config_file=str(config),
        node_name="2xT4",
        plugin_dir=plugin_dir,
        pod_resources_socket=kubelet.pod_resources_socket,
        metrics_port=0,
        reload_interval=60,
        timings=FAST,
    )
    made: list[Any] = []

    def make(api: str) -> PluginDaemon | DraDaemon:
        inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml")
        if api == "deviceplugin":
            d: PluginDaemon | DraDaemon = build_daemon(inventory, options)
        else:
            dra = DraOptions(
                registrar_dir=plugin_dir / "registry", plugins_dir=plugin_dir / "plugins", cdi_root=tmp_path / "cdi"
            )
            d = DraDaemon(inventory, options, dra, None, read_config(str(config)))
        made.append(d)
        return d

    yield make
    for d in made:
        d.agent.stop()  # never started: closes its pod-resources channel


@pytest.mark.parametrize("api", ["deviceplugin", "dra"])
def test_each_front_end_gets_the_health_monitor_with_the_device_node_check_and_the_core_state(
    front_ends: Any, api: str
) -> None:
    d = front_ends(api)
    core = d.core
    assert core.monitor.node_check is core.device_nodes and d.state is core.state and d.monitor is core.monitor
    assert d.reloader.consumers[-3:] == (
        d.agent.watchdog,
        d.agent,
        core,
    )  # the core's after the front end's; no client: no publisher
    assert d.publisher is None and d.events is None
    core.first_pass()
    assert (
        "deviceSpecs: device node(s) missing" in core.state.snapshot().reasons[U1]
        and U0 not in core.state.snapshot().unhealthy
    )


def test_the_device_plugin_servers_read_the_core_state(front_ends: Any) -> None:
    d = front_ends("deviceplugin")
    assert d.manager.state is d.core.state and d.manager.mps_gate.readiness.liveness is d.core.mps


def test_the_dra_driver_refuses_a_gpu_whose_device_nodes_are_missing_after_the_first_pass(front_ends: Any) -> None:
    d = front_ends("dra")
    d.core.first_pass()
    with pytest.raises(ClaimError, match="device node"):
        d.driver.prepare(*claim([result("gpu-1")]))
    assert d.driver.prepare(*claim([result("gpu-0")])).devices[0].device == "gpu-0"
    health = {h.device.device_name: h.health for h in d.plugin.health_message().devices}
    assert health == {"gpu-0": 1, "gpu-1": 2}  # HEALTHY, UNHEALTHY: what the kubelet's first health list says


def test_every_stop_step_runs_when_one_fails_and_the_first_failure_is_raised(front_ends: Any, caplog: Any) -> None:
    d = front_ends("deviceplugin")

    def broken() -> None:
        raise RuntimeError("a server would not stop")

    caplog.set_level(logging.DEBUG, logger="deviceplugin.runtime.core")
    with pytest.raises(RuntimeError, match="would not stop"):
        d.core.stop([("broken servers", broken), ("device-plugin servers", d.manager.stop)])
    steps = [
        r.getMessage().split(" in ")[0]
        for r in caplog.records
        if r.getMessage().startswith("stop: ") and " in " in r.getMessage()
    ]
    assert steps == [
        "stop: config reloader",
        "stop: broken servers",
        "stop: device-plugin servers",
        "stop: node-agent",
        "stop: health",
        "stop: inventory",
    ]


def test_host_pid_namespace_compares_the_pid_namespaces_and_fails_closed(tmp_path: Path) -> None:
    own = tmp_path / "own"
    (own / "ns").mkdir(parents=True)
    (own / "ns" / "pid").touch()
    host = tmp_path / "host"
    (host / "1" / "ns").mkdir(parents=True)
    (host / "1" / "ns" / "pid").symlink_to(own / "ns" / "pid")  # the same namespace file: hostPID
    assert host_pid_namespace(str(host), str(own)) is None
    other = tmp_path / "other"
    (other / "1" / "ns").mkdir(parents=True)
    (other / "1" / "ns" / "pid").touch()
    assert "not in the host's PID namespace" in (host_pid_namespace(str(other), str(own)) or "")
    assert "cannot be compared" in (host_pid_namespace(str(tmp_path / "nothing"), str(own)) or "")


def test_the_core_imports_neither_front_end() -> None:
    """runtime.core is under both front ends: it imports neither (runtime.serving/daemon, runtime.dra) nor their
    servers (plugin.manager, dra/) at run time."""
    import ast

    import deviceplugin.runtime.core as core

    tree = ast.parse(Path(core.__file__).read_text())
    imported = {
        node.module or ""
        for node in tree.body  # module level: TYPE_CHECKING blocks are `if` statements, not imports
        if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"serving", "daemon", "plugin.manager"}
    assert not [m for m in imported if m == "dra" or m.startswith("dra.")]

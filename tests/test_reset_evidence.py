"""Reset evidence outlives the process: an XID 79 on the fake NVML, a SIGKILL of `gpu-share run`, a restart — the
GPU is still Unhealthy in the first ListAndWatch the kubelet gets (real gRPC, the built-in kubelet), and stays so
until the driver's recovery action shows a reset. For the DRA driver, the same evidence taints the devices of the
slice a restarted driver publishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from deviceplugin.sim.kubelet import KubeletSimulator
from tests.conftest import wait_until
from tests.support.fake_nvml_faults import NONE, RESET_REQUIRED, UUIDS, write_faults

SHARES = "example.com/gpu-share"  # run's default: every GPU in 10 shares


def _run(faults: Path, plugin_dir: Path, kubelet: KubeletSimulator, log: Path) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "tests.support.fake_nvml_faults",
        str(faults),
        "run",
        "--plugin-dir",
        str(plugin_dir),
        "--pod-resources-socket",
        str(kubelet.pod_resources_socket),
        "--metrics-port",
        "0",
        "--watch-interval",
        "0.05",
        "--health-interval",
        "0.1",
        "--shutdown-grace",
        "2",
    ]
    with log.open("ab") as out:
        env = {**os.environ, "NODE_NAME": "n-evidence"}
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def _listed(kubelet: KubeletSimulator, registrations: int, allocatable: int) -> bool:
    """The kubelet took `registrations` Registers of the shared resource and its newest list has `allocatable`."""
    status = kubelet.resources().get(SHARES)
    registered = sum(n for (_, name), n in kubelet.accepted_registrations().items() if name == SHARES)
    listed = status is not None and status.capacity == 20 and status.allocatable == allocatable
    return registered >= registrations and listed


def test_an_xid_79_gpu_stays_unhealthy_across_a_sigkill(plugin_dir, kubelet, tmp_path):
    faults, log = tmp_path / "faults.json", tmp_path / "plugin.log"
    evidence = plugin_dir / "gpu-share" / "reset-evidence.json"
    write_faults(faults)
    proc = _run(faults, plugin_dir, kubelet, log)
    try:
        assert kubelet.wait_for(lambda _: _listed(kubelet, 1, 20), timeout=30), log.read_text()
        write_faults(faults, xids=[(0, 79)])
        assert kubelet.wait_for(lambda _: _listed(kubelet, 1, 10), timeout=10), log.read_text()
        assert json.loads(evidence.read_text())["evidence"][UUIDS[0]]["reason"] == "XID 79"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL

        write_faults(faults)  # the XID is not delivered again: only the file remembers it
        proc = _run(faults, plugin_dir, kubelet, log)
        assert kubelet.wait_for(lambda _: _listed(kubelet, 2, 10), timeout=30), log.read_text()
        assert "needed a GPU reset before this process started (XID 79)" in log.read_text()

        write_faults(faults, recovery={0: RESET_REQUIRED, 1: NONE})  # the driver asks for a reset ...
        seen = lambda: json.loads(evidence.read_text())["evidence"][UUIDS[0]]["resetRequiredSeen"]  # noqa: E731
        assert wait_until(seen, timeout=10)
        write_faults(faults, recovery={0: NONE, 1: NONE})  # ... and the reset happened
        assert kubelet.wait_for(lambda _: _listed(kubelet, 2, 20), timeout=10), log.read_text()
        assert json.loads(evidence.read_text())["evidence"] == {}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_restarted_dra_driver_publishes_the_xid_79_gpu_tainted(kubelet, plugin_dir, tmp_path):
    """The DRA driver's root keeps the evidence beside its checkpoint; a driver built anew on the same directories
    (a SIGKILL leaves nothing else) taints the GPU's devices in the slice it builds, until the driver shows a reset."""
    from deviceplugin.discovery.simulated import SimulatedInventory
    from deviceplugin.dra.pool import Pool
    from deviceplugin.dra.taints import device_taints
    from deviceplugin.runtime.dra import DraDaemon, DraOptions
    from deviceplugin.runtime.options import DaemonOptions
    from deviceplugin.runtime.plan import read_config
    from tests.conftest import EXAMPLES, FAST

    options = DaemonOptions(
        node_name="2xT4", pod_resources_socket=kubelet.pod_resources_socket, metrics_port=0, timings=FAST
    )
    dra = DraOptions(
        registrar_dir=plugin_dir / "registry", plugins_dir=plugin_dir / "plugins", cdi_root=tmp_path / "cdi"
    )

    def driver(inventory: SimulatedInventory) -> DraDaemon:
        return DraDaemon(inventory, options, dra, None, read_config(None))

    def slice_taints(d: DraDaemon) -> dict[str, list[str]]:
        view = d.state.snapshot()
        rendered = []
        for device in d.driver.devices:
            body = device.to_api(d.driver_name, d.node)
            body["taints"] = device_taints(device, view, d.driver_name)
            rendered.append(body)
        (spec,) = Pool("2xT4", d.driver_name, {"uid": "u"}, rendered).specs(1).values()
        return {dev["name"]: [f"{t['key']}={t['value']}" for t in dev["taints"]] for dev in spec["devices"]}

    inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml")
    gpu = inventory.discover().gpus[0]
    first = driver(inventory)
    try:
        inventory.inject_xid(gpu.uuid, 79)
        first.monitor.handle(inventory.wait_for_event(1.0))
        assert (first.paths.data_dir / "reset-evidence.json").exists()
    finally:
        first.agent.stop()
    second = driver(inventory)  # the restart: a new NodeState, the same data directory
    try:
        taints = slice_taints(second)
        tainted = {name for name, values in taints.items() if values}
        assert tainted and all(name.startswith("gpu-0") for name in tainted)
        assert set(taints["gpu-0"]) == {f"{second.driver_name}/unhealthy=reset-required"}
        inventory.set_reset_required(gpu.uuid, True)
        second.monitor.check(0.0)
        inventory.set_reset_required(gpu.uuid, False)
        second.monitor.check(1.0)
        assert not any(slice_taints(second).values())
    finally:
        second.agent.stop()
        inventory.close()

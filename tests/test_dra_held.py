"""A reload of the DRA driver's config under prepared claims (issue 29's repro), through the daemon's own reloader:
the held GPU keeps its shape, takes no new claim, and switches once its claim is unprepared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.dra.devices import ClaimError
from deviceplugin.runtime.dra import DraDaemon, DraOptions
from deviceplugin.runtime.options import DaemonOptions
from deviceplugin.runtime.plan import read_config
from deviceplugin.sim.kubelet import KubeletSimulator
from tests.conftest import EXAMPLES, FAST
from tests.support.dra import claim, result


def _write(path: Path, replicas: int) -> None:
    path.write_text(json.dumps({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": replicas}]}))


def test_a_reload_to_8_replicas_keeps_the_gpu_a_claim_holds_2_of_4_of(
    kubelet: KubeletSimulator, plugin_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    _write(config, 4)
    options = DaemonOptions(
        config_file=str(config),
        node_name="2xT4",
        pod_resources_socket=kubelet.pod_resources_socket,
        metrics_port=0,
        reload_interval=60,
        timings=FAST,
    )
    dra = DraOptions(
        registrar_dir=plugin_dir / "registry", plugins_dir=plugin_dir / "plugins", cdi_root=tmp_path / "cdi"
    )
    d = DraDaemon(
        SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml"), options, dra, None, read_config(str(config))
    )
    try:
        ref, body = claim([result("gpu-0", shares=2)])
        d.driver.prepare(ref, body)
        reloads = d.reloader.reloads
        _write(config, 8)
        d.reloader.check()
        d.reloader.check()  # the reloader waits one round for the file to settle
        assert d.reloader.reloads == reloads + 1
        assert {x.name: x.shares for x in d.driver.devices} == {"gpu-0": 4, "gpu-1": 8}
        with pytest.raises(ClaimError, match="is held by 1 holder"):  # 6 of 8 on GPU 0 was 19,200 MiB of 15,360
            d.driver.prepare(*claim([result("gpu-0", shares=1)]))
        assert "gpushare_config_pending_gpus 1.0" in generate_latest(d.registry).decode()
        d.driver.unprepare(ref)
        d.shapes.check()  # the kubelet plugin runs it after every unprepare call
        assert {x.name: x.shares for x in d.driver.devices} == {"gpu-0": 8, "gpu-1": 8}
        assert d.driver.prepare(*claim([result("gpu-0", shares=6)])).devices[0].memory_mib == 11520
    finally:
        d.agent.stop()
        d.inventory.close()

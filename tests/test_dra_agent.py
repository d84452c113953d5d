"""The node agent in DRA mode (runtime.dra): claims the driver prepared, reported per container by the simulated
kubelet's pod-resources over real gRPC, give the per-container metrics, the GPU-seconds meter, the memory watchdog
and the residue guard, whose quarantine the driver then refuses to prepare on."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.agent.loop import AgentSettings
from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.dra.devices import ClaimError
from deviceplugin.dra.taints import QUARANTINED, device_taints, taint_key
from deviceplugin.health.monitor import HealthSettings
from deviceplugin.runtime.dra import DraDaemon, DraOptions
from deviceplugin.runtime.options import DaemonOptions
from deviceplugin.runtime.plan import read_config
from deviceplugin.sim.kubelet import Container, KubeletSimulator, Pod
from tests.conftest import EXAMPLES, FAST, cgroup, free_port, get, node
from tests.support.dra import DRIVER, claim, result
from tests.test_agent import samples, value

MIB = 1024 * 1024
T4 = node("2xT4")
U0, U1 = T4.gpus[0].uuid, T4.gpus[1].uuid
SHARE, GPU = "example.com/gpu-share", "example.com/gpu"


@pytest.fixture
def daemon(kubelet: KubeletSimulator, plugin_dir: Path, tmp_path: Path) -> Iterator[Callable[..., DraDaemon]]:
    """A DraDaemon on the 2xT4 node (GPU 0 time-sliced in 4, GPU 1 whole) whose agent reads the simulated kubelet's
    pod-resources and pod directory; its metrics are served, its rounds are the test's. No API server: the test
    prepares claims on the driver directly."""
    made: list[DraDaemon] = []

    def make(policy: str = "report") -> DraDaemon:
        config = tmp_path / "config.yaml"
        config.write_text(
            json.dumps(
                {
                    "version": "v1",
                    "memoryWatchdog": {"policy": policy, "quarantine": True},
                    "pools": [
                        {"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [0]}},
                        {"name": "w", "mode": "exclusive"},
                    ],
                }
            )
        )
        options = DaemonOptions(
            config_file=str(config),
            node_name="2xT4",
            pod_resources_socket=kubelet.pod_resources_socket,
            metrics_port=free_port(),
            metrics_host="127.0.0.1",
            proc_root=str(tmp_path / "proc"),
            reload_interval=60,
            timings=FAST,
            health=HealthSettings(check_interval=0.05),
            agent=AgentSettings(interval=3600),
        )
        dra = DraOptions(
            registrar_dir=plugin_dir / "registry", plugins_dir=plugin_dir / "plugins", cdi_root=tmp_path / "cdi"
        )
        inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml", proc_root=tmp_path / "proc")
        d = DraDaemon(inventory, options, dra, None, read_config(str(config)), pod_directory=kubelet.pod_directory())
        assert d.metrics_server is not None
        d.metrics_server.start()
        made.append(d)
        return d

    yield make
    for d in made:
        assert d.metrics_server is not None
        d.metrics_server.stop()
        d.agent.stop()  # never started: closes its pod-resources channel
        d.inventory.close()


def _uses(name: str, results: list[dict[str, Any]]) -> pr.DynamicResource:
    """A claim as pod-resources lists it for a container that uses it."""
    return pr.DynamicResource(
        claim_name=name,
        claim_namespace="default",
        claim_resources=[
            pr.ClaimResource(
                driver_name=r["driver"], pool_name=r["pool"], device_name=r["device"], share_id=r["shareID"]
            )
            for r in results
        ],
    )


def _scrape(d: DraDaemon) -> dict[tuple, float]:
    status, text = get(f"http://127.0.0.1:{d.options.metrics_port}/metrics")
    assert status == 200
    return samples(text)


def test_prepared_claims_are_metered_and_watched_per_container(daemon: Any, kubelet: KubeletSimulator) -> None:
    d = daemon()
    two = [result("gpu-0", shares=2)]
    d.driver.prepare(*claim(two, name="two"))
    d.driver.prepare(*claim([result("gpu-1")], name="waiting"))  # prepared, its pod not running yet: not in the map
    solo_claim = [result("gpu-0", shares=2)]
    d.driver.prepare(*claim(solo_claim, name="solo"))
    trainer = Pod(
        "trainer",
        [Container("main", {}, claims=[_uses("two", two)]), Container("sidecar", {}, claims=[_uses("two", two)])],
    )
    kubelet.admit(trainer)
    kubelet.admit(Pod("solo", [Container("app", {}, claims=[_uses("solo", solo_claim)])]))
    d.inventory.add_process(301, U0, 6000, cgroup=cgroup(trainer, "main"))
    d.inventory.add_process(302, U0, 2000, cgroup=cgroup(trainer, "sidecar"))
    d.agent.sync()
    m = _scrape(d)
    assert value(m, "gpushare_container_shares", pod="trainer", container="main", resource=SHARE, uuid=U0) == 2
    assert (
        value(m, "gpushare_container_memory_limit_bytes", pod="trainer", container="main") == 7680 * MIB
    )  # 2 of 4 shares of 15360 MiB
    assert value(m, "gpushare_container_memory_used_bytes", pod="trainer", container="main") == 6000 * MIB
    assert value(m, "gpushare_container_over_limit", pod="trainer", container="main") == 0
    assert not [
        labels for name, labels in m if name == "gpushare_container_shares" and ("uuid", U1) in labels
    ]  # the waiting claim
    assert value(m, "gpushare_pod_resources_last_sync_timestamp_seconds") > 0
    assert value(m, "gpushare_gpu_seconds_total", pod="trainer", resource=SHARE) == 0  # counted from the next round
    d.agent.sync()
    first = _scrape(d)
    d.agent.sync()
    second = _scrape(d)
    share_seconds = value(second, "gpushare_share_seconds_total", pod="trainer", resource=SHARE)
    gpu_seconds = value(second, "gpushare_gpu_seconds_total", pod="trainer", resource=SHARE)
    assert gpu_seconds > value(first, "gpushare_gpu_seconds_total", pod="trainer", resource=SHARE) > 0
    assert share_seconds == pytest.approx(gpu_seconds * 4)  # a share of a 4-way GPU is 1/4 GPU
    # Two containers of one claim hold its 2 shares once: as much as the pod with the same claim in one container.
    assert share_seconds == value(second, "gpushare_share_seconds_total", pod="solo", resource=SHARE)
    assert value(second, "gpushare_memory_used_byte_seconds_total", pod="trainer", resource=SHARE) > 0
    # The main container grows over its claim's memory: reported once per episode (policy report).
    d.inventory.add_process(303, U0, 2000, cgroup=cgroup(trainer, "main"))
    d.agent.sync()
    d.agent.sync()
    m = _scrape(d)
    assert value(m, "gpushare_container_over_limit", pod="trainer", container="main") == 1
    assert value(m, "gpushare_memory_violations_total") == 1


def test_the_residue_of_an_ended_claim_holder_quarantines_its_gpu_for_new_claims(
    daemon: Any, kubelet: KubeletSimulator
) -> None:
    d = daemon()
    whole = [result("gpu-1")]
    ref, body = claim(whole, name="whole")
    d.driver.prepare(ref, body)
    gone = Pod("gone", [Container("app", {}, claims=[_uses("whole", whole)])])
    kubelet.admit(gone)
    d.inventory.add_process(401, U1, 4000, cgroup=cgroup(gone, "app"))
    assert d.agent.sync().observation.residue_mib == {}
    assert value(_scrape(d), "gpushare_container_shares", pod="gone", resource=GPU, uuid=U1) == 1
    kubelet.delete_pod(gone.uid)  # the pod is gone, its process's memory is not
    d.driver.unprepare(ref)  # as the kubelet does once the pod ended
    assert d.agent.sync().quarantined_gpus == frozenset()  # seen once: reported, not yet confirmed
    assert d.agent.sync().quarantined_gpus == {U1}
    m = _scrape(d)
    assert (
        value(m, "gpushare_gpu_quarantined", gpu="1") == 1
        and value(m, "gpushare_gpu_residue_memory_bytes", gpu="1") == 4000 * MIB
    )
    assert (
        "gpushare_container_shares",
        (
            ("container", "app"),
            ("namespace", "default"),
            ("node", "2xT4"),
            ("pod", "gone"),
            ("resource", GPU),
            ("uuid", U1),
        ),
    ) not in m
    with pytest.raises(ClaimError, match="quarantined"):
        d.driver.prepare(*claim([result("gpu-1")], name="next"))
    gpu1 = next(x for x in d.driver.devices if x.name == "gpu-1")
    assert device_taints(gpu1, d.state.snapshot(), DRIVER) == [
        {"key": taint_key(DRIVER, QUARANTINED), "value": "residue", "effect": "NoSchedule"}
    ]
    d.inventory.remove_process(401)
    assert d.agent.sync().quarantined_gpus == frozenset()
    assert d.driver.prepare(*claim([result("gpu-1")], name="after")).devices[0].device == "gpu-1"

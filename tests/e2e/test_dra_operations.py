"""The device plugin's operations in DRA mode, on the real API server: the DRA driver's node core publishes GFD-style
labels and the inventory annotation on its Node, and the memory watchdog's Events land on the pod; `kill` without
the host's PID namespace reports instead, saying why. The driver runs in process (claims prepared on it directly,
pod-resources and the pod directory from the simulated kubelet, processes from the simulated NVML)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from deviceplugin.agent.loop import AgentSettings
from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.health.monitor import HealthSettings
from deviceplugin.kube.annotation import ANNOTATION
from deviceplugin.kube.client import NodeClient
from deviceplugin.runtime.dra import DraDaemon, DraOptions
from deviceplugin.runtime.options import DaemonOptions
from deviceplugin.runtime.plan import read_config
from deviceplugin.sim.kubelet import Container, KubeletSimulator, Pod
from tests.conftest import EXAMPLES, FAST, cgroup, node
from tests.support.dra import claim, result
from tests.support.kubeobjects import namespace, ready_node

T4 = node("2xT4")
U0 = T4.gpus[0].uuid


@pytest.fixture
def driver(
    controlplane: Any, kubelet: KubeletSimulator, plugin_dir: Path, tmp_path: Path
) -> Iterator[Callable[..., DraDaemon]]:
    """A DraDaemon on the 2xT4 node (GPU 0 time-sliced in 4, GPU 1 whole) on a Node of the real API server, with the
    node's client for labels and Events; its loops are not started, the test drives them."""
    made: list[DraDaemon] = []
    api = controlplane.api_client()

    def make(policy: str = "report") -> DraDaemon:
        node_name = f"dra-ops-{uuid.uuid4().hex[:8]}"
        ready_node(api, node_name)
        config = tmp_path / "config.yaml"
        config.write_text(
            json.dumps(
                {
                    "version": "v1",
                    "memoryWatchdog": {"policy": policy},
                    "pools": [
                        {"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [0]}},
                        {"name": "w", "mode": "exclusive"},
                    ],
                }
            )
        )
        options = DaemonOptions(
            config_file=str(config),
            node_name=node_name,
            pod_resources_socket=kubelet.pod_resources_socket,
            metrics_port=0,
            proc_root=str(tmp_path / "proc"),
            reload_interval=60,
            label_interval=0.0,
            timings=FAST,
            health=HealthSettings(check_interval=0.05),
            agent=AgentSettings(interval=3600),
        )
        dra = DraOptions(
            registrar_dir=plugin_dir / "registry", plugins_dir=plugin_dir / "plugins", cdi_root=tmp_path / "cdi"
        )
        inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml", proc_root=tmp_path / "proc")
        d = DraDaemon(
            inventory,
            options,
            dra,
            None,
            read_config(str(config)),
            client=NodeClient(controlplane.rest_client(), node_name),
            pod_directory=kubelet.pod_directory(),
        )
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
        client.CoreV1Api(api).delete_node(d.options.node_name)


def _uses(name: str, ns: str, results: list[dict[str, Any]]) -> pr.DynamicResource:
    return pr.DynamicResource(
        claim_name=name,
        claim_namespace=ns,
        claim_resources=[
            pr.ClaimResource(
                driver_name=r["driver"], pool_name=r["pool"], device_name=r["device"], share_id=r["shareID"]
            )
            for r in results
        ],
    )


def _events(api: Any, ns: str, pod: str) -> list[Any]:
    return client.CoreV1Api(api).list_namespaced_event(ns, field_selector=f"involvedObject.name={pod}").items


def _over_limit(d: DraDaemon, kubelet: KubeletSimulator, ns: str, pod: str) -> None:
    """A pod whose container holds 2 of GPU 0's 4 shares (7,680 MiB) and uses 9,000 MiB; one agent round sees it."""
    held = [result("gpu-0", shares=2, pool=d.options.node_name)]
    d.driver.prepare(*claim(held, name=f"{pod}-gpu", namespace=ns))
    tenant = Pod(pod, [Container("app", {}, claims=[_uses(f"{pod}-gpu", ns, held)])], namespace=ns)
    kubelet.admit(tenant)
    d.inventory.add_process(501, U0, 9000, cgroup=cgroup(tenant, "app"))
    d.agent.sync()


def test_the_dra_driver_labels_its_node_and_publishes_the_inventory_annotation(
    controlplane: Any, driver: Any, kubelet: KubeletSimulator
) -> None:
    api = controlplane.api_client()
    d = driver()
    ns = namespace(api, f"dra-ops-{uuid.uuid4().hex[:6]}")
    held = [result("gpu-0", shares=3, pool=d.options.node_name)]
    d.driver.prepare(*claim(held, name="trainer-gpu", namespace=ns))
    kubelet.admit(Pod("trainer", [Container("main", {}, claims=[_uses("trainer-gpu", ns, held)])], namespace=ns))
    d.agent.sync()
    assert d.publisher is not None and d.publisher.publish_now()
    stored = client.CoreV1Api(api).read_node(d.options.node_name)
    labels = stored.metadata.labels
    assert labels["example.com/gpu.count"] == "2" and labels["example.com/gpu.product"] == "Tesla-T4"
    assert labels["example.com/gpu.sharing-strategy"] == "time-slicing" and labels["example.com/gpu.replicas"] == "4"
    assert labels["example.com/gpu-share.s.replicas"] == "4" and labels["example.com/gpu-share.w.replicas"] == "1"
    inventory = json.loads(stored.metadata.annotations[f"example.com/{ANNOTATION}"])
    (unit,) = inventory["resources"]["example.com/gpu-share"]["units"]
    assert (unit["uuid"], unit["total"], unit["used"], unit["free"], unit["health"]) == (U0, 4, 3, 1, "Healthy")
    assert len(inventory["pods"]) == 1  # the trainer's digest
    assert json.loads(stored.metadata.annotations["example.com/gpu-share.labels"]) == sorted(
        k for k in labels if k.startswith("example.com/")
    )


def test_a_watchdog_event_lands_on_the_pod_in_dra_mode(
    controlplane: Any, driver: Any, kubelet: KubeletSimulator
) -> None:
    api = controlplane.api_client()
    d = driver()
    ns = namespace(api, f"dra-ops-{uuid.uuid4().hex[:6]}")
    _over_limit(d, kubelet, ns, "greedy")
    assert d.events is not None
    d.events.deliver()
    (event,) = _events(api, ns, "greedy")
    assert event.reason == "GPUMemoryOverLimit" and event.type == "Warning" and event.involved_object.kind == "Pod"
    assert event.message == (
        f"container {ns}/greedy/app uses 9000 MiB of GPU memory on {U0}, over the 7680 MiB of its 2 share(s) of "
        "example.com/gpu-share"
    )
    assert event.source.host == d.options.node_name


def test_kill_without_the_hosts_pid_namespace_reports_and_says_why(
    controlplane: Any, driver: Any, kubelet: KubeletSimulator
) -> None:
    """The test's --proc-root has no PID 1: the namespaces cannot be compared, so the watchdog does not kill (a host
    PID would name another process in the driver's namespace) and its Event says why."""
    api = controlplane.api_client()
    d = driver(policy="kill")
    killed: list[int] = []
    d.agent.watchdog.kill = killed.append
    ns = namespace(api, f"dra-ops-{uuid.uuid4().hex[:6]}")
    _over_limit(d, kubelet, ns, "greedy")
    assert d.events is not None
    d.events.deliver()
    (event,) = _events(api, ns, "greedy")
    assert killed == [] and event.reason == "GPUMemoryOverLimit"
    unreadable = f"{d.options.proc_root}/1/ns/pid: No such file or directory"
    assert event.message.endswith(f"; not killed: the PID namespaces cannot be compared ({unreadable})")
    assert d.agent.watchdog.kills_refused == 1 and d.agent.watchdog.kills == 0

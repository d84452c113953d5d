"""The node agent on the built-in kubelet: the usage map, metrics, the memory watchdog, the residue guard, metering,
publishing on its own thread, reloads (the pod-resources server: test_pod_resources.py; the Node through the API:
test_kube_node.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin import __version__
from deviceplugin.agent.loop import AgentSettings, NodeAgent
from deviceplugin.agent.usage import PodResourcesClient
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.health.monitor import HealthSettings
from deviceplugin.kube.annotation import pod_digest
from deviceplugin.kube.client import NodeClient
from deviceplugin.kube.labels import NodePublisher, node_labels
from deviceplugin.model.node import HealthEvent
from deviceplugin.plugin.manager import PluginManager
from deviceplugin.runtime.daemon import PluginDaemon, build_daemon
from deviceplugin.runtime.options import DaemonOptions
from deviceplugin.sim.kubelet import Container, KubeletSimulator, Pod, TokenBucket
from tests.support.clock import ManualClock
from tests.support.resources import resources_of

from .conftest import EXAMPLES, FAST, cgroup, free_port, get, node, registered, wait_until

SHARE = "example.com/gpu-share"
GPU = "example.com/gpu"
T4 = node("2xT4")
U0, U1 = T4.gpus[0].uuid, T4.gpus[1].uuid
MIB = 1024 * 1024


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted label items): value} from a scrape, parsed by prometheus_client."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(scrape: dict, name: str, **labels) -> float:
    wanted = set(labels.items())
    found = [v for (n, items), v in scrape.items() if n == name and wanted <= set(items)]
    assert len(found) == 1, f"{name} {labels}: {len(found)} samples"
    return found[0]


# --- the usage map --------------------------------------------------------------------------------


def _agent(kubelet, manager, inventory, **kw) -> NodeAgent:
    return NodeAgent(
        inventory,
        inventory.discover(),
        manager.state,
        lambda: manager.resources,
        PodResourcesClient(kubelet.pod_resources_socket),
        AgentSettings(interval=0.05, backoff_max=0.4),
        **kw,
    )


def test_usage_follows_pods_and_survives_a_plugin_restart(kubelet, plugin_dir):
    inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml")
    resources = resources_of({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 4}]}, T4)
    manager = PluginManager(resources, plugin_dir, FAST)
    manager.start()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    agent = _agent(kubelet, manager, inventory)
    a = Pod("a", [Container("c", {SHARE: 3})])
    b = Pod("b", [Container("c", {SHARE: 1})])
    kubelet.admit(a)
    kubelet.admit(b)
    usage = agent.sync().observation.usage
    assert sorted((s.pod, s.gpu_uuid, s.shares) for s in usage.shares) == [("a", U0, 3), ("b", U0, 1)]
    assert {s.memory_limit_mib for s in usage.shares} == {15360 * 3 // 4, 15360 // 4}
    kubelet.delete_pod(a.uid)
    assert [(s.pod, s.shares) for s in agent.sync().observation.usage.shares] == [("b", 1)]
    # The plugin restarts: a new manager and agent rebuild the same map from pod-resources, nothing doubled.
    manager.stop()
    agent.observer.client.close()
    manager = PluginManager(resources, plugin_dir, FAST)
    manager.start()
    try:
        assert kubelet.wait_for(registered(SHARE), timeout=5)
        kubelet.admit(Pod("c", [Container("c", {SHARE: 2})]))
        again = _agent(kubelet, manager, inventory).sync().observation.usage
        assert sorted((s.pod, s.shares) for s in again.shares) == [("b", 1), ("c", 2)]
        assert len(again.allocated()) == 3
    finally:
        manager.stop()


def test_agent_backs_off_on_rate_limit(plugin_dir, start_plugin):
    kubelet = KubeletSimulator(plugin_dir, rate_limit=TokenBucket(rate=0.001, burst=1))
    kubelet.start()
    try:
        manager = start_plugin()
        assert kubelet.wait_for(registered(SHARE), timeout=5)
        agent = _agent(kubelet, manager, SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml"))
        first = agent.sync()
        assert first.observation.last_sync is not None and agent.delay == 0.05
        second = agent.sync()
        assert (
            agent.rate_limited == 1
            and agent.delay == 0.1
            and second.observation.last_sync == first.observation.last_sync
        )
        agent.sync()
        agent.sync()
        agent.sync()
        assert agent.delay == 0.4  # capped at backoff_max
    finally:
        kubelet.stop()


# --- the whole node agent: metrics, watchdog, residue guard, labels ------------------------------------------


@pytest.fixture
def daemon(kubelet, plugin_dir, tmp_path, fake_kube):
    """A PluginDaemon on the 2xT4 node: GPU 0 time-sliced in 4, GPU 1 whole; fake API; real metrics port."""
    api, kubeconfig = fake_kube
    config_file = tmp_path / "config.yaml"

    def make(policy: str = "report", quarantine: bool = False, **extra) -> PluginDaemon:
        config_file.write_text(
            json.dumps(
                {
                    "version": "v1",
                    "memoryWatchdog": {"policy": policy, "quarantine": quarantine},
                    "pools": [
                        {"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [0]}},
                        {"name": "w", "mode": "exclusive"},
                    ],
                    **extra,
                }
            )
        )
        inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml", proc_root=tmp_path / "proc")
        options = DaemonOptions(
            config_file=str(config_file),
            plugin_dir=plugin_dir,
            pod_resources_socket=kubelet.pod_resources_socket,
            metrics_port=free_port(),
            metrics_host="127.0.0.1",
            proc_root=str(tmp_path / "proc"),
            reload_interval=60,
            label_interval=0.0,
            timings=FAST,
            health=HealthSettings(check_interval=0.05),
            agent=AgentSettings(interval=3600),  # the test drives agent.sync()
        )
        made = build_daemon(
            inventory,
            options,
            NodeClient.connect(api.node_name, str(kubeconfig)),
            pod_directory=kubelet.pod_directory(),
        )
        made.api = api
        return made

    made: list[PluginDaemon] = []
    yield lambda **kw: made.append(make(**kw)) or made[-1]
    for d in made:
        d.stop()


def serving(daemon, kubelet, **kw) -> PluginDaemon:
    """A daemon (see the fixture) whose servers are registered with the kubelet; agent rounds are the test's."""
    d = daemon(**kw)
    d.manager.start()
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    return d


def test_every_metric_exists_from_the_start_with_the_node_label(daemon):
    d = daemon()
    d.metrics_server.start()
    status, text = get(
        f"http://127.0.0.1:{d.options.metrics_port}/metrics"
    )  # before any sync, Allocate or registration
    assert status == 200
    m = samples(text)
    assert all(dict(items).get("node") == "2xT4" for _, items in m)  # every series names the node
    assert value(m, "gpushare_pod_resources_last_sync_timestamp_seconds") == 0
    assert value(m, "gpushare_nvml_up") == 1
    assert value(m, "gpushare_build_info", version=__version__) == 1
    for resource in (SHARE, GPU):
        assert value(m, "gpushare_allocate_duration_seconds_count", resource=resource) == 0
        assert value(m, "gpushare_allocate_duration_seconds_bucket", resource=resource, le="+Inf") == 0
        assert value(m, "gpushare_allocate_requests_total", resource=resource, result="refused") == 0
        assert value(m, "gpushare_registrations_total", resource=resource) == 0
        assert value(m, "gpushare_resource_registered", resource=resource) == 0
    assert (
        value(m, "gpushare_gpu_residue_memory_bytes", gpu="0") == 0
        and value(m, "gpushare_gpu_quarantined", gpu="1") == 0
    )
    assert (
        value(m, "gpushare_gpu_healthy", gpu="0") == 1 and value(m, "gpushare_cdi_devices_missing", resource=SHARE) == 0
    )
    for counter in (
        "gpushare_pod_resources_rate_limited_total",
        "gpushare_memory_violations_total",
        "gpushare_memory_kills_total",
        "gpushare_kubelet_restarts_total",
        "gpushare_events_dropped_total",
    ):
        assert value(m, counter) == 0


def test_metrics_healthz_readyz_and_per_container_use(daemon, kubelet):
    d = daemon()
    base = f"http://127.0.0.1:{d.options.metrics_port}"
    d.metrics_server.start()
    assert get(base + "/readyz") == (503, f"not registered: {SHARE}, {GPU}\n")
    d.manager.start()
    assert kubelet.wait_for(registered(SHARE, GPU), timeout=5)
    assert get(base + "/healthz") == (200, "ok\n") and get(base + "/readyz") == (200, "ready\n")
    small = Pod("small", [Container("app", {SHARE: 1})], namespace="ml")
    big = Pod("big", [Container("app", {SHARE: 2})], namespace="ml")
    whole = Pod("whole", [Container("train", {GPU: 1})])
    for pod in (small, big, whole):
        kubelet.admit(pod)
    inv = d.inventory
    inv.add_process(101, U0, 3000, cgroup=cgroup(small, "app"))  # limit 3840: within
    inv.add_process(102, U0, 6000, cgroup=cgroup(big, "app"))  # limit 7680: within
    inv.add_process(103, U0, 2500, cgroup=cgroup(big, "app"))  # together 8500: over
    inv.add_process(104, U1, 12000, cgroup=cgroup(whole, "train"))
    inv.set_utilization(U0, 55)
    d.agent.sync()
    status, text = get(base + "/metrics")
    assert status == 200
    m = samples(text)
    assert value(m, "gpushare_container_shares", pod="small", namespace="ml", container="app") == 1
    assert value(m, "gpushare_container_memory_limit_bytes", pod="big") == 7680 * MIB
    assert value(m, "gpushare_container_memory_used_bytes", pod="big") == 8500 * MIB
    assert value(m, "gpushare_container_over_limit", pod="big") == 1
    assert value(m, "gpushare_container_over_limit", pod="small") == 0
    assert value(m, "gpushare_container_memory_used_bytes", pod="whole", resource=GPU) == 12000 * MIB
    assert value(m, "gpushare_container_over_limit", pod="whole") == 0  # exclusive: not time-sliced
    assert value(m, "gpushare_shares", resource=SHARE, gpu="0") == 4
    assert value(m, "gpushare_shares_allocated", resource=SHARE, gpu="0") == 3
    assert value(m, "gpushare_gpu_memory_used_bytes", gpu="0") == 11500 * MIB
    assert value(m, "gpushare_gpu_memory_total_bytes", gpu="1") == 15360 * MIB
    assert value(m, "gpushare_gpu_utilization_ratio", gpu="0") == 0.55
    assert value(m, "gpushare_gpu_healthy", gpu="1") == 1
    assert value(m, "gpushare_allocate_requests_total", resource=SHARE, result="ok") == 2
    assert value(m, "gpushare_allocate_duration_seconds_count", resource=GPU) == 1
    assert value(m, "gpushare_registrations_total", resource=SHARE) >= 1
    assert value(m, "gpushare_resource_registered", resource=GPU) == 1
    assert value(m, "gpushare_memory_violations_total") == 1
    assert abs(value(m, "gpushare_pod_resources_last_sync_timestamp_seconds") - time.time()) < 60
    assert value(m, "gpushare_kubelet_restarts_total") == 0
    # The over-limit container got a Warning Event; reporting does not repeat it.
    d.agent.sync()
    d.events.deliver()  # the watchdog queued its Events; the outbox's thread (not started here) would post them
    events = [e for e in d.api.events if e["reason"] == "GPUMemoryOverLimit"]
    assert len(events) == 1 and events[0]["involvedObject"]["name"] == "big"
    assert (
        "uses 8500 MiB of GPU memory" in events[0]["message"]
        and "over the 7680 MiB of its 2 share(s)" in events[0]["message"]
    )
    # After a kubelet restart the count shows it.
    kubelet.restart()
    assert kubelet.wait_for(registered(SHARE, GPU), timeout=2)
    assert value(samples(get(base + "/metrics")[1]), "gpushare_kubelet_restarts_total") == 1
    assert get(base + "/nope")[0] == 404


def test_watchdog_kill_policy_kills_a_real_process(daemon, kubelet):
    d = serving(daemon, kubelet, policy="kill")
    pod = Pod("greedy", [Container("app", {SHARE: 1})])
    kubelet.admit(pod)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        d.inventory.add_process(child.pid, U0, 5000, cgroup=cgroup(pod, "app"))
        d.agent.sync()
        assert child.wait(timeout=10) == -9
    finally:
        child.kill()
    d.events.deliver()
    events = [e for e in d.api.events if e["reason"] == "GPUMemoryOverLimitKilled"]
    assert len(events) == 1 and f"killed process(es) {child.pid}" in events[0]["message"]
    assert d.agent.watchdog.kills == 1


def test_residue_guard_quarantines_free_devices_until_released(daemon, kubelet):
    d = serving(daemon, kubelet, quarantine=True)
    holder = Pod("holder", [Container("app", {SHARE: 1})])
    gone = Pod("gone", [Container("app", {SHARE: 1})])
    kubelet.admit(holder)
    kubelet.admit(gone)
    d.inventory.add_process(201, U0, 1000, cgroup=cgroup(holder, "app"))
    d.inventory.add_process(202, U0, 2000, cgroup=cgroup(gone, "app"))
    assert d.agent.sync().observation.residue_mib == {}
    kubelet.delete_pod(gone.uid)  # the pod is gone, its process's memory is not
    first = d.agent.sync()
    assert (
        first.observation.residue_mib == {U0: 2000} and first.quarantined_gpus == frozenset()
    )  # reported, not yet confirmed
    snapshot = d.agent.sync()
    assert snapshot.observation.residue_mib == {U0: 2000} and snapshot.quarantined_gpus == {U0}
    assert snapshot.quarantined_devices == {f"{U0}::{k}" for k in range(4)} - set(
        kubelet.allocated(holder)["app"][SHARE]
    )
    # The three free shares of GPU 0 are Unhealthy; the one held by `holder` stays Healthy.
    assert kubelet.wait_for(lambda st: st[SHARE].allocatable == 1, timeout=2)
    assert kubelet.allocated(holder)["app"][SHARE] == kubelet.resources()[SHARE].healthy
    d.inventory.remove_process(202)
    assert d.agent.sync().quarantined_gpus == frozenset()
    assert kubelet.wait_for(lambda st: st[SHARE].allocatable == 4, timeout=2)


def test_a_gpu_whose_processes_cannot_be_read_keeps_its_residue_and_quarantine(daemon, kubelet, monkeypatch):
    """Unknown is not empty: while NVML cannot read a GPU's processes, what was known of its residue stays."""
    d = serving(daemon, kubelet, quarantine=True)
    gone = Pod("gone", [Container("app", {SHARE: 1})])
    kubelet.admit(gone)
    d.inventory.add_process(202, U0, 2000, cgroup=cgroup(gone, "app"))
    d.agent.sync()
    kubelet.delete_pod(gone.uid)
    d.agent.sync()
    assert d.agent.sync().quarantined_gpus == {U0}
    listed = d.inventory.processes
    monkeypatch.setattr(d.inventory, "processes", lambda uuid: None if uuid == U0 else listed(uuid))
    snapshot = d.agent.sync()
    assert snapshot.observation.residue_mib == {U0: 2000} and snapshot.quarantined_gpus == {U0}
    monkeypatch.setattr(d.inventory, "processes", listed)
    d.inventory.remove_process(202)
    assert d.agent.sync().quarantined_gpus == frozenset()


def test_a_gpu_whose_processes_cannot_be_read_keeps_its_containers_memory(daemon, kubelet, monkeypatch):
    """Unknown is not 0 MiB: a round that cannot read a GPU's processes keeps its containers' memory, so the watchdog
    neither ends an over-limit episode nor reports it again once the processes are read."""
    d = serving(daemon, kubelet)
    pod = Pod("greedy", [Container("app", {SHARE: 1})])
    kubelet.admit(pod)
    d.inventory.add_process(401, U0, 5000, cgroup=cgroup(pod, "app"))
    d.agent.sync()
    listed = d.inventory.processes
    monkeypatch.setattr(d.inventory, "processes", lambda uuid: None if uuid == U0 else listed(uuid))
    snapshot = d.agent.sync()
    assert [(c.share.pod, c.used_mib) for c in snapshot.observation.containers] == [("greedy", 5000)]
    monkeypatch.setattr(d.inventory, "processes", listed)
    d.agent.sync()
    d.events.deliver()
    assert d.agent.watchdog.violations == 1
    assert [e["reason"] for e in d.api.events] == ["GPUMemoryOverLimit"]


def test_node_labels_and_inventory_annotation(daemon, kubelet):
    d = daemon()
    d.manager.start()
    assert kubelet.wait_for(registered(SHARE, GPU), timeout=5)
    kubelet.admit(Pod("p", [Container("c", {SHARE: 3})]))
    d.monitor.handle(HealthEvent(gpu_uuid=U1, reason="XID 79", xid=79))
    d.agent.sync()
    d.publisher.publish_now()  # the publisher runs on its own thread; the test drives it
    labels = d.api.labels
    assert labels["example.com/gpu.product"] == "Tesla-T4" and labels["example.com/gpu.count"] == "2"
    assert labels["example.com/gpu.memory"] == "15360" and labels["example.com/gpu.present"] == "true"
    assert (
        labels["example.com/cuda.driver-version.major"] == "550"
        and labels["example.com/cuda.driver-version.minor"] == "54"
    )
    assert (
        labels["example.com/cuda.driver-version.revision"] == "15"
        and labels["example.com/cuda.driver-version.full"] == "550.54.15"
    )
    assert (
        labels["example.com/cuda.runtime-version.major"] == "12"
        and labels["example.com/cuda.runtime-version.full"] == "12.4"
    )
    assert not any(".driver." in k or ".runtime." in k for k in labels)  # GFD's deprecated names: only as an option
    assert labels["example.com/gpu.family"] == "turing" and labels["example.com/gpu.compute.major"] == "7"
    assert labels["example.com/gpu.compute.minor"] == "5"
    assert labels["example.com/gpu.sharing-strategy"] == "time-slicing" and labels["example.com/gpu.replicas"] == "4"
    assert (
        labels["example.com/gpu-share.s.sharing-strategy"] == "time-slicing"
        and labels["example.com/gpu-share.s.replicas"] == "4"
    )
    assert (
        labels["example.com/gpu-share.w.sharing-strategy"] == "none" and labels["example.com/gpu-share.w.gpus"] == "1"
    )
    assert labels["example.com/mig.capable"] == "false" and labels["example.com/mig.strategy"] == "none"
    assert json.loads(d.api.annotations["example.com/gpu-share.labels"]) == sorted(labels)
    annotation = json.loads(d.api.annotations["example.com/gpu-share.inventory"])
    assert annotation["version"] == 2 and annotation["pods"] == [pod_digest("default", "p")]
    gpus = {g["uuid"]: g for g in annotation["gpus"]}
    assert gpus[U0] == {"uuid": U0, "index": 0, "model": "Tesla T4", "memoryMiB": 15360, "health": "Healthy"}
    assert gpus[U1]["health"] == "Unhealthy"
    shared = annotation["resources"][SHARE]
    assert shared["pool"] == "s" and shared["allowSpanGPUs"] is False and shared["allocationPolicy"] == "binpack"
    assert shared["units"] == [{"uuid": U0, "gpu": 0, "total": 4, "used": 3, "free": 1, "health": "Healthy"}]
    assert annotation["resources"][GPU]["units"] == [
        {"uuid": U1, "gpu": 1, "total": 1, "used": 0, "free": 0, "health": "Unhealthy"}
    ]
    d.metrics_server.start()
    scrape = samples(get(f"http://127.0.0.1:{d.options.metrics_port}/metrics")[1])
    assert (
        value(scrape, "gpushare_gpu_reset_required", gpu="1") == 1
        and value(scrape, "gpushare_gpu_reset_required", gpu="0") == 0
    )
    patches, generation = len(d.api.patches), annotation["generation"]
    d.agent.sync()
    assert not d.publisher.publish_now()
    assert len(d.api.patches) == patches  # nothing changed: no patch
    kubelet.admit(Pod("q", [Container("c", {SHARE: 1})]))
    d.agent.sync()
    assert d.publisher.publish_now()
    assert len(d.api.patches) == patches + 1
    assert json.loads(d.api.annotations["example.com/gpu-share.inventory"])["generation"] == generation + 1
    assert "labels" not in d.api.patches[-1]["metadata"]  # only the annotation changed


def test_api_errors_do_not_stop_the_agent(daemon, kubelet):
    d = serving(daemon, kubelet)
    d.api.fail_with = 403
    assert (
        d.agent.sync().observation.last_sync is not None and not d.publisher.publish_now()
    )  # labels fail, the round goes on


def test_unreadable_pod_directory_never_quarantines(daemon, kubelet):
    d = serving(daemon, kubelet, quarantine=True)
    pod = Pod("busy", [Container("app", {SHARE: 1})])
    kubelet.admit(pod)
    d.inventory.add_process(301, U0, 1000, cgroup=cgroup(pod, "app"))

    def broken():
        raise RuntimeError("API unreachable")

    d.agent.observer.mapper.directory.pods = broken
    for _ in range(3):
        snapshot = d.agent.sync()
    assert snapshot.quarantined_gpus == frozenset() and snapshot.observation.residue_mib == {}


def test_watchdog_acts_once_per_process_while_nvml_still_lists_it(daemon, kubelet):
    d = serving(daemon, kubelet, policy="kill")
    pod = Pod("greedy", [Container("app", {SHARE: 1})])
    kubelet.admit(pod)
    killed = []
    d.agent.watchdog.kill = killed.append  # the process "dies" but NVML keeps listing it for a while
    d.inventory.add_process(401, U0, 5000, cgroup=cgroup(pod, "app"))
    for _ in range(3):
        d.agent.sync()
    assert killed == [401] and d.agent.watchdog.kills == 1
    d.events.deliver()
    assert [e["reason"] for e in d.api.events] == ["GPUMemoryOverLimitKilled"]
    # A second process of the same container over the limit: acted on once too.
    d.inventory.add_process(402, U0, 100, cgroup=cgroup(pod, "app"))
    d.agent.sync()
    d.agent.sync()
    d.events.deliver()
    assert killed == [401, 402] and len(d.api.events) == 2 and "killed process(es) 402" in d.api.events[-1]["message"]


def test_watchdog_reports_a_failed_kill_with_the_reason(daemon, kubelet):
    d = serving(daemon, kubelet, policy="kill")
    pod = Pod("greedy", [Container("app", {SHARE: 1})])
    kubelet.admit(pod)

    def refuse(pid: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    d.agent.watchdog.kill = refuse
    d.inventory.add_process(501, U0, 5000, cgroup=cgroup(pod, "app"))
    d.agent.sync()
    d.agent.sync()
    d.events.deliver()
    (event,) = d.api.events
    assert event["reason"] == "GPUMemoryOverLimitKillFailed" and "killed" not in event["message"].replace(
        "could not kill", ""
    )
    assert (
        "could not kill 501 (Operation not permitted: the plugin needs hostPID and root to kill tenants)"
        in event["message"]
    )
    assert d.agent.watchdog.kills == 0 and d.agent.watchdog.kill_failures == 1
    d.inventory.remove_process(501)
    d.agent.sync()  # the PID is gone from NVML: forgotten
    d.inventory.add_process(501, U0, 5000, cgroup=cgroup(pod, "app"))  # reused PID, a new offender
    d.agent.sync()
    d.events.deliver()
    assert len(d.api.events) == 2


# --- the residue guard judges on evidence only -----------------------------------------------------


def _quarantine_rounds(d, rounds: int = 3):
    for _ in range(rounds):
        snapshot = d.agent.sync()
    return snapshot


def test_processes_without_a_readable_cgroup_never_quarantine(daemon, kubelet):
    """A tenant's /proc/<pid>/cgroup the plugin cannot read (the host's /proc not at --proc-root): unknown, reported,
    not residue."""
    d = serving(daemon, kubelet, quarantine=True)
    pod = Pod("tenant", [Container("app", {SHARE: 3})])
    kubelet.admit(pod)
    d.inventory.add_process(601, U0, 1024)  # no /proc/601/cgroup visible
    snapshot = _quarantine_rounds(d)
    assert snapshot.quarantined_gpus == frozenset() and snapshot.observation.residue_mib == {}
    assert snapshot.observation.unattributed_mib == {U0: 1024}
    assert kubelet.wait_for(lambda st: st[SHARE].allocatable == 4, timeout=2)
    base = f"http://127.0.0.1:{d.options.metrics_port}"
    d.metrics_server.start()
    assert value(samples(get(base + "/metrics")[1]), "gpushare_gpu_unattributed_memory_bytes", gpu="0") == 1024 * MIB


def test_a_host_process_never_quarantines(daemon, kubelet):
    d = serving(daemon, kubelet, quarantine=True)
    d.inventory.add_process(602, U0, 512, cgroup="0::/system.slice/dcgm-exporter.service\n")
    snapshot = _quarantine_rounds(d)
    assert snapshot.quarantined_gpus == frozenset() and snapshot.observation.unattributed_mib == {U0: 512}


def test_a_failed_pod_resources_list_never_quarantines_pods_started_since(daemon, kubelet):
    d = serving(daemon, kubelet, quarantine=True)
    d.agent.sync()
    kubelet.rate_limit = TokenBucket(rate=0.0001, burst=0)  # every List refused from now on
    late = Pod("late", [Container("app", {SHARE: 1})])
    kubelet.admit(late)
    d.inventory.add_process(603, U0, 2048, cgroup=cgroup(late, "app"))
    snapshot = _quarantine_rounds(d)
    assert snapshot.quarantined_gpus == frozenset() and snapshot.observation.residue_mib == {}


def test_a_finished_pod_still_in_the_api_is_residue(daemon, kubelet):
    """Evidence: the cgroup names a pod the API reports finished and pod-resources no longer lists."""
    d = serving(daemon, kubelet, quarantine=True)
    done = Pod("done", [Container("app", {SHARE: 1})])
    kubelet.admit(done)
    d.inventory.add_process(604, U0, 700, cgroup=cgroup(done, "app"))
    assert d.agent.sync().observation.residue_mib == {}
    kubelet.finish_pod(done.uid)
    snapshot = _quarantine_rounds(d, 2)
    assert (
        snapshot.observation.residue_mib == {U0: 700}
        and snapshot.quarantined_gpus == {U0}
        and snapshot.observation.unattributed_mib == {}
    )


def test_missing_device_spec_nodes_warn_at_start_and_make_the_gpu_unhealthy(daemon, kubelet, tmp_path, caplog):
    root = tmp_path / "host"
    (root / "dev").mkdir(parents=True)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0"):  # no /dev/nvidia1
        (root / "dev" / name).touch()
    d = daemon(deviceSpecs=True, deviceRoot=str(root))
    d.start()
    assert any("device nodes not found" in r.message and f"{root}/dev/nvidia1" in r.message for r in caplog.records)
    assert kubelet.wait_for(lambda st: GPU in st and st[GPU].registered and list(st[GPU].unhealthy) == [U1], timeout=5)
    assert kubelet.wait_for(registered(SHARE), timeout=2)  # GPU 0 has its nodes
    assert "device node(s) missing" in d.state.snapshot().reasons[U1]


# --- metering ---------------------------------------------------------------------------------------


def increase(series: list[float]) -> float:
    """Prometheus' increase() over raw samples, without extrapolation: a drop is a counter reset."""
    return sum(b - a if b >= a else b for a, b in zip(series, series[1:], strict=False))


def test_metering_counts_share_and_memory_seconds_and_survives_a_restart(kubelet, plugin_dir, tmp_path):
    from deviceplugin.agent.metering import Meter
    from deviceplugin.agent.procmap import ProcessMapper

    inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml", proc_root=tmp_path / "proc")
    config = {
        "version": "v1",
        "pools": [
            {"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [0]}},
            {"name": "w", "mode": "exclusive"},
        ],
    }
    resources = resources_of(config, T4)
    clock = ManualClock()

    def start_agent(manager):
        mapper = ProcessMapper(kubelet.pod_directory(), tmp_path / "proc")
        return _agent(kubelet, manager, inventory, mapper=mapper, meter=Meter(clock=clock, max_gap=60))

    manager = PluginManager(resources, plugin_dir, FAST)
    manager.start()
    assert kubelet.wait_for(registered(SHARE, GPU), timeout=5)
    team = Pod("train", [Container("a", {SHARE: 2}), Container("b", {SHARE: 1})], namespace="team-a")
    whole = Pod("big", [Container("main", {GPU: 1})], namespace="team-b")
    kubelet.admit(team)
    kubelet.admit(whole)
    inventory.add_process(701, U0, 1000, cgroup=cgroup(team, "a"))
    agent = start_agent(manager)
    samples_before = []
    for _ in range(3):  # t = 0, 10, 20
        agent.sync()
        samples_before.append(agent.meter.totals()[("team-a", "train", SHARE)].share_seconds)
        clock.now += 10
    totals = agent.meter.totals()
    assert samples_before == [0, 30, 60]  # 3 shares x 10 s per round, nothing before the first round
    assert totals[("team-a", "train", SHARE)].gpu_seconds == pytest.approx(0.75 * 20)
    assert totals[("team-a", "train", SHARE)].memory_byte_seconds == 1000 * MIB * 20
    assert totals[("team-b", "big", GPU)].share_seconds == 20 and totals[("team-b", "big", GPU)].gpu_seconds == 20
    # A failed List is not metered on stale usage; the next fresh round covers the gap (within max_gap).
    limit, kubelet.rate_limit = kubelet.rate_limit, TokenBucket(rate=0.0001, burst=0)
    agent.sync()
    kubelet.rate_limit = limit
    clock.now += 10
    agent.sync()  # t = 40
    assert agent.meter.totals()[("team-a", "train", SHARE)].share_seconds == 3 * 40
    samples_before.append(120)
    # The plugin restarts at t = 40 and is back at t = 50: the counters start again from 0, rebuilt from pod-resources.
    manager.stop()
    agent.observer.client.close()
    clock.now += 10
    manager = PluginManager(resources, plugin_dir, FAST)
    manager.start()
    try:
        assert kubelet.wait_for(registered(SHARE, GPU), timeout=5)
        agent = start_agent(manager)
        samples_after = []
        for _ in range(3):  # t = 50, 60, 70
            agent.sync()
            samples_after.append(agent.meter.totals()[("team-a", "train", SHARE)].share_seconds)
            clock.now += 10
        assert samples_after == [0, 30, 60]  # no jump: nothing from before the restart is counted again
        # increase() over the whole series: 40 s before + 20 s after; the 10 s the plugin was down are not counted.
        assert increase(samples_before + samples_after) == 3 * 60
    finally:
        manager.stop()


# --- publishing runs on its own thread ------------------------------------------------------------------


def killing_agent(kubelet, start_plugin, tmp_path, interval: float, killed: list[int], events=None):
    """A registered plugin and a NodeAgent beside it whose watchdog kills (into `killed`) every `interval` seconds."""
    from deviceplugin.agent.procmap import ProcessMapper
    from deviceplugin.agent.watchdog import MemoryWatchdog

    manager = start_plugin(
        {
            "version": "v1",
            "pools": [
                {"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [0]}},
                {"name": "w", "mode": "exclusive"},
            ],
        }
    )
    assert kubelet.wait_for(registered(SHARE), timeout=5)
    inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml", proc_root=tmp_path / "proc")
    agent = NodeAgent(
        inventory,
        inventory.discover(),
        manager.state,
        lambda: manager.resources,
        PodResourcesClient(kubelet.pod_resources_socket),
        AgentSettings(interval=interval),
        mapper=ProcessMapper(kubelet.pod_directory(), tmp_path / "proc"),
        watchdog=MemoryWatchdog("kill", events=events, kill=killed.append),
    )
    return manager, inventory, agent


def test_a_hanging_api_call_never_delays_the_watchdog(kubelet, start_plugin, fake_kube, tmp_path):
    """The publisher waits seconds on every API request; meanwhile the agent's watchdog acts within an interval or
    two."""
    from deviceplugin.agent.publish import PublishLoop

    api, kubeconfig = fake_kube
    killed: list[int] = []
    interval = 0.1
    manager, inventory, agent = killing_agent(kubelet, start_plugin, tmp_path, interval, killed)
    client = NodeClient.connect(api.node_name, str(kubeconfig))
    publisher = PublishLoop(
        NodePublisher(client, "example.com", min_interval=0),
        manager.state,
        agent.observer.node,
        lambda: manager.resources,
        interval,
    )
    api.delay = 2.0
    publisher.start()
    agent.start()
    try:
        assert wait_until(lambda: api.in_flight == 1, timeout=2)  # the publisher is stuck in its first API call
        pod = Pod("greedy", [Container("app", {SHARE: 1})])
        kubelet.admit(pod)
        started = time.monotonic()
        inventory.add_process(801, U0, 5000, cgroup=cgroup(pod, "app"))  # over its 3840 MiB
        assert wait_until(lambda: killed == [801], timeout=1.5)
        took = time.monotonic() - started
        assert took < 3 * interval + 0.3, took  # an interval or two (and slack for a busy machine), not the API's 2 s
        assert api.in_flight == 1 and not api.patches  # the publisher is still waiting
        api.delay = 0.0
        assert wait_until(
            lambda: "example.com/gpu.count" in api.labels, timeout=8
        )  # and publishes once the API answers
    finally:
        api.delay = 0.0
        agent.stop()
        publisher.stop()


def test_a_hanging_api_call_never_delays_the_next_kill_and_the_events_follow(
    kubelet, start_plugin, fake_kube, tmp_path
):
    """Every API request hangs 2 s: the watchdog's kills in two consecutive rounds each come within an interval or two
    (the Events wait in the outbox), and both Events reach the API once it answers."""
    from deviceplugin.kube.events import EventOutbox

    api, kubeconfig = fake_kube
    killed: list[int] = []
    interval = 0.1
    outbox = EventOutbox(NodeClient.connect(api.node_name, str(kubeconfig)))
    _, inventory, agent = killing_agent(kubelet, start_plugin, tmp_path, interval, killed, events=outbox.post)
    api.delay = 2.0
    outbox.start()
    agent.start()
    try:
        for pid, name in ((801, "greedy"), (802, "greedier")):
            pod = Pod(name, [Container("app", {SHARE: 1})])
            kubelet.admit(pod)
            started = time.monotonic()
            inventory.add_process(pid, U0, 5000, cgroup=cgroup(pod, "app"))  # over its 3840 MiB
            assert wait_until(lambda pid=pid: pid in killed, timeout=1.5)
            took = time.monotonic() - started
            assert took < 3 * interval + 0.3, (
                pid,
                took,
            )  # an interval or two (and slack for a busy machine), not the API's 2 s
            assert wait_until(lambda: api.in_flight == 1, timeout=1)  # the outbox is stuck posting the first Event
        assert killed == [801, 802] and not api.events and outbox.dropped == 0
        api.delay = 0.0
        assert wait_until(lambda: len(api.events) == 2, timeout=8)  # both arrive once the API answers, oldest first
        assert [e["involvedObject"]["name"] for e in api.events] == ["greedy", "greedier"]
        assert all(e["reason"] == "GPUMemoryOverLimitKilled" for e in api.events) and outbox.queued == 0
    finally:
        api.delay = 0.0
        agent.stop()
        outbox.stop()


def test_a_full_event_outbox_drops_the_oldest_and_counts_it(daemon, fake_kube):
    from deviceplugin.kube.events import CAPACITY, EventOutbox

    api, kubeconfig = fake_kube
    outbox = EventOutbox(NodeClient.connect(api.node_name, str(kubeconfig)), capacity=2)
    for pod in ("a", "b", "c"):
        outbox.post("ml", pod, "GPUMemoryOverLimit", f"{pod} is over")
    assert outbox.dropped == 1 and outbox.queued == 2
    outbox.deliver()
    assert [e["involvedObject"]["name"] for e in api.events] == ["b", "c"] and outbox.queued == 0
    # The daemon's outbox holds CAPACITY Events; one more drops the oldest, and the metric counts it.
    d = daemon()
    d.metrics_server.start()
    for i in range(CAPACITY + 1):
        d.events.post("ml", f"p{i}", "GPUMemoryOverLimit", "over")
    assert d.events.queued == CAPACITY
    m = samples(get(f"http://127.0.0.1:{d.options.metrics_port}/metrics")[1])
    assert value(m, "gpushare_events_dropped_total") == 1


def test_a_failing_publish_round_is_logged_and_the_loop_goes_on(daemon, kubelet, caplog):
    d = serving(daemon, kubelet)
    d.agent.sync()
    calls = []

    def resources():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("resources unavailable")
        return d.manager.resources

    d.publisher.resources = resources
    d.publisher.interval = 0.05
    d.publisher.start()
    assert wait_until(lambda: "example.com/gpu.count" in d.api.labels, timeout=5)
    assert d.publisher.running
    failed = [r for r in caplog.records if "node-publisher: round failed" in r.getMessage()]
    assert len(failed) == 1 and "resources unavailable" in str(failed[0].exc_info[1])


def test_the_publisher_patches_at_once_on_a_health_change_and_makes_no_round_for_an_xid_count_or_same_usage(
    daemon, kubelet
):
    d = serving(daemon, kubelet)
    d.publisher.interval = 3600  # only a change of what it publishes wakes it
    rounds = []
    d.publisher.resources = lambda: rounds.append(1) or d.manager.resources  # counts the publisher's rounds
    d.agent.sync()
    d.publisher.start()
    assert wait_until(lambda: "example.com/gpu-share.inventory" in d.api.annotations)

    def gpu1_health() -> str:
        return {
            g["uuid"]: g["health"] for g in json.loads(d.api.annotations["example.com/gpu-share.inventory"])["gpus"]
        }[U1]

    assert gpu1_health() == "Healthy"
    d.monitor.handle(HealthEvent(gpu_uuid=U1, reason="XID 79", xid=79))
    assert wait_until(lambda: gpu1_health() == "Unhealthy", timeout=2)
    time.sleep(0.1)  # the sleep is the test's baseline: the round that patched has ended, and no other follows
    before = len(rounds)
    d.monitor.handle(HealthEvent(gpu_uuid=U1, reason="XID 79", xid=79))  # the count grows, the set does not
    d.agent.sync()  # a new observation with the same usage
    assert d.state.snapshot().xid_counts[U1] == 2
    time.sleep(0.3)  # the sleep is the test: no round within it
    assert len(rounds) == before  # nothing it publishes changed: no round


# --- a config reload reaches every consumer ----------------------------------------------------------------


def rewrite(d: PluginDaemon, **changes) -> None:
    """Change the running daemon's config file and let its reloader apply it (a change applies once it has settled)."""
    path = d.options.config_file
    with open(path) as f:
        content = json.load(f)
    with open(path, "w") as f:
        json.dump({**content, **changes}, f)
    assert not d.reloader.check()  # seen, not yet settled
    assert d.reloader.check() and d.reloader.in_sync


def test_a_domain_change_removes_the_old_labels_and_publishes_the_new_ones(daemon, kubelet):
    d = serving(daemon, kubelet)
    d.api.labels["team"] = "ml"
    d.start()  # the agent's first round wakes the publisher: labels under example.com
    assert wait_until(lambda: "example.com/gpu.count" in d.api.labels)
    old = {k for k in d.api.labels if k.startswith("example.com/")}
    assert {"example.com/gpu.count", "example.com/gpu-share.s.replicas"} <= old
    assert {"example.com/gpu-share.inventory", "example.com/gpu-share.labels"} <= set(d.api.annotations)

    rewrite(d, domain="acme.io", sharedProductSuffix=True)  # the reload wakes the publisher
    assert kubelet.wait_for(registered("acme.io/gpu-share", "acme.io/gpu"), timeout=5)  # the manager follows too
    assert wait_until(lambda: "acme.io/gpu-share.labels" in d.api.annotations)
    assert not [k for k in {**d.api.labels, **d.api.annotations} if k.startswith("example.com/")]  # nothing left behind
    expected = node_labels("acme.io", d.node, d.manager.resources, shared_product_suffix=True)
    assert expected["acme.io/gpu.product"] == "Tesla-T4-SHARED"  # sharedProductSuffix followed the reload too
    assert {k: v for k, v in d.api.labels.items() if k != "team"} == expected and d.api.labels["team"] == "ml"
    assert json.loads(d.api.annotations["acme.io/gpu-share.labels"]) == sorted(expected)
    inventory = json.loads(d.api.annotations["acme.io/gpu-share.inventory"])
    assert set(inventory["resources"]) == {"acme.io/gpu-share", "acme.io/gpu"}
    patches = len(d.api.patches)
    assert not d.publisher.publish_now() and len(d.api.patches) == patches  # settled: nothing more to patch


def test_a_reload_reaches_the_watchdog_quarantine_metrics_and_cdi_check(daemon, kubelet):
    d = serving(daemon, kubelet)
    assert d.agent.watchdog.policy == "report" and not d.agent.quarantine and d.cdi.missing == {}
    pools = [
        {"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [0]}},
        {"name": "t", "mode": "shared", "replicas": 2, "resource": "gpu-share-t", "gpus": {"indexes": [1]}},
    ]
    rewrite(d, memoryWatchdog={"policy": "kill", "quarantine": True}, pools=pools, deviceListStrategy="cdi")
    assert d.agent.watchdog.policy == "kill" and d.agent.quarantine
    assert (
        set(d.cdi.missing) == {SHARE, "example.com/gpu-share-t"} and len(d.cdi.missing["example.com/gpu-share-t"]) == 1
    )  # no spec dir
    d.metrics_server.start()
    m = samples(get(f"http://127.0.0.1:{d.options.metrics_port}/metrics")[1])
    assert (
        value(m, "gpushare_allocate_requests_total", resource="example.com/gpu-share-t", result="ok") == 0
    )  # declared at 0
    assert value(m, "gpushare_cdi_devices_missing", resource="example.com/gpu-share-t") == 1


def test_device_specs_turned_on_by_a_reload_make_a_gpu_without_nodes_unhealthy(daemon, kubelet, tmp_path):
    root = tmp_path / "host"
    (root / "dev").mkdir(parents=True)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0"):  # no /dev/nvidia1
        (root / "dev" / name).touch()
    d = daemon()
    d.start()
    assert kubelet.wait_for(lambda st: GPU in st and st[GPU].registered and st[GPU].allocatable == 1, timeout=5)
    rewrite(d, deviceSpecs=True, deviceRoot=str(root))  # the health check follows the new deviceSpecs and deviceRoot
    assert kubelet.wait_for(lambda st: GPU in st and st[GPU].registered and list(st[GPU].unhealthy) == [U1], timeout=5)


def test_a_three_share_container_is_one_series_of_three_shares_and_the_watchdog_leaves_it_alone(daemon, kubelet):
    """Kubelet v1.36 lists one ContainerDevices entry per device ID, each with its NUMA node: over the real socket the
    agent makes them one holding of 3 shares with a 3-share memory limit (10 shares of a 15360 MiB T4: 4608 MiB)."""
    d = serving(daemon, kubelet, policy="kill", pools=[{"name": "s", "mode": "shared", "replicas": 10}])
    killed: list[int] = []
    d.agent.watchdog.kill = killed.append
    pod = Pod("trainer", [Container("app", {SHARE: 3})])
    kubelet.admit(pod)
    client = PodResourcesClient(kubelet.pod_resources_socket)
    entries = client.list().pod_resources[0].containers[0].devices
    client.close()
    assert [(len(e.device_ids), [n.ID for n in e.topology.nodes]) for e in entries] == [
        (1, [0])
    ] * 3  # as the kubelet lists it
    unit = kubelet.allocated(pod)["app"][SHARE][0].split("::")[0]
    d.inventory.add_process(501, unit, 3000, cgroup=cgroup(pod, "app"))
    d.agent.sync()
    d.metrics_server.start()
    text = get(f"http://127.0.0.1:{d.options.metrics_port}/metrics")[1]
    series = [
        (s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(text) for s in f.samples
    ]
    assert len(series) == len(set(series))  # no label set twice in the exposition
    m = samples(text)
    held = [items for name, items in m if name == "gpushare_container_shares" and ("pod", "trainer") in items]
    assert len(held) == 1 and m[("gpushare_container_shares", held[0])] == 3
    assert value(m, "gpushare_container_memory_limit_bytes", pod="trainer") == 4608 * MIB
    assert value(m, "gpushare_container_over_limit", pod="trainer") == 0
    assert killed == [] and d.agent.watchdog.violations == 0  # 3000 of its 4608 MiB: left alone
    d.inventory.add_process(502, unit, 2000, cgroup=cgroup(pod, "app"))  # together 5000 MiB: over
    d.agent.sync()
    assert sorted(killed) == [501, 502] and d.agent.watchdog.violations == 1

"""Every sharing mode and allocation policy through the built-in kubelet; CDI, device specs, MPS, profiles, reload."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from deviceplugin.config.parse import parse_config
from deviceplugin.config.types import ConfigError
from deviceplugin.mps.control import MpsDaemon, MpsLiveness, control
from deviceplugin.mps.paths import MpsPaths
from deviceplugin.mps.supervisor import MpsSupervisor
from deviceplugin.plugin.manager import PluginManager
from deviceplugin.sim.kubelet import AdmissionError, Container, Pod
from tests.support.resources import resources_of

from .conftest import EXAMPLES, FAST, GPU_CLI, ROOT, node, registered, wait_until

H100 = node("8xH100-80GB")
A100 = node("8xA100-80GB-mig")
T4 = node("2xT4")


def config(*pools, **top):
    return parse_config({"version": "v1", "pools": list(pools), **top})


def admit(kubelet, resource: str, count: int, name: str = "p"):
    results = kubelet.admit(Pod(name, [Container("c", {resource: count})]))
    return results["c"][resource]


# --- one test per mode -----------------------------------------------------------------------------


def test_exclusive_mode_multi_gpu_request_prefers_nvlink_then_numa(kubelet, start_plugin, tmp_path):
    # GPUs 0-3 and 4-7 are NVSwitch-connected; give a node whose only NVLinks join 1-2 and 5-6-7.
    node_file = tmp_path / "node.yaml"
    gpus = "\n".join(
        f"  - {{index: {i}, uuid: GPU-{i:04d}, model: A10, memoryMiB: 24576, numaNode: {i // 4}}}" for i in range(8)
    )
    node_file.write_text(
        f"gpus:\n{gpus}\nlinks:\n  - {{gpus: [1, 2], nvlinks: 4}}\n  - {{gpus: [5, 6], nvlinks: 4}}\n"
        "  - {gpus: [6, 7], nvlinks: 4}\n  - {gpus: [5, 7], nvlinks: 4}\n"
    )
    from deviceplugin.discovery.simulated import SimulatedInventory

    resources = resources_of(
        config({"name": "whole", "mode": "exclusive"}), SimulatedInventory.from_file(node_file).discover()
    )
    manager = PluginManager(resources, kubelet.plugin_dir, FAST)
    manager.start()
    try:
        assert kubelet.wait_for(registered("example.com/gpu"), timeout=5)
        three = admit(kubelet, "example.com/gpu", 3, "three").envs["NVIDIA_VISIBLE_DEVICES"]
        assert three == "GPU-0005,GPU-0006,GPU-0007"  # a fully NVLinked triple
        two = admit(kubelet, "example.com/gpu", 2, "two").envs["NVIDIA_VISIBLE_DEVICES"]
        assert two == "GPU-0001,GPU-0002"  # the remaining NVLinked pair
        pair = admit(kubelet, "example.com/gpu", 2, "numa").envs["NVIDIA_VISIBLE_DEVICES"]
        assert pair == "GPU-0000,GPU-0003"  # no NVLink left: one NUMA node
    finally:
        manager.stop()


def test_mig_mode_mixed_strategy_through_the_kubelet(kubelet, start_plugin):
    start_plugin(
        {"version": "v1", "pools": [{"name": "mig", "mode": "mig", "gpus": {"indexes": [0, 1]}}]},
        node_name="8xA100-80GB-mig",
    )
    assert kubelet.wait_for(
        registered("example.com/mig-1g.10gb", "example.com/mig-3g.40gb", "example.com/mig-2g.20gb"), timeout=5
    )
    assert kubelet.resources()["example.com/mig-1g.10gb"].capacity == 9
    envs = admit(kubelet, "example.com/mig-3g.40gb", 1).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == envs["CUDA_VISIBLE_DEVICES"] == A100.gpus[1].mig_devices[0].uuid


def test_mig_single_strategy_uniform_node_and_refusal():
    uniform = config({"name": "mig", "mode": "mig", "strategy": "single", "gpus": {"indexes": [2]}})
    resources = resources_of(uniform, A100)
    assert [r.name for r in resources] == ["example.com/gpu"] and len(resources[0].devices) == 2
    mixed = config({"name": "mig", "mode": "mig", "strategy": "single", "gpus": {"indexes": [1, 2]}})
    with pytest.raises(ConfigError) as err:
        resources_of(mixed, A100)
    assert "pools[0].strategy: single needs one MIG profile on every GPU of the pool, found" in str(err.value)
    assert "3g.40gb on GPU 1, 2" in str(err.value) and "use strategy mixed" in str(err.value)


def test_shared_mode_over_mig_instances_through_the_kubelet(kubelet, start_plugin):
    start_plugin(
        {"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [2]}}]},
        node_name="8xA100-80GB-mig",
    )
    assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=5)
    envs = admit(kubelet, "example.com/gpu-share", 3).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] in {m.uuid for m in A100.gpus[2].mig_devices}
    assert envs["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(40192 * 3 // 4)


def test_memory_per_share_means_the_same_memory_on_every_model():
    mixed_node = node("2xT4")
    resources = resources_of(config({"name": "s", "mode": "shared", "memoryPerShare": "4Gi"}), H100)
    assert {u.replicas for u in resources[0].units} == {81559 // 4096}
    resources = resources_of(config({"name": "s", "mode": "shared", "memoryPerShare": "4Gi"}), mixed_node)
    assert {u.replicas for u in resources[0].units} == {3}
    with pytest.raises(
        ConfigError, match=r"pools\[0\].memoryPerShare: 20480 MiB is larger than GPU 0 \(Tesla T4, 15360 MiB\)"
    ):
        resources_of(config({"name": "s", "mode": "shared", "memoryPerShare": "20Gi"}), mixed_node)


@pytest.mark.parametrize("policy, expected_gpu", [("binpack", 0), ("spread", 1)])
def test_allocation_policy_through_the_kubelet(kubelet, start_plugin, policy, expected_gpu):
    start_plugin(
        {"version": "v1", "allocationPolicy": policy, "pools": [{"name": "s", "mode": "shared", "replicas": 4}]}
    )
    assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=5)
    first = admit(kubelet, "example.com/gpu-share", 1, "first").envs["NVIDIA_VISIBLE_DEVICES"]
    assert first == T4.gpus[0].uuid
    second = admit(kubelet, "example.com/gpu-share", 1, "second").envs["NVIDIA_VISIBLE_DEVICES"]
    assert second == T4.gpus[expected_gpu].uuid


def test_allow_span_gpus(kubelet, start_plugin):
    start_plugin({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 4, "allowSpanGPUs": True}]})
    assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=5)
    envs = admit(kubelet, "example.com/gpu-share", 6).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == f"{T4.gpus[0].uuid},{T4.gpus[1].uuid}"
    assert envs["GPU_SHARE_COUNT"] == "6" and envs["GPU_SHARE_COMPUTE_PERCENT"] == "150"


# --- device list strategies ------------------------------------------------------------------------


def test_cdi_strategy_and_device_specs(kubelet, start_plugin, tmp_path):
    caps = tmp_path / "proc/driver/nvidia/capabilities/gpu2/mig/gi1"
    (caps / "ci0").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 21\nDeviceFileMode: 292\n")
    (caps / "ci0" / "access").write_text("DeviceFileMinor: 22\n")
    start_plugin(
        {
            "version": "v1",
            "deviceListStrategy": "cdi",
            "cdiKind": "vendor.example/gpu",
            "deviceSpecs": True,
            "deviceRoot": str(tmp_path),
            "pools": [
                {"name": "mig", "mode": "mig", "gpus": {"indexes": [2]}},
                {"name": "whole", "mode": "exclusive", "gpus": {"indexes": [5]}},
            ],
        },
        node_name="8xA100-80GB-mig",
    )
    assert kubelet.wait_for(registered("example.com/gpu", "example.com/mig-3g.40gb"), timeout=5)
    whole = admit(kubelet, "example.com/gpu", 1, "whole")
    assert [d.name for d in whole.cdi_devices] == [f"vendor.example/gpu={A100.gpus[5].uuid}"]
    assert (
        "NVIDIA_VISIBLE_DEVICES" not in whole.envs and "CUDA_VISIBLE_DEVICES" not in whole.envs
    )  # the CDI devices say it
    specs = {d.container_path: (d.host_path, d.permissions) for d in whole.devices}
    assert specs["/dev/nvidia5"] == (f"{tmp_path}/dev/nvidia5", "rw")
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= specs.keys()
    mig = admit(kubelet, "example.com/mig-3g.40gb", 1, "mig")
    paths = [d.container_path for d in mig.devices]
    assert (
        "/dev/nvidia2" in paths
        and "/dev/nvidia-caps/nvidia-cap21" in paths
        and "/dev/nvidia-caps/nvidia-cap22" in paths
    )


@pytest.mark.parametrize(
    "top, message",
    [
        ({"deviceListStrategy": "both"}, "deviceListStrategy: must be one of envvar, cdi, got 'both'"),
        ({"cdiKind": "gpu"}, "cdiKind: must be <vendor>/<class> such as nvidia.com/gpu, got 'gpu'"),
        ({"deviceSpecs": "yes"}, "deviceSpecs: must be a boolean, got string 'yes'"),
        ({"deviceRoot": "host"}, "deviceRoot: must be an absolute path, got 'host'"),
        ({"mpsRoot": "run"}, "mpsRoot: must be an absolute path, got 'run'"),
        ({"domain": "Bad_Domain"}, "domain: 'Bad_Domain' is not a lowercase DNS subdomain"),
        ({"defaultProfile": "nope"}, "defaultProfile: 'nope' is not a profile (profiles: default)"),
        ({"memoryWatchdog": {"policy": "shoot"}}, "memoryWatchdog.policy: must be one of report, kill, got 'shoot'"),
        ({"memoryWatchdog": {"quarantine": "yes"}}, "memoryWatchdog.quarantine: must be a boolean, got string 'yes'"),
        ({"memoryWatchdog": {"mode": 1}}, "memoryWatchdog.mode: unknown key (known keys: policy, quarantine)"),
        ({"memoryWatchdog": []}, "memoryWatchdog: must be a mapping, got a list"),
        (
            {"profiles": {"Bad_Name": {"pools": []}}},
            "profiles.Bad_Name: profile names must be 1-40 characters of [a-z0-9-]",
        ),
        ({"profiles": {"x": {"pool": []}}}, "profiles.x.pool: unknown key; did you mean 'pools'? (known keys: pools)"),
    ],
)
def test_global_key_validation(top, message):
    with pytest.raises(ConfigError) as err:
        config({"name": "s", "mode": "shared"}, **top)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "pool, message",
    [
        ({"memoryPerShare": "4GB"}, "memoryPerShare: must be a quantity such as 4Gi or 512Mi, got '4GB'"),
        ({"memoryPerShare": "100Ki"}, "memoryPerShare: must be at least 1Mi, got '100Ki'"),
        ({"memoryPerShare": "4Gi", "replicas": 2}, "memoryPerShare: give replicas or memoryPerShare, not both"),
        ({"backend": "vgpu"}, "backend: must be one of timeSlicing, mps, got 'vgpu'"),
        ({"mpsLimits": "strict"}, "mpsLimits: only applies to backend mps"),
        ({"backend": "mps", "mpsLimits": "loose"}, "mpsLimits: must be one of strict, proportional, got 'loose'"),
        ({"backend": "mps", "allowSpanGPUs": True}, "allowSpanGPUs: cannot be used with backend mps"),
        ({"allowSpanGPUs": "no"}, "allowSpanGPUs: must be a boolean, got string 'no'"),
        ({"strategy": "single"}, "strategy: only applies to mode mig (this pool is shared)"),
    ],
)
def test_pool_key_validation(pool, message):
    with pytest.raises(ConfigError) as err:
        config({"name": "s", "mode": "shared", **pool})
    assert f"pools[0].{message}" in str(err.value)


def test_mps_pool_over_mig_gpu_is_refused():
    with pytest.raises(ConfigError, match=r"pools\[0\].backend: mps is not supported on MIG-enabled GPUs \(GPU 0\)"):
        resources_of(config({"name": "s", "mode": "shared", "backend": "mps", "gpus": {"indexes": [0]}}), A100)


# --- profiles ----------------------------------------------------------------------------------


PROFILES = {
    "version": "v1",
    "defaultProfile": "inference",
    "profiles": {
        "inference": {"pools": [{"name": "s", "mode": "shared", "replicas": 4}]},
        "training": {"pools": [{"name": "w", "mode": "exclusive"}]},
        "bad": {"pools": [{"name": "s", "mode": "shared", "replicas": 0}]},
        "worse": {"pools": [{"name": "s", "mode": "shared"}, {"name": "t", "mode": "shared", "replicas": 2}]},
    },
}


def test_profile_errors_name_the_profile():
    with pytest.raises(ConfigError) as err:
        parse_config(PROFILES)
    assert "profiles.bad.pools[0].replicas: must be >= 1, got 0" in str(err.value)
    assert (
        "profiles.worse.pools[1].gpus: only one pool may omit gpus (profiles.worse.pools[0] already takes the rest)"
        in str(err.value)
    )
    pool = {"name": "s", "mode": "shared"}
    with pytest.raises(
        ConfigError, match=r"profiles.default: profile 'default' is already defined by the top-level pools"
    ):
        parse_config({"version": "v1", "pools": [pool], "profiles": {"default": {"pools": [pool]}}})


def test_profile_selection_and_unknown_profile():
    good = {**PROFILES, "profiles": {k: v for k, v in PROFILES["profiles"].items() if k in ("inference", "training")}}
    cfg = parse_config(good)
    assert [r.name for r in resources_of(cfg, T4)] == ["example.com/gpu-share"]
    assert [r.name for r in resources_of(cfg, T4, "training")] == ["example.com/gpu"]
    with pytest.raises(ConfigError, match=r"profile 'gaming' is not in the config \(profiles: inference, training\)"):
        resources_of(cfg, T4, "gaming")


def _write(path, data) -> None:
    import yaml

    path.write_text(yaml.safe_dump(data))


def test_profile_comes_from_the_node_label_and_hot_reload(fake_kube, plugin_dir, kubelet, tmp_path):
    api, kubeconfig = fake_kube
    api.labels["example.com/gpu-share.config"] = "training"
    good = {**PROFILES, "profiles": {k: v for k, v in PROFILES["profiles"].items() if k in ("inference", "training")}}
    good["profiles"]["training"] = {
        "pools": [
            {"name": "w", "mode": "exclusive", "gpus": {"indexes": [0]}},
            {"name": "s2", "mode": "shared", "replicas": 2},
        ]
    }
    cfg_file = tmp_path / "config.yaml"
    _write(cfg_file, good)
    proc = subprocess.Popen(
        [
            *GPU_CLI,
            "run",
            "--node",
            str(EXAMPLES / "nodes" / "2xT4.yaml"),
            "--plugin-dir",
            str(plugin_dir),
            "--config",
            str(cfg_file),
            "--kubeconfig",
            str(kubeconfig),
            "--watch-interval",
            "0.05",
            "--metrics-port",
            "0",
            "--reload-interval",
            "0.1",
            "--profile-label-interval",
            "0.1",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NODE_NAME": api.node_name},
    )
    try:
        assert kubelet.wait_for(registered("example.com/gpu", "example.com/gpu-share"), timeout=15)
        assert kubelet.resources()["example.com/gpu-share"].capacity == 2
        registrations = {r.resource_name: 0 for r in kubelet.register_requests}
        for r in kubelet.register_requests:
            registrations[r.resource_name] += 1
        # A valid change to one pool: only that resource registers again.
        good["profiles"]["training"]["pools"][1]["replicas"] = 3
        _write(cfg_file, good)
        assert kubelet.wait_for(
            lambda st: st["example.com/gpu-share"].capacity == 3 and st["example.com/gpu-share"].registered, timeout=5
        )
        counts = {}
        for r in kubelet.register_requests:
            counts[r.resource_name] = counts.get(r.resource_name, 0) + 1
        assert counts["example.com/gpu"] == registrations["example.com/gpu"]
        assert counts["example.com/gpu-share"] == registrations["example.com/gpu-share"] + 1
        # An invalid change: the last good config keeps serving.
        cfg_file.write_text("version: v1\npools: [{name: x, mode: shared, replicas: -1}]\n")
        time.sleep(0.5)  # the sleep is the test: five reload intervals pass and the last good config still serves
        assert (
            kubelet.resources()["example.com/gpu-share"].capacity == 3
            and kubelet.resources()["example.com/gpu"].registered
        )
        # Switching the node label to another profile reloads.
        _write(cfg_file, good)
        api.labels["example.com/gpu-share.config"] = "inference"
        assert kubelet.wait_for(
            lambda st: st["example.com/gpu-share"].capacity == 8 and not st["example.com/gpu"].registered, timeout=5
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert "serving profile training" in err
    assert (
        "config change rejected, still serving the last good config" in err and "replicas: must be >= 1, got -1" in err
    )
    assert "config reloaded (profile inference)" in err


def test_without_api_access_the_plugin_says_so_once(plugin_dir, kubelet, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    proc = subprocess.Popen(
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
            "--reload-interval",
            "0.05",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "NODE_NAME": "n1", "HOME": str(tmp_path)},  # no ~/.kube/config
    )
    try:
        assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=15)
        time.sleep(0.3)  # the sleep is the test: six reload intervals, and it still said so only once
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert err.count("no Kubernetes API access") == 1


def test_config_check_command(tmp_path):
    ok = subprocess.run(
        [
            *GPU_CLI,
            "config",
            "check",
            str(EXAMPLES / "config" / "mixed.yaml"),
            "--node",
            str(EXAMPLES / "nodes" / "8xH100-80GB.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0, ok.stderr
    assert "example.com/gpu (exclusive): 4 devices" in ok.stdout
    assert "GPU 4 (NVIDIA H100 80GB HBM3): 8 shares of 10194 MiB" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: v1\npools:\n  - {name: a, mode: shared, replicas: 0, colour: red}\n"
        "  - {name: b, mode: mig, resource: x}\n"
    )
    out = subprocess.run([*GPU_CLI, "config", "check", str(bad)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    for line in (
        "pools[0].colour: unknown key",
        "pools[0].replicas: must be >= 1, got 0",
        "pools[1].resource: not used by mode mig",
    ):
        assert line in out.stderr


# --- MPS -----------------------------------------------------------------------------------------


@pytest.fixture
def fake_mps(tmp_path):
    """An executable nvidia-cuda-mps-control stand-in."""
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(f"#!{sys.executable}\n" + (ROOT / "tests" / "support" / "fake_mps_control.py").read_text())
    binary.chmod(0o755)
    return binary


def mps_config(root, limits: str, replicas: int = 4):
    return config(
        {
            "name": "mps",
            "mode": "shared",
            "backend": "mps",
            "mpsLimits": limits,
            "replicas": replicas,
            "gpus": {"indexes": [1]},
        },
        {"name": "ts", "mode": "shared", "resource": "ts-share", "gpus": {"indexes": [0]}},
        mpsRoot=str(root),
    )


def _log(paths: MpsPaths) -> str:
    path = paths.log / "control.log"
    return path.read_text() if path.exists() else ""


def test_mps_strict_limits_supervision_and_clean_quit(fake_mps, tmp_path, kubelet, plugin_dir):
    root = tmp_path / "mps"
    resources = resources_of(mps_config(root, "strict"), T4)
    mps_resource = next(r for r in resources if r.pool.mps)
    daemon = MpsDaemon(mps_resource, str(root), binary=str(fake_mps), backoff_initial=0.05, backoff_max=0.2)
    manager = PluginManager(resources, plugin_dir, FAST, mps=MpsLiveness(str(fake_mps), interval=0.1, timeout=1.0))
    manager.start()
    try:
        assert kubelet.wait_for(registered("example.com/ts-share"), timeout=5)
        assert "example.com/gpu-share" not in kubelet.resources()  # not advertised before its daemon is ready
        daemon.start()
        assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=5)
        paths = daemon.paths
        log = _log(paths)
        assert f"start CUDA_VISIBLE_DEVICES={T4.gpus[1].uuid}" in log
        assert "set_default_active_thread_percentage 25" in log
        assert f"set_default_device_pinned_mem_limit 0 {15360 // 4}M" in log
        response = admit(kubelet, "example.com/gpu-share", 1, "one")
        assert response.envs["CUDA_MPS_PIPE_DIRECTORY"] == str(paths.pipe)
        mounts = {m.container_path: (m.host_path, m.read_only) for m in response.mounts}
        assert mounts == {str(paths.pipe): (str(paths.pipe), False), "/dev/shm": (str(paths.shm), False)}
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in response.envs
        with pytest.raises(AdmissionError, match="uses MPS with strict limits: one share per container, got 2"):
            admit(kubelet, "example.com/gpu-share", 2, "two")
        # The daemon dies: devices Unhealthy until the supervisor has it back.
        os.kill(int((paths.log / "daemon.pid").read_text()), signal.SIGKILL)
        assert kubelet.wait_for(lambda st: st["example.com/gpu-share"].allocatable == 0, timeout=3)
        assert kubelet.wait_for(lambda st: st["example.com/gpu-share"].allocatable == 4, timeout=5)
        assert daemon.restarts >= 1 and _log(paths).count("start CUDA_VISIBLE_DEVICES") == 2
    finally:
        daemon.stop()
        manager.stop()
    assert _log(daemon.paths).rstrip().endswith("quit") and not daemon.paths.ready.exists()


def test_an_mps_pool_whose_daemon_answers_is_served_by_start_itself(fake_mps, tmp_path, kubelet, plugin_dir):
    """The first check waits for the daemon's answer (both node APIs): no kubelet watch round passes first."""
    root = tmp_path / "mps"
    resources = resources_of(mps_config(root, "proportional"), T4)
    daemon = MpsDaemon(next(r for r in resources if r.pool.mps), str(root), binary=str(fake_mps))
    daemon.start()
    slow = dataclasses.replace(FAST, watch_interval=60.0)  # a second round would come only in a minute
    manager = PluginManager(resources, plugin_dir, slow, mps=MpsLiveness(str(fake_mps), interval=0.1, timeout=1.0))
    try:
        assert wait_until(daemon.paths.ready.exists, 5)
        manager.start()
        assert {s.resource.name: s.serving for s in manager.servers} == {
            "example.com/ts-share": True,
            "example.com/gpu-share": True,
        }
    finally:
        manager.stop()
        daemon.stop()


def test_mps_proportional_limits_per_container(fake_mps, tmp_path, kubelet, plugin_dir):
    root = tmp_path / "mps"
    resources = resources_of(mps_config(root, "proportional", replicas=10), T4)
    daemon = MpsDaemon(next(r for r in resources if r.pool.mps), str(root), binary=str(fake_mps))
    daemon.start()
    manager = PluginManager(resources, plugin_dir, FAST, mps=MpsLiveness(str(fake_mps), interval=0.1, timeout=1.0))
    manager.start()
    try:
        assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=5)
        assert "set_default" not in _log(daemon.paths)  # no daemon-wide cap
        envs = admit(kubelet, "example.com/gpu-share", 3).envs
        assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={15360 * 3 // 10}M"
    finally:
        manager.stop()
        daemon.stop()


def test_mps_subcommand_runs_daemons_until_sigterm(fake_mps, tmp_path):
    root = tmp_path / "mps"
    cfg = tmp_path / "mps.yaml"
    cfg.write_text(
        textwrap.dedent(f"""\
        version: v1
        mpsRoot: {root}
        pools:
          - {{name: mps, mode: shared, backend: mps, replicas: 2}}
        """)
    )
    proc = subprocess.Popen(
        [
            *GPU_CLI,
            "mps",
            "--config",
            str(cfg),
            "--node",
            str(EXAMPLES / "nodes" / "2xT4.yaml"),
            "--profile",
            "default",
            "--mps-control",
            str(fake_mps),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    paths = MpsPaths.of(str(root), "mps")
    try:
        assert wait_until(paths.ready.exists, timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert "set_default_active_thread_percentage 50" in _log(paths) and _log(paths).rstrip().endswith("quit")
    assert not paths.ready.exists()


def _pid(paths: MpsPaths) -> int:
    return int((paths.log / "daemon.pid").read_text())


def test_mps_supervisor_follows_config_reloads(fake_mps, tmp_path):
    """Added pools start a daemon, removed ones stop theirs, changed limits or mpsRoot restart it; others are
    untouched."""
    root, other_root = tmp_path / "mps", tmp_path / "mps2"
    a = {
        "name": "a",
        "mode": "shared",
        "backend": "mps",
        "mpsLimits": "strict",
        "replicas": 4,
        "gpus": {"indexes": [1]},
    }
    b = {
        "name": "b",
        "mode": "shared",
        "backend": "mps",
        "resource": "b-share",
        "replicas": 2,
        "gpus": {"indexes": [0]},
    }
    supervisor = MpsSupervisor(str(fake_mps), backoff_max=0.2, backoff_initial=0.05)

    def reload(*pools, mps_root=root):
        cfg = config(*pools, mpsRoot=str(mps_root))
        supervisor.on_config(cfg, resources_of(cfg, T4))

    pa, pb = MpsPaths.of(str(root), "a"), MpsPaths.of(str(root), "b")
    try:
        reload(a)
        assert wait_until(pa.ready.exists) and set(supervisor.daemons) == {"a"}
        first = _pid(pa)
        reload(a, b)  # added: b starts, a is left alone
        assert wait_until(pb.ready.exists) and _pid(pa) == first and "quit" not in _log(pa)
        reload({**a, "replicas": 2}, b)  # a's strict limits change: a restarts with them
        assert wait_until(lambda: pa.ready.exists() and _pid(pa) != first)
        assert _log(pa).split("quit")[1].count("set_default_active_thread_percentage 50") == 1
        b_pid = _pid(pb)
        reload({**a, "replicas": 2})  # removed: b's daemon quits and its marker goes
        assert not pb.ready.exists() and _log(pb).rstrip().endswith("quit") and not _alive(b_pid)
        reload({**a, "replicas": 2}, mps_root=other_root)  # a new mpsRoot: the daemon moves there
        moved = MpsPaths.of(str(other_root), "a")
        assert wait_until(moved.ready.exists) and not pa.ready.exists() and set(supervisor.daemons) == {"a"}
        reload({"name": "ts", "mode": "shared"})  # no MPS pool left: nothing runs
        assert supervisor.daemons == {} and not moved.ready.exists()
    finally:
        supervisor.stop()
    reload(a)  # after stop, a late reload starts nothing
    assert supervisor.daemons == {} and not pa.ready.exists()


def test_mps_subcommand_follows_the_config_file(fake_mps, tmp_path):
    root = tmp_path / "mps"
    cfg = tmp_path / "mps.yaml"

    def write(*pools: str) -> None:
        cfg.write_text(f"version: v1\nmpsRoot: {root}\npools:\n" + "".join(f"  - {p}\n" for p in pools))

    a = "{name: a, mode: shared, backend: mps, replicas: 2, gpus: {indexes: [1]}}"
    b = "{name: b, mode: shared, backend: mps, resource: b-share, replicas: 2, gpus: {indexes: [0]}}"
    write(a)
    proc = subprocess.Popen(
        [
            *GPU_CLI,
            "mps",
            "--config",
            str(cfg),
            "--node",
            str(EXAMPLES / "nodes" / "2xT4.yaml"),
            "--profile",
            "default",
            "--mps-control",
            str(fake_mps),
            "--reload-interval",
            "0.05",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    pa, pb = MpsPaths.of(str(root), "a"), MpsPaths.of(str(root), "b")
    try:
        assert wait_until(pa.ready.exists, timeout=10)
        write(a, b)
        assert wait_until(pb.ready.exists, timeout=10)
        write(b)
        assert wait_until(lambda: not pa.ready.exists(), timeout=10) and pb.ready.exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert _log(pa).rstrip().endswith("quit") and _log(pb).rstrip().endswith("quit") and not pb.ready.exists()


def test_profile_label_survives_api_errors_and_is_read_at_most_every_interval(fake_kube):
    from deviceplugin.config.types import default_config
    from deviceplugin.kube.client import NodeClient
    from deviceplugin.runtime.plan import ProfileSource

    api, kubeconfig = fake_kube
    api.labels["example.com/gpu-share.config"] = "training"
    client = NodeClient.connect(api.node_name, str(kubeconfig))
    source = ProfileSource(None, client, interval=0)
    assert source.current(default_config()) == "training"
    api.fail_with = 500
    assert source.current(default_config()) == "training"  # a blip keeps the profile
    api.fail_with = None
    slow = ProfileSource(None, client, interval=3600)
    slow.current(default_config())
    requests = api.requests
    api.labels["example.com/gpu-share.config"] = "inference"
    assert slow.current(default_config()) == "training" and api.requests == requests  # not read again yet


def _alive(pid: int) -> bool:
    """A live fake control daemon (not merely a process that reused the PID; zombies count as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return (
        "State:\tZ" not in status and b"-f" in command and any(c.endswith(b"nvidia-cuda-mps-control") for c in command)
    )


def _daemons(paths: MpsPaths) -> list[int]:
    """Every control daemon the fake ever started for this pool."""
    path = paths.log / "daemons.log"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_mps_stale_marker_of_a_killed_pod_is_unhealthy_within_one_poll(fake_mps, tmp_path, kubelet, plugin_dir, caplog):
    """SIGKILL the whole `gpu-share mps` process group (an OOM-killed pod): marker and pipe stay behind."""
    caplog.set_level(logging.INFO, logger="deviceplugin.plugin.manager")
    root = tmp_path / "mps"
    cfg = tmp_path / "mps.yaml"
    cfg.write_text(
        f"version: v1\nmpsRoot: {root}\npools:\n"
        f"  - {{name: mps, mode: shared, backend: mps, replicas: 2, gpus: {{indexes: [1]}}}}\n"
    )
    resources = resources_of(yaml.safe_load(cfg.read_text()), T4)
    manager = PluginManager(resources, plugin_dir, FAST, mps=MpsLiveness(str(fake_mps), interval=0.2, timeout=0.5))
    manager.start()
    proc = subprocess.Popen(
        [
            *GPU_CLI,
            "mps",
            "--config",
            str(cfg),
            "--node",
            str(EXAMPLES / "nodes" / "2xT4.yaml"),
            "--profile",
            "default",
            "--mps-control",
            str(fake_mps),
        ],
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    paths = MpsPaths.of(str(root), "mps")
    try:
        assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=10)
        assert any("waiting for the control daemon of MPS pool mps" in r.message for r in caplog.records)
        assert not any("down" in r.message for r in caplog.records)  # never ran: not "down"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert paths.ready.exists() and (paths.pipe / "control").exists()  # the stale marker and pipe
        killed = time.monotonic()
        assert kubelet.wait_for(lambda st: st["example.com/gpu-share"].allocatable == 0, timeout=3)
        assert time.monotonic() - killed < 2.0  # one poll (0.2 s) + one probe timeout (0.5 s) + slack for a loaded CI
        assert any("does not answer" in r.message for r in caplog.records)
        with pytest.raises(AdmissionError):
            admit(kubelet, "example.com/gpu-share", 1, "late")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        manager.stop()


def test_mps_daemon_that_stops_answering_is_unhealthy(fake_mps, tmp_path, kubelet, plugin_dir):
    root = tmp_path / "mps"
    resources = resources_of(mps_config(root, "proportional"), T4)
    daemon = MpsDaemon(next(r for r in resources if r.pool.mps), str(root), binary=str(fake_mps))
    daemon.start()
    manager = PluginManager(resources, plugin_dir, FAST, mps=MpsLiveness(str(fake_mps), interval=0.1, timeout=0.3))
    manager.start()
    try:
        assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=5)
        with pytest.raises(Exception, match="no answer"):
            control(str(fake_mps), daemon.paths, ["hang"], timeout=0.3)  # PID alive, pipe unanswered
        assert kubelet.wait_for(lambda st: st["example.com/gpu-share"].allocatable == 0, timeout=3)
    finally:
        manager.stop()
        daemon.stop(timeout=0.5)


@pytest.mark.parametrize("hook", ["FAKE_MPS_FAIL", "FAKE_MPS_SLOW"])
def test_mps_failed_setup_kills_its_daemon_and_backs_off(fake_mps, tmp_path, monkeypatch, hook):
    """Setting the limits fails (or times out): the daemon started for it is killed, never two run."""
    monkeypatch.setenv(hook, "set_default_active_thread_percentage")
    root = tmp_path / "mps"
    resources = resources_of(mps_config(root, "strict"), T4)
    daemon = MpsDaemon(
        next(r for r in resources if r.pool.mps),
        str(root),
        binary=str(fake_mps),
        start_timeout=0.3,
        backoff_initial=0.05,
        backoff_max=0.2,
    )
    daemon.start()
    try:

        def three_failed_setups() -> bool:
            assert sum(map(_alive, _daemons(daemon.paths))) <= 1  # never two at once, checked while waiting
            return daemon.restarts >= 3

        wait_until(three_failed_setups, timeout=10)
        assert daemon.restarts >= 3 and not daemon.paths.ready.exists()
        assert len(_daemons(daemon.paths)) <= daemon.restarts + 1  # one daemon per attempt, attempts backed off
    finally:
        daemon.stop(timeout=0.5)
    assert not any(map(_alive, _daemons(daemon.paths)))


def test_mps_supervisor_removes_the_marker_while_its_daemon_does_not_answer(fake_mps, tmp_path):
    root = tmp_path / "mps"
    resources = resources_of(mps_config(root, "proportional"), T4)
    daemon = MpsDaemon(next(r for r in resources if r.pool.mps), str(root), binary=str(fake_mps), probe_interval=0.1)
    daemon.start()
    try:
        assert wait_until(daemon.paths.ready.exists)
        with pytest.raises(Exception, match="no answer"):
            control(str(fake_mps), daemon.paths, ["hang"], timeout=0.2)  # PID alive, pipe unanswered
        assert wait_until(lambda: not daemon.paths.ready.exists(), timeout=3)
        assert daemon.restarts == 0  # alive: not restarted behind its clients' backs
    finally:
        daemon.stop(timeout=0.5)


def test_a_second_supervisor_of_the_same_pool_starts_no_second_daemon(fake_mps, tmp_path):
    root = tmp_path / "mps"
    resources = resources_of(mps_config(root, "proportional"), T4)
    pool = next(r for r in resources if r.pool.mps)
    first = MpsDaemon(pool, str(root), binary=str(fake_mps), start_timeout=0.5, backoff_initial=0.05, backoff_max=0.2)
    second = MpsDaemon(pool, str(root), binary=str(fake_mps), start_timeout=0.5, backoff_initial=0.05, backoff_max=0.2)
    first.start()
    try:
        assert wait_until(first.paths.ready.exists)
        second.start()
        wait_until(lambda: second.restarts >= 1, timeout=5)
        assert second.restarts >= 1  # it tried, found a daemon answering, and backs off
        assert len(_daemons(first.paths)) == 1 and first.paths.ready.exists()  # the first one's marker untouched
        assert _alive(_daemons(first.paths)[0])
    finally:
        second.stop(timeout=0.5)
        assert first.paths.ready.exists()
        first.stop(timeout=0.5)
    assert not first.paths.ready.exists() and not any(map(_alive, _daemons(first.paths)))

"""The previews an operator runs before a rollout: what a container of each resource receives (`config check
--node`), with the limits MPS enforces."""

from __future__ import annotations

import pytest

from deviceplugin.cli.config_check import check_config

from .conftest import EXAMPLES, ROOT

T4 = EXAMPLES / "nodes" / "2xT4.yaml"
UUID = "GPU-8a2f4c1d-3b5e-4f60-a7c8-000000000000"


def preview(tmp_path, config: str, node=T4) -> list[str]:
    path = tmp_path / "config.yaml"
    path.write_text(config)
    lines: list[str] = []
    assert check_config(str(path), str(node), None, False, out=lines.append) == 0
    return [line.strip() for line in lines if line.startswith(("    a container", "      env"))]


@pytest.mark.parametrize(
    "limits, receives, env",
    [
        (
            "proportional",
            "enforced by MPS from the container's CUDA_MPS_* limits (k shares: k times both)",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3840M "
            "CUDA_MPS_PIPE_DIRECTORY=/run/gpu-share/mps/m/pipe ",
        ),
        (
            "strict",
            "enforced by the MPS daemon for every client (its defaults: active threads 25 %, "
            "pinned memory 3840 MiB per GPU); one share per container",
            "CUDA_MPS_PIPE_DIRECTORY=/run/gpu-share/mps/m/pipe ",
        ),
    ],
)
def test_config_check_shows_what_an_mps_container_receives(tmp_path, limits, receives, env):
    lines = preview(
        tmp_path, f"version: v1\npools: [{{name: m, mode: shared, backend: mps, mpsLimits: {limits}, replicas: 4}}]\n"
    )
    assert lines == [
        f"a container of 1 share of GPU 0 (Tesla T4) receives: memory 3840 MiB, compute 25 %; {receives}",
        f"env {env}CUDA_VISIBLE_DEVICES={UUID} GPU_SHARE_COMPUTE_PERCENT=25 GPU_SHARE_COUNT=1 "
        f"GPU_SHARE_MEMORY_LIMIT_MIB=3840 GPU_SHARE_TOTAL=4 NVIDIA_VISIBLE_DEVICES={UUID}",
    ]


def test_config_check_says_time_sliced_compute_is_not_enforced(tmp_path):
    lines = preview(
        tmp_path, "version: v1\nmemoryWatchdog: {policy: kill}\npools: [{name: s, mode: shared, replicas: 10}]\n"
    )
    assert lines[0] == (
        "a container of 1 share of GPU 0 (Tesla T4) receives: memory 1536 MiB, compute 10 %; not enforced: compute is "
        "time-sliced (turns, not a cap); memory is not capped by the GPU, the memory watchdog kills a container over it"
    )


def test_config_check_shows_whole_gpus_and_mig_instances(tmp_path):
    lines = preview(tmp_path, "version: v1\npools: [{name: w, mode: exclusive}]\n")
    assert lines == [
        "a container of GPU 0 (Tesla T4) receives: memory 15360 MiB, compute 100 %; the whole GPU, no neighbours",
        f"env CUDA_VISIBLE_DEVICES={UUID} NVIDIA_VISIBLE_DEVICES={UUID}",
    ]
    lines = preview(tmp_path, "version: v1\npools: [{name: m, mode: mig}]\n", EXAMPLES / "nodes" / "2xH100-mig-1g.yaml")
    assert (
        lines[0] == "a container of MIG 1g.10gb of GPU 0 receives: memory 9856 MiB, compute 100 %; isolated by the "
        "hardware (MIG)"
    )


def test_shipped_config_previews_every_profile(tmp_path):
    text = (ROOT / "daemonset" / "config" / "config.yaml").read_text()
    path = tmp_path / "config.yaml"
    path.write_text(text)
    lines: list[str] = []
    check_config(str(path), str(T4), None, True, out=lines.append)
    assert (
        sum(line.startswith("    a container of ") for line in lines) == 4
    )  # exclusive, inference, mps, mig (T4s shared in 8)


def test_config_check_previews_the_node_labels(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "version: v1\ndomain: acme.io\ndeprecatedCudaLabels: true\npools: [{name: s, mode: shared, replicas: 4}]\n"
    )
    lines: list[str] = []
    check_config(str(path), str(T4), None, False, out=lines.append, labels=True)
    start = lines.index("  node labels the plugin would publish (26; a label someone else set first is left alone):")
    shown = dict(line.strip().split("=", 1) for line in lines[start + 1 : -1])
    assert shown["acme.io/cuda.driver-version.full"] == "550.54.15" and shown["acme.io/cuda.driver.rev"] == "15"
    assert shown["acme.io/gpu.replicas"] == "4" and shown["acme.io/gpu-share.s.sharing-strategy"] == "time-slicing"
    assert all(key.startswith("acme.io/") for key in shown)


def test_discover_shows_which_pool_each_gpu_lands_in():
    import subprocess

    from .conftest import GPU_CLI

    proc = subprocess.run(
        [
            *GPU_CLI,
            "discover",
            "--node",
            str(EXAMPLES / "nodes" / "8xA100-80GB-mig.yaml"),
            "--config",
            str(ROOT / "daemonset" / "config" / "config.yaml"),
            "--profile",
            "mig",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    pools = proc.stdout.split("Pools (profile mig of ")[1].splitlines()
    assert (
        "  GPU 4 MIG 7g.80gb (MIG-0400a0c4-7f3b-5e91-b2d8-6c4f10040000): pool mig (mig) -> example.com/mig-7g.80gb"
        in pools
    )
    assert "  GPU 5: not advertised (in no pool, or skipped: see the warnings)" in pools
    assert any(line.startswith("  warning: GPU 5 ") and "does not have MIG enabled" in line for line in pools)
    proc = subprocess.run([*GPU_CLI, "discover", "--node", str(T4)], capture_output=True, text=True, timeout=30)
    assert proc.stdout.endswith(
        "Pools (profile default of the default config: every GPU shared in 10):\n"
        "  GPU 0: pool default (shared, 10 shares) -> example.com/gpu-share\n"
        "  GPU 1: pool default (shared, 10 shares) -> example.com/gpu-share\n"
    ), proc.stdout

"""`gpu-share config check` as a subprocess: every problem at once, per-profile results on a node, discover round
trip."""

from __future__ import annotations

import json
import subprocess

import pytest

from .conftest import EXAMPLES, GPU_CLI

A100_MIG = str(EXAMPLES / "nodes" / "8xA100-80GB-mig.yaml")
T4 = str(EXAMPLES / "nodes" / "2xT4.yaml")
H100 = str(EXAMPLES / "nodes" / "8xH100-80GB.yaml")


def gpu_share(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*GPU_CLI, *args], capture_output=True, text=True, timeout=30)


def check(*args: str) -> subprocess.CompletedProcess:
    return gpu_share("config", "check", *args)


def test_every_problem_at_once_with_unknown_top_level_keys_duplicates_and_hints(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: v1\n"
        "domian: example.org\n"
        "allocationPolicy: binpack\n"
        "allocationPolicy: spread\n"
        "pools:\n"
        "  - {name: a, mode: shared, replica: 2}\n"
        "  - {name: b, mode: Shared}\n"
    )
    proc = check(str(bad))
    assert proc.returncode == 2
    assert "valid" not in proc.stdout
    expected = [
        f"gpu-share: error: {bad}: ",
        "line 4, column 1: duplicate key 'allocationPolicy' (first at line 3); YAML would keep only the last",
        "domian: unknown key; did you mean 'domain'?",
        "pools[0].replica: unknown key; did you mean 'replicas'?",
        "pools[1].mode: must be one of exclusive, shared, mig, got 'Shared'",
    ]
    for line in expected:
        assert line in proc.stderr, proc.stderr


def test_unknown_key_in_other_case_is_suggested(tmp_path):
    bad = tmp_path / "case.yaml"
    bad.write_text("version: v1\npools:\n  - {name: a, mode: shared, memorypershare: 4Gi}\n")
    assert "pools[0].memorypershare: unknown key; did you mean 'memoryPerShare'?" in check(str(bad)).stderr


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "syntax.yaml"
    bad.write_text("version: v1\npools:\n  - name: a\n   mode: shared\n")
    proc = check(str(bad))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"gpu-share: error: {bad}: line 4, column 4: not valid YAML: "), proc.stderr
    assert "<unicode string>" not in proc.stderr


def test_valid_is_printed_only_after_the_node_check_passed():
    proc = check(str(EXAMPLES / "config" / "mixed.yaml"), "--node", T4)
    assert proc.returncode == 2
    assert "valid" not in proc.stdout
    assert "pools[0].gpus.indexes: no GPU with index 2 on this node (indexes 0, 1)" in proc.stderr


def test_node_check_uses_the_default_profile_as_run_would():
    proc = check(str(EXAMPLES / "config" / "profiles.yaml"), "--node", H100)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "Profile exclusive (defaultProfile) on 8xH100-80GB:"
    assert "Profile inference" not in proc.stdout
    assert (
        proc.stdout.splitlines()[-1]
        == f"{EXAMPLES / 'config' / 'profiles.yaml'}: valid on 8xH100-80GB (profile exclusive)"
    )


def test_profile_flag_checks_that_profile():
    proc = check(str(EXAMPLES / "config" / "profiles.yaml"), "--node", A100_MIG, "--profile", "mig")
    assert proc.returncode == 0, proc.stderr
    assert "example.com/mig-3g.40gb (mig): 3 devices" in proc.stdout
    assert (
        "  warning: GPU 5 (GPU-5d2e8b41-a1f0-4c3e-8d7a-000000000005) does not have MIG enabled: pool mig (mig) "
        "does not advertise it" in proc.stdout
    )
    assert (
        "  warning: pool shares has no usable GPU on this node; example.com/gpu-share is not advertised" in proc.stdout
    )
    missing = check(str(EXAMPLES / "config" / "profiles.yaml"), "--profile", "nope")
    assert missing.returncode == 2
    assert "profile 'nope' is not in the config (profiles: exclusive, inference, mig, mps)" in missing.stderr


def test_all_profiles_reports_each_profile_then_fails_when_one_does():
    proc = check(str(EXAMPLES / "config" / "profiles.yaml"), "--node", H100, "--all-profiles")
    assert proc.returncode == 2
    for header in (
        "Profile exclusive (defaultProfile) on 8xH100-80GB:",
        "Profile inference on 8xH100-80GB:",
        "Profile mps on 8xH100-80GB:",
    ):
        assert header in proc.stdout
    assert "Profile mig on 8xH100-80GB:\n  warning: GPU 0 (" in proc.stdout
    assert (
        "  FAILED: profile 'mig' advertises no resource on node 8xH100-80GB (no pool has a usable GPU there)"
        in proc.stdout
    )
    assert "profiles.yaml: 1 of 4 profiles fail on 8xH100-80GB: mig" in proc.stderr
    ok = check(str(EXAMPLES / "config" / "profiles.yaml"), "--node", T4, "--all-profiles")
    assert ok.returncode == 0, ok.stdout
    assert ok.stdout.splitlines()[-1].endswith("valid on 2xT4 (every profile)")


def test_zero_resources_on_the_node_is_an_error(tmp_path):
    config = tmp_path / "mig-only.yaml"
    config.write_text("version: v1\npools:\n  - {name: m, mode: mig}\n")
    proc = check(str(config), "--node", T4)
    assert proc.returncode == 2
    assert (
        "warning: GPU 0 (GPU-8a2f4c1d-3b5e-4f60-a7c8-000000000000) does not have MIG enabled: pool m (mig) does "
        "not advertise it" in proc.stdout
    )
    assert (
        f"{config}: profile 'default' advertises no resource on node 2xT4 (no pool has a usable GPU there)"
        in proc.stderr
    )


def test_discover_json_is_a_node_file_round_trip(tmp_path):
    first = gpu_share("discover", "--node", A100_MIG, "--json")
    assert first.returncode == 0, first.stderr
    capture = tmp_path / "capture.json"
    capture.write_text(first.stdout)
    again = gpu_share("discover", "--node", str(capture), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == json.loads(first.stdout)
    direct = check(str(EXAMPLES / "config" / "mig-mixed.yaml"), "--node", A100_MIG)
    captured = check(str(EXAMPLES / "config" / "mig-mixed.yaml"), "--node", str(capture))
    assert captured.returncode == 0, captured.stderr
    assert captured.stdout.splitlines()[1:-1] == direct.stdout.splitlines()[1:-1]


def test_discover_json_keeps_an_unhealthy_gpu_unhealthy(tmp_path):
    report = json.loads(gpu_share("discover", "--node", T4, "--json").stdout)
    report["gpus"][1]["health"] = "query on GPU 1 failed: GPU is lost"
    capture = tmp_path / "capture.json"
    capture.write_text(json.dumps(report))
    table = gpu_share("discover", "--node", str(capture))
    assert table.returncode == 0, table.stderr
    gpu1 = next(line for line in table.stdout.splitlines() if line.startswith("1 "))
    assert gpu1.endswith("query on GPU 1 failed: GPU is lost")


def test_node_file_with_a_duplicate_key_names_the_line(tmp_path):
    node = tmp_path / "node.yaml"
    node.write_text("name: n\ngpus:\n  - {index: 0, uuid: GPU-a, model: T4, memoryMiB: 15360, memoryMiB: 16000}\n")
    proc = gpu_share("discover", "--node", str(node))
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        == f"gpu-share: error: node file {node}: line 3, column 58: duplicate key 'memoryMiB' (first at line 3); "
        "YAML would keep only the last"
    )


@pytest.mark.parametrize(
    "pools, warning",
    [
        (
            [{"name": "mig", "mode": "mig", "gpus": {"models": ["*A100*"]}}, {"name": "s", "mode": "shared"}],
            "pool mig has no usable GPU on this node (no GPU matches its gpus); it advertises nothing",
        ),
        (
            [{"name": "s", "mode": "shared", "replicas": 1024}],
            "pool s: a share of GPU 0 (Tesla T4) is 15 MiB (1024 shares), less than a CUDA context needs (about "
            "256 MiB); lower replicas or use memoryPerShare",
        ),
    ],
)
def test_config_check_warns_of_pools_that_cannot_work_on_the_node(pools, warning):
    from deviceplugin.alloc.check import check_profile
    from deviceplugin.config.parse import parse_config

    from .conftest import node

    result = check_profile(parse_config({"version": "v1", "pools": pools}), node("2xT4"), "default")
    assert result.error is None and warning in result.warnings

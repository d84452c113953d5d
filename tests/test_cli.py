"""`gpu-share` as a real subprocess: run against the built-in kubelet, signals, start-up errors, demo."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from .conftest import EXAMPLES, GPU_CLI, ROOT, free_port, registered, start_run


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_registers_then_signal_removes_sockets_and_exits_0(kubelet, plugin_dir, sig):
    proc = start_run(plugin_dir, "--config", str(EXAMPLES / "config" / "exclusive.yaml"))
    try:
        assert kubelet.wait_for(registered("example.com/gpu"), timeout=15)
        assert kubelet.resources()["example.com/gpu"].capacity == 2
        assert list(plugin_dir.glob("gpu-share-*.sock"))
    finally:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert not list(plugin_dir.glob("gpu-share-*.sock"))
    assert "registered example.com/gpu with the kubelet" in err
    assert kubelet.wait_for(lambda st: st["example.com/gpu"].allocatable == 0, timeout=5)


def test_run_survives_kubelet_restart_as_a_subprocess(kubelet, plugin_dir):
    proc = start_run(plugin_dir, "--log-format", "json")
    try:
        assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=15)
        kubelet.restart()
        assert kubelet.wait_for(registered("example.com/gpu-share"), timeout=2)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert '"msg": "kubelet.sock was recreated: the kubelet restarted"' in err


@pytest.mark.parametrize(
    "config, message",
    [
        ("version: v1\npools:\n  - name: a\n    mode: shared\n    replica: 4\n", "pools[0].replica: unknown key"),
        (
            "version: v1\npools:\n  - name: a\n    mode: shared\n    resource: Bad/Name\n",
            "pools[0].resource: 'Bad/Name' is not a valid extended resource name",
        ),
        (
            "version: v1\npools:\n  - name: a\n    mode: exclusive\n    gpus: {indexes: [7]}\n",
            "pools[0].gpus.indexes: no GPU with index 7",
        ),
    ],
)
def test_bad_config_is_a_clear_startup_error(tmp_path, plugin_dir, config, message):
    path = tmp_path / "config.yaml"
    path.write_text(config)
    proc = start_run(plugin_dir, "--config", str(path))
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 2
    assert f"gpu-share: error: {path}: {message}" in err
    assert "Traceback" not in err
    assert not list(plugin_dir.glob("gpu-share-*.sock"))


def test_bad_node_file_and_bad_flag(tmp_path, plugin_dir):
    node = tmp_path / "node.yaml"
    node.write_text("gpus:\n  - {index: 0, uuid: nope, model: T4, memoryMiB: 1}\n")
    proc = subprocess.run(
        [*GPU_CLI, "run", "--node", str(node), "--plugin-dir", str(plugin_dir)],
        capture_output=True,
        text=True,
        timeout=15,
    )
    assert proc.returncode == 1 and "gpus[0].uuid: must start with 'GPU-', got 'nope'" in proc.stderr
    proc = subprocess.run([*GPU_CLI, "run", "--watch-interval", "-1"], capture_output=True, text=True, timeout=15)
    assert proc.returncode == 2 and "argument --watch-interval: must be > 0, got -1" in proc.stderr


def test_demo_prints_the_table_and_exits_0():
    proc = subprocess.run([*GPU_CLI, "demo"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "example.com/gpu          1         1" in out
    assert "example.com/gpu-share    20        20" in out
    assert "example.com/mig-3g.40gb  2         2" in out
    assert "too-big" in out and "REFUSED" in out and "span 2 GPUs" in out
    assert "OVER LIMIT (reported by the memory watchdog)" in out


def _nvml_loads() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


needs_no_driver = pytest.mark.skipif(_nvml_loads(), reason="this machine has an NVIDIA driver")


def _run_on(api: str, plugin_dir) -> list[str]:
    """`gpu-share run` for either node API, its directories under `plugin_dir`."""
    if api == "deviceplugin":
        return [*GPU_CLI, "run", "--plugin-dir", str(plugin_dir)]
    (plugin_dir / "plugins_registry").mkdir(exist_ok=True)
    return [*GPU_CLI, "run", "--api", "dra", "--kubelet-root", str(plugin_dir)]


@needs_no_driver
@pytest.mark.parametrize("api", ["deviceplugin", "dra"])
def test_run_without_driver_exits_at_once_with_a_hint(plugin_dir, api):
    proc = subprocess.run(_run_on(api, plugin_dir), capture_output=True, text=True, timeout=15)
    assert proc.returncode == 1
    assert "gpu-share: error: NVML could not be loaded: nvmlInit failed" in proc.stderr
    assert "gpu-share demo --node examples/nodes/2xT4.yaml" in proc.stderr


@needs_no_driver
@pytest.mark.parametrize("api", ["deviceplugin", "dra"])  # --fail-on-init-error applies to both node APIs
def test_run_without_driver_can_stay_alive_advertising_nothing_and_not_ready(plugin_dir, api):
    import urllib.error
    import urllib.request

    port = free_port()
    proc = subprocess.Popen(
        [*_run_on(api, plugin_dir), "--fail-on-init-error=false", "--metrics-port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NODE_NAME": "n-test"},
    )
    line = proc.stderr.readline()
    assert "NVML could not be loaded" in line and "running without devices" in line
    assert proc.poll() is None and not list(plugin_dir.glob("*.sock"))
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
        except urllib.error.HTTPError as err:
            assert err.code == 503 and "not ready: NVML could not be loaded" in err.read().decode()
            break
        except urllib.error.URLError:
            time.sleep(0.05)  # the endpoint is starting
    else:
        pytest.fail("/readyz never answered")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert 'gpushare_nvml_up{node="n-test"} 0.0' in metrics  # /metrics is not empty without a driver
    assert 'gpushare_pod_resources_last_sync_timestamp_seconds{node="n-test"} 0.0' in metrics
    assert "gpushare_build_info{" in metrics and "gpushare_kubelet_restarts_total" in metrics
    proc.terminate()
    proc.communicate(timeout=15)
    assert proc.returncode == 0


def test_bad_boolean_flag():
    proc = subprocess.run([*GPU_CLI, "run", "--fail-on-init-error=maybe"], capture_output=True, text=True, timeout=15)
    assert proc.returncode == 2 and "argument --fail-on-init-error: must be true or false, got 'maybe'" in proc.stderr
    proc = subprocess.run([*GPU_CLI, "run", "--ignore-xids", "13,x"], capture_output=True, text=True, timeout=15)
    assert proc.returncode == 2 and "must be comma-separated XID numbers, got '13,x'" in proc.stderr
    proc = subprocess.run([*GPU_CLI, "run", "--metrics-port", "99999"], capture_output=True, text=True, timeout=15)
    assert (
        proc.returncode == 2
        and "argument --metrics-port: must be a port number 0-65535 (0 disables), got '99999'" in proc.stderr
    )


def test_metrics_port_in_use_is_a_clear_error(plugin_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                *GPU_CLI,
                "run",
                "--node",
                str(EXAMPLES / "nodes" / "2xT4.yaml"),
                "--plugin-dir",
                str(plugin_dir),
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 1
    assert (
        f"gpu-share: error: cannot serve metrics on 0.0.0.0:{port}: Address already in use (choose another "
        "--metrics-port or --metrics-bind-address)" in proc.stderr
    )


def test_discover_table_and_json():
    import json

    node_file = str(EXAMPLES / "nodes" / "8xA100-80GB-mig.yaml")
    table = subprocess.run([*GPU_CLI, "discover", "--node", node_file], capture_output=True, text=True, timeout=15)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == "Node 8xA100-80GB-mig: 8 GPUs, driver 550.90.07, CUDA 12.4"
    assert any(line.startswith("2/1  MIG-") and "3g.40gb" in line for line in lines)
    assert any(line.startswith("GPU5") and "NV12" in line for line in lines)
    report = json.loads(
        subprocess.run(
            [*GPU_CLI, "discover", "--node", node_file, "--json"], capture_output=True, text=True, timeout=15
        ).stdout
    )
    assert len(report["gpus"]) == 8 and report["gpus"][0]["health"] == "Healthy"
    assert [m["profile"] for m in report["gpus"][1]["mig"]] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert {"gpus": [5, 6], "nvlinks": 12, "pcie": "numa-node"} in report["links"]


def test_every_run_flag_is_documented_and_every_documented_flag_exists(capsys):
    from deviceplugin.cli.main import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", capsys.readouterr().out)) - {"--help"}
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("`gpu-share run`:")[1].split("\n\n")[1]
    documented = set(re.findall(r"^\| `(--[a-z-]+)", table, flags=re.M))
    assert flags == documented, (sorted(flags - documented), sorted(documented - flags))


# Runs one `gpu-share` command in this interpreter, then names the heavy packages it loaded (on stderr, last line):
# grpc, protobuf (google), prometheus_client, kubernetes.
LOADED = """
import sys
from deviceplugin.cli.main import main
code = main(sys.argv[1:])
print(
    sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'google', 'prometheus_client', 'kubernetes'}),
    file=sys.stderr,
)
sys.exit(code)
"""


@pytest.mark.parametrize(
    "command",
    [
        ["config", "check", str(EXAMPLES / "config" / "profiles.yaml")],
        [
            "config",
            "check",
            str(EXAMPLES / "config" / "profiles.yaml"),
            "--node",
            str(EXAMPLES / "nodes" / "2xT4.yaml"),
            "--all-profiles",
        ],
        ["discover", "--node", str(EXAMPLES / "nodes" / "2xT4.yaml"), "--json"],
    ],
)
def test_config_check_and_discover_load_no_grpc_protobuf_prometheus_or_kubernetes(command):
    proc = subprocess.run([sys.executable, "-c", LOADED, *command], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout and proc.stderr.splitlines()[-1] == "[]"


def test_the_import_probe_sees_what_the_daemon_loads():
    probe = LOADED.replace("code = main(sys.argv[1:])", "from deviceplugin.runtime import daemon; code = 0")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stderr.splitlines()[-1] == "['google', 'grpc', 'prometheus_client']", (
        proc.stderr
    )


def test_the_documented_run_defaults_are_the_parser_defaults():
    """The table in docs/configuration.md shows the defaults the code defines (defaults.py and the settings), once."""
    from deviceplugin.cli.main import build_parser

    defaults = vars(build_parser().parse_args(["run"]))  # every flag at its default
    table = (ROOT / "docs" / "configuration.md").read_text().split("`gpu-share run`:")[1].split("\n\n")[1]
    checked = 0
    for flag, shown in re.findall(r"^\| `(--[a-z-]+)[^`]*` \| `([^`]+)` \|", table, flags=re.M):
        value = defaults[flag[2:].replace("-", "_")]
        if isinstance(value, bool):
            assert shown == str(value).lower(), flag
        elif isinstance(value, (int, float)):
            assert float(shown) == value, flag
        elif isinstance(value, frozenset):
            assert {int(x) for x in shown.split(",")} == value, flag
        elif isinstance(value, tuple):
            assert shown == ",".join(value), flag
        else:
            assert shown == value, flag
        checked += 1
    assert checked >= 20


def test_run_builds_only_its_own_arguments_and_never_loads_the_cluster_package():
    """`simulate` describes its flags with the cluster package; `run` parses without it (exec → Register is timed)."""
    probe = (
        "import sys\nfrom deviceplugin.cli.main import build_parser\n"
        "args = build_parser(only='run').parse_args(['run', '--metrics-port', '0'])\n"
        "print(args.metrics_port, sorted(m for m in sys.modules if m.startswith('deviceplugin.cluster')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.split() == ["0", "[]"], proc.stdout + proc.stderr
    full = subprocess.run(
        [sys.executable, "-c", probe.replace("only='run'", "only=None")], capture_output=True, text=True, timeout=30
    )
    assert full.returncode == 0 and "deviceplugin.cluster.report" in full.stdout, full.stdout + full.stderr


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--reload-interval", "0", "argument --reload-interval: must be > 0, got 0"),
        (
            "--profile-label-interval",
            "abc",
            "argument --profile-label-interval: must be a number of seconds, got 'abc'",
        ),
    ],
)
def test_mps_reload_flags_refuse_bad_values(flag, value, message):
    """The flags `gpu-share mps` gained to follow reloads: a wrong value is one line naming the flag, exit 2."""
    proc = subprocess.run([*GPU_CLI, "mps", flag, value], capture_output=True, text=True, timeout=15)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr

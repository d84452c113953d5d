"""Bad flags and paths at start-up: one line naming the flag, the cause and a hint; never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from deviceplugin import __version__

from .conftest import EXAMPLES, GPU_CLI

T4 = str(EXAMPLES / "nodes" / "2xT4.yaml")


def run(*args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, *GPU_CLI, *args], capture_output=True, text=True, timeout=30, env=env)


def run_plugin(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return run("run", "--node", T4, "--metrics-port", "0", *args, **kwargs)


def assert_one_line(proc: subprocess.CompletedProcess, message: str, rc: int = 2) -> None:
    assert proc.returncode == rc, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"gpu-share: error: {message}", proc.stderr


def test_plugin_dir_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    assert_one_line(
        run_plugin("--plugin-dir", str(path)),
        f"--plugin-dir {path}: is not a directory (give the kubelet's device-plugins directory)",
    )


def test_plugin_dir_under_proc():
    assert_one_line(
        run_plugin("--plugin-dir", "/proc/self"),
        "--plugin-dir /proc/self: is on a kernel pseudo-filesystem (give the kubelet's device-plugins directory, "
        "default /var/lib/kubelet/device-plugins)",
    )


def test_missing_plugin_dir_is_an_error_with_a_hint(tmp_path):
    missing = tmp_path / "device-plugins"
    proc = run_plugin("--plugin-dir", str(missing))
    assert_one_line(
        proc,
        f"--plugin-dir {missing}: does not exist (the kubelet creates it when it starts: is the kubelet running, "
        "and is the host path mounted here?)",
    )
    assert not missing.exists()


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a read-only bind mount"
)
def test_plugin_dir_on_a_read_only_mount(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip("mount namespaces are not allowed here")
    script = f'mount --bind {target} {target} && mount -o remount,ro,bind {target} && exec "$@"'
    proc = run_plugin("--plugin-dir", str(target), prefix=("unshare", "-m", "sh", "-c", script, "sh"))
    assert_one_line(
        proc,
        f"--plugin-dir {target}: is on a read-only file system (the plugin creates its sockets there: mount it "
        "read-write and run as root (see docs/security.md))",
    )


def test_missing_proc_root(tmp_path, plugin_dir):
    missing = tmp_path / "proc"
    assert_one_line(
        run_plugin("--plugin-dir", str(plugin_dir), "--proc-root", str(missing)),
        f"--proc-root {missing}: does not exist (the host's /proc, for mapping GPU processes to pods)",
    )


def test_missing_config_and_node_files(tmp_path, plugin_dir):
    missing = tmp_path / "nope.yaml"
    assert_one_line(
        run_plugin("--plugin-dir", str(plugin_dir), "--config", str(missing)),
        f"--config {missing}: No such file or directory",
    )
    assert_one_line(
        run("run", "--node", str(missing), "--plugin-dir", str(plugin_dir)),
        f"--node {missing}: No such file or directory",
    )
    assert_one_line(run("config", "check", str(tmp_path)), f"{tmp_path}: file: cannot read: is a directory")


def test_explicit_bad_kubeconfig_is_fatal(tmp_path, plugin_dir):
    missing = tmp_path / "kubeconfig"
    assert_one_line(
        run_plugin("--plugin-dir", str(plugin_dir), "--kubeconfig", str(missing)),
        f"--kubeconfig {missing}: No such file or directory",
    )
    garbage = tmp_path / "garbage"
    garbage.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    proc = run_plugin(
        "--plugin-dir", str(plugin_dir), "--kubeconfig", str(garbage), env={**os.environ, "NODE_NAME": "n1"}
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    # The kubelet link starts before the API client loads; the bad file still ends the plugin, in one line.
    assert (
        proc.stderr.strip().splitlines()[-1].startswith(f"gpu-share: error: --kubeconfig {garbage}: cannot be used: ")
    ), proc.stderr


def test_missing_mps_control_binary(tmp_path):
    missing = tmp_path / "nvidia-cuda-mps-control"
    assert_one_line(
        run("mps", "--node", T4, "--mps-control", str(missing)),
        f"--mps-control {missing}: is not an executable file (nor one on PATH) (it comes with the NVIDIA "
        "driver's user-space tools)",
    )


def test_version():
    proc = run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"gpu-share {__version__}"
    assert sys.modules["deviceplugin"].__version__ == __version__

"""MPS operations: `gpu-share mps --pools` serves the pools of one DaemonSet, and `exclusiveProcess: true` makes
setting EXCLUSIVE_PROCESS the daemon's job, restored when it quits. The control daemon is the test stand-in
(tests/support/fake_mps_control.py); the GPUs' compute modes live in a fake NVML (no GPU here)."""

from __future__ import annotations

import logging
import sys

import pynvml
import pytest

from deviceplugin.config.parse import parse_config
from deviceplugin.config.types import ConfigError
from deviceplugin.mps.computemode import ComputeModeError, ComputeModes
from deviceplugin.mps.control import MpsDaemon
from deviceplugin.mps.paths import MpsPaths
from deviceplugin.mps.supervisor import MpsSupervisor
from tests.support.resources import resources_of

from .conftest import ROOT, node, wait_until

T4 = node("2xT4")
DEFAULT, EXCLUSIVE = pynvml.NVML_COMPUTEMODE_DEFAULT, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


class ModesNvml:
    """The NVML calls ComputeModes makes, over a dict of compute modes by GPU UUID (pynvml's constants and errors)."""

    NVMLError = pynvml.NVMLError
    NVML_COMPUTEMODE_DEFAULT, NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = DEFAULT, EXCLUSIVE
    NVML_COMPUTEMODE_PROHIBITED = pynvml.NVML_COMPUTEMODE_PROHIBITED

    def __init__(self, modes: dict[str, int], refuse: str = "") -> None:
        self.modes, self.refuse, self.sessions = modes, refuse, 0

    def nvmlInit(self) -> None:
        self.sessions += 1

    def nvmlShutdown(self) -> None:
        self.sessions -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetComputeMode(self, handle: str) -> int:
        return self.modes[handle]

    def nvmlDeviceSetComputeMode(self, handle: str, mode: int) -> None:
        if handle == self.refuse:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        self.modes[handle] = mode


@pytest.fixture
def fake_mps(tmp_path):
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(f"#!{sys.executable}\n" + (ROOT / "tests" / "support" / "fake_mps_control.py").read_text())
    binary.chmod(0o755)
    return binary


def mps_resource(root, **pool):
    config = parse_config(
        {
            "version": "v1",
            "mpsRoot": str(root),
            "pools": [{"name": "m", "mode": "shared", "backend": "mps", "replicas": 4, **pool}],
        }
    )
    return next(r for r in resources_of(config, T4) if r.pool.mps)


def test_exclusive_process_is_set_while_the_daemon_serves_and_restored_on_quit(fake_mps, tmp_path):
    a, b = (g.uuid for g in T4.gpus)
    nvml = ModesNvml({a: DEFAULT, b: EXCLUSIVE})  # GPU 1 was EXCLUSIVE_PROCESS already: left so after quit too
    daemon = MpsDaemon(
        mps_resource(tmp_path / "mps", exclusiveProcess=True),
        str(tmp_path / "mps"),
        binary=str(fake_mps),
        compute_modes=ComputeModes(nvml),
    )
    daemon.start()
    try:
        assert wait_until(daemon.paths.ready.exists)
        assert nvml.modes == {a: EXCLUSIVE, b: EXCLUSIVE} and nvml.sessions == 0
    finally:
        daemon.stop()
    assert nvml.modes == {a: DEFAULT, b: EXCLUSIVE} and nvml.sessions == 0


def test_without_exclusive_process_compute_modes_are_not_touched(fake_mps, tmp_path):
    nvml = ModesNvml({g.uuid: DEFAULT for g in T4.gpus})
    daemon = MpsDaemon(
        mps_resource(tmp_path / "mps"), str(tmp_path / "mps"), binary=str(fake_mps), compute_modes=ComputeModes(nvml)
    )
    daemon.start()
    try:
        assert wait_until(daemon.paths.ready.exists)
    finally:
        daemon.stop()
    assert nvml.modes == {g.uuid: DEFAULT for g in T4.gpus} and nvml.sessions == 0


def test_a_gpu_refusing_the_mode_is_an_error_naming_it_and_the_others_are_restored():
    a, b = (g.uuid for g in T4.gpus)
    nvml = ModesNvml({a: DEFAULT, b: DEFAULT}, refuse=b)

    with pytest.raises(
        ComputeModeError,
        match=f"GPU {b}: cannot set compute mode EXCLUSIVE_PROCESS: .*Insufficient Permissions.* \\(needs root "
        "and NVML\\)",
    ):
        ComputeModes(nvml).make_exclusive([a, b])
    assert nvml.modes == {a: DEFAULT, b: DEFAULT} and nvml.sessions == 0  # GPU 0 put back at once


def test_exclusive_process_applies_only_to_mps_pools():
    with pytest.raises(ConfigError, match=r"pools\[0\].exclusiveProcess: only applies to backend mps"):
        parse_config({"version": "v1", "pools": [{"name": "s", "mode": "shared", "exclusiveProcess": True}]})


def test_supervisor_serves_only_the_pools_it_is_given(fake_mps, tmp_path, caplog):
    root = tmp_path / "mps"
    pools = [
        {"name": "a", "mode": "shared", "backend": "mps", "replicas": 4, "gpus": {"indexes": [0]}},
        {
            "name": "b",
            "mode": "shared",
            "backend": "mps",
            "resource": "b-share",
            "replicas": 2,
            "gpus": {"indexes": [1]},
        },
    ]
    config = parse_config({"version": "v1", "mpsRoot": str(root), "pools": pools})
    supervisor = MpsSupervisor(str(fake_mps), backoff_max=0.2, backoff_initial=0.05, pools=frozenset({"b"}))
    try:
        supervisor.on_config(config, resources_of(config, T4))
        assert set(supervisor.daemons) == {"b"} and wait_until(MpsPaths.of(str(root), "b").ready.exists)
        assert not MpsPaths.of(str(root), "a").ready.exists()
        only_a = parse_config({"version": "v1", "mpsRoot": str(root), "pools": pools[:1]})
        with caplog.at_level(logging.WARNING, logger="deviceplugin.mps.supervisor"):
            supervisor.on_config(only_a, resources_of(only_a, T4))
        assert supervisor.daemons == {}
        assert (
            "the config has no pool with backend mps named b on this node; nothing to run until it has one"
            in caplog.text
        )
    finally:
        supervisor.stop()

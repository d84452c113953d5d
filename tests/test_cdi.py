"""CDI mode: at start-up the plugin reads the node's CDI specs and warns (log + metric) for devices they lack."""

from __future__ import annotations

import json
import logging

from prometheus_client import generate_latest

from deviceplugin.alloc.cdi import MAX_SPEC_BYTES, check_specs, read_specs
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.obs.metrics import exposed_registry
from deviceplugin.runtime.daemon import build_daemon
from deviceplugin.runtime.options import DaemonOptions
from tests.support.resources import resources_of

from .conftest import EXAMPLES, FAST, node

T4 = EXAMPLES / "nodes" / "2xT4.yaml"
U0, U1 = "GPU-8a2f4c1d-3b5e-4f60-a7c8-000000000000", "GPU-8a2f4c1d-3b5e-4f60-a7c8-000000000001"
CDI = {"version": "v1", "deviceListStrategy": "cdi", "pools": [{"name": "s", "mode": "shared", "replicas": 2}]}


def spec(kind: str, *names: str) -> str:
    """A spec as `nvidia-ctk cdi generate --device-name-strategy=uuid` writes it (trimmed)."""
    return json.dumps(
        {
            "cdiVersion": "0.6.0",
            "kind": kind,
            "devices": [{"name": n, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}} for n in names],
        }
    )


def test_specs_from_both_directories_yaml_and_json(tmp_path):
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir()
    run.mkdir()
    (etc / "nvidia.json").write_text(spec("nvidia.com/gpu", U0))
    (run / "more.yaml").write_text(f"cdiVersion: 0.6.0\nkind: nvidia.com/gpu\ndevices:\n  - name: {U1}\n")
    (run / "broken.yaml").write_text("kind: [\n")
    (run / "notes.txt").write_text("ignored")
    names, problems = read_specs((str(etc), str(run), str(tmp_path / "missing")))
    assert names == {f"nvidia.com/gpu={U0}", f"nvidia.com/gpu={U1}"}
    assert len(problems) == 1 and problems[0].startswith(f"{run / 'broken.yaml'}: cannot be read: line 2")


def test_unreadable_spec_files_are_problems_not_crashes(tmp_path):
    (tmp_path / "gone.yaml").symlink_to(tmp_path / "nowhere")  # a dangling link, as a removed spec leaves behind
    (tmp_path / "huge.json").write_bytes(b" " * (MAX_SPEC_BYTES + 1))
    (tmp_path / "nvidia.json").write_text(spec("nvidia.com/gpu", U0))
    names, problems = read_specs((str(tmp_path),))
    assert names == {f"nvidia.com/gpu={U0}"}
    assert problems == [
        f"{tmp_path / 'gone.yaml'}: cannot be read: file: cannot read: no such file (deleted, or not mounted)",
        f"{tmp_path / 'huge.json'}: cannot be read: file: is {MAX_SPEC_BYTES + 1} bytes, over the limit "
        f"of {MAX_SPEC_BYTES} bytes",
    ]


def test_missing_devices_are_reported_per_resource(tmp_path, caplog):
    (tmp_path / "nvidia.json").write_text(spec("nvidia.com/gpu", U0))
    resources = resources_of(CDI, node("2xT4"))
    with caplog.at_level(logging.WARNING):
        missing = check_specs(resources, "nvidia.com/gpu", (str(tmp_path),))
    assert missing == {"example.com/gpu-share": [f"nvidia.com/gpu={U1}"]}
    assert (
        f"example.com/gpu-share: 1 of 2 CDI devices are in no spec under {tmp_path}: nvidia.com/gpu={U1}" in caplog.text
    )
    other_kind = check_specs(resources, "vendor.example/gpu", (str(tmp_path),))
    assert len(other_kind["example.com/gpu-share"]) == 2  # the kind must match cdiKind too


def test_daemon_in_cdi_mode_warns_and_exports_the_count(tmp_path, plugin_dir, caplog):
    (tmp_path / "config.yaml").write_text(json.dumps(CDI))
    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / "nvidia.yaml").write_text(spec("nvidia.com/gpu", U0))
    options = DaemonOptions(
        config_file=str(tmp_path / "config.yaml"),
        plugin_dir=plugin_dir,
        metrics_port=0,
        timings=FAST,
        cdi_spec_dirs=(str(tmp_path / "cdi"),),
    )
    with caplog.at_level(logging.WARNING):
        daemon = build_daemon(SimulatedInventory.from_file(T4), options)
    assert "1 of 2 CDI devices are in no spec" in caplog.text
    text = generate_latest(exposed_registry(daemon.registry, "n1")).decode()
    assert 'gpushare_cdi_devices_missing{node="n1",resource="example.com/gpu-share"} 1.0' in text
    daemon.inventory.close()


def test_envvar_mode_reads_no_specs(tmp_path, plugin_dir, caplog):
    options = DaemonOptions(
        plugin_dir=plugin_dir, metrics_port=0, timings=FAST, cdi_spec_dirs=(str(tmp_path / "none"),)
    )
    with caplog.at_level(logging.WARNING):
        daemon = build_daemon(SimulatedInventory.from_file(T4), options)
    assert daemon.cdi.missing == {} and "CDI" not in caplog.text

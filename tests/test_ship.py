"""What ships: the Dockerfile lints clean, every manifest is schema-valid, the dashboard queries exported metrics,
and every config example in the docs and the ConfigMap passes validation."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deviceplugin.config import parse_config_text

from .conftest import ROOT

VERSIONS = ("1.37.0", "1.36.0")  # the newest two minor versions kubernetes-validate ships
MANIFESTS = sorted(p for p in (ROOT / "daemonset").rglob("*.yaml"))


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    proc = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_manifest_is_schema_valid(path, version):
    for document in _documents(path):
        if document["apiVersion"].startswith("monitoring.coreos.com/"):
            # A Prometheus Operator CRD: not in the Kubernetes schemas; check its shape.
            assert document["kind"] == "ServiceMonitor"
            assert document["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "gpu-share"}
            assert document["spec"]["endpoints"][0]["port"] == "metrics"
            continue
        kubernetes_validate.validate(document, version, strict=True)


def test_kubectl_apply_dir_holds_only_the_plugin():
    top = {d["kind"] for p in (ROOT / "daemonset").glob("*.yaml") for d in _documents(p)}
    assert top == {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "Service"}
    assert not list((ROOT / "daemonset").glob("*.json"))  # `kubectl apply -f daemonset/` would read it


def test_daemonset_wiring():
    ds = _documents(ROOT / "daemonset" / "03-daemonset.yaml")[0]["spec"]["template"]["spec"]
    container = ds["containers"][0]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources", "/run/gpu-share/mps", "/host/proc"} <= mounts
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" and container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert ds["priorityClassName"] == "system-node-critical"
    # Every flag the manifest passes exists.
    from deviceplugin.cli import build_parser

    build_parser().parse_args(["run", *container["args"]])


def _config_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.S):
            if re.search(r"^version: v1", block, flags=re.M):
                blocks.append((path.name, block))
    configmap = _documents(ROOT / "daemonset" / "02-configmap.yaml")[0]
    blocks.append(("02-configmap.yaml", configmap["data"]["config.yaml"]))
    return blocks


@pytest.mark.parametrize("source, text", _config_blocks(), ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "")
def test_config_examples_pass_config_check(source, text, tmp_path):
    parse_config_text(text, source)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "deviceplugin.cli", "config", "check", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_docs_hold_config_examples():
    assert len(_config_blocks()) >= 4


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((ROOT / "daemonset" / "grafana" / "gpu-share-dashboard.json").read_text())
    queried = {m for panel in dashboard["panels"] for t in panel["targets"] for m in re.findall(r"gpushare_[a-z_]+", t["expr"])}
    queried |= set(re.findall(r"gpushare_[a-z_]+", json.dumps(dashboard["templating"])))
    exported = _exported_sample_names()
    assert queried and queried <= exported, sorted(queried - exported)


def _exported_sample_names() -> set[str]:
    """Every sample name one real scrape of a running plugin shows (a pod with a GPU process included)."""
    import tempfile
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from deviceplugin.agent import AgentSettings
    from deviceplugin.daemon import DaemonOptions, PluginDaemon
    from deviceplugin.kubelet_sim import Container, KubeletSimulator, Pod
    from deviceplugin.simulated import SimulatedInventory

    from .conftest import EXAMPLES, FAST
    from .test_agent import cgroup, free_port

    with tempfile.TemporaryDirectory(prefix="gs-", dir="/tmp") as tmp:
        kubelet = KubeletSimulator(Path(tmp) / "dp")
        kubelet.start()
        inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml", proc_root=Path(tmp) / "proc")
        options = DaemonOptions(plugin_dir=Path(tmp) / "dp", pod_resources_socket=kubelet.pod_resources_socket, metrics_port=free_port(),
                                metrics_host="127.0.0.1", proc_root=str(Path(tmp) / "proc"), timings=FAST, agent=AgentSettings(interval=3600))
        daemon = PluginDaemon(inventory, options, pod_directory=kubelet.pod_directory())
        daemon.start()
        try:
            kubelet.wait_for(lambda st: "example.com/gpu-share" in st and st["example.com/gpu-share"].allocatable > 0, timeout=5)
            pod = Pod("p", [Container("c", {"example.com/gpu-share": 1})])
            kubelet.admit(pod)
            inventory.add_process(7, daemon.node.gpus[0].uuid, 100, cgroup=cgroup(pod, "c"))
            daemon.agent.sync()
            text = urllib.request.urlopen(f"http://127.0.0.1:{options.metrics_port}/metrics", timeout=5).read().decode()
        finally:
            daemon.stop()
            kubelet.stop()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}

"""What ships: the Dockerfile lints clean, every manifest is schema-valid, the dashboard queries exported metrics,
and every config example in the docs and the ConfigMap passes validation."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deviceplugin import __version__
from deviceplugin.config.parse import parse_config_text

from .conftest import ROOT

VERSIONS = ("1.37.0", "1.36.0")  # the newest two minor versions kubernetes-validate ships
MANIFESTS = sorted(
    p
    for p in (ROOT / "daemonset").rglob("*.yaml")
    if p.name != "kustomization.yaml" and p.parent.name not in ("config", "transformers")
)
CONFIG = ROOT / "daemonset" / "config" / "config.yaml"  # the shipped config (the kustomization's and the chart's)
KUBECTL = shutil.which("kubectl")


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
        if document["apiVersion"].startswith("kubescheduler.config.k8s.io/"):
            continue  # kube-scheduler's own config file, not an API object: tests/test_scheduler_manifests.py checks it
        kubernetes_validate.validate(document, version, strict=True)


def test_kustomization_holds_only_the_plugin_and_the_version_of_the_package():
    kustomization = yaml.safe_load((ROOT / "daemonset" / "kustomization.yaml").read_text())
    top = sorted(p.name for p in (ROOT / "daemonset").glob("*.yaml") if p.name != "kustomization.yaml")
    assert kustomization["resources"] == top
    kinds = {d["kind"] for name in top for d in _documents(ROOT / "daemonset" / name)}
    assert kinds == {
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Service",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    assert kustomization["images"] == [
        {"name": "gpu-share", "newName": "ghcr.io/example/gpu-share", "newTag": __version__}
    ]
    assert not list((ROOT / "daemonset").glob("*.json"))


def _render(tmp_path: Path, edit=lambda text: text) -> list[dict]:
    copy = tmp_path / "daemonset"
    shutil.copytree(ROOT / "daemonset", copy)
    kustomization = copy / "kustomization.yaml"
    kustomization.write_text(edit(kustomization.read_text()))
    proc = subprocess.run([KUBECTL, "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.mark.skipif(not KUBECTL, reason="kubectl is not installed")
def test_kustomization_knobs_render_image_namespace_and_domain(tmp_path):
    def knobs(text: str) -> str:
        text = text.replace("namespace: gpu-share", "namespace: gpu-system").replace(
            "newName: ghcr.io/example/gpu-share", "newName: registry.acme.io/gpu-share"
        )
        text = text.replace('newTag: "0.2.0"', 'newTag: "9.9.9"').replace(
            "- domain=example.com", "- domain=gpu.acme.io"
        )
        every = (
            "[admission, extender, optional/mps, optional/servicemonitor, optional/kill-policy, "
            "optional/nvidia-runtime, optional/cdi, domain]"
        )
        return re.sub(r"^components:\n(?:(?:  |#).*\n)*", f"components: {every}\n", text, flags=re.M)

    documents = _render(tmp_path, knobs)
    daemonsets = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in documents if d["kind"] == "DaemonSet"}
    assert set(daemonsets) == {"gpu-share", "gpu-share-mps"}
    for spec in daemonsets.values():
        assert spec["containers"][0]["image"] == "registry.acme.io/gpu-share:9.9.9"
        assert spec["runtimeClassName"] == "nvidia"
        keys = {
            e["key"]
            for term in spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                "nodeSelectorTerms"
            ]
            for e in term["matchExpressions"]
        }
        assert {k.split("/")[0] for k in keys if "gpu-share." in k} == {"gpu.acme.io"}
    extender = next(d for d in documents if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert extender["image"] == "registry.acme.io/gpu-share:9.9.9"
    plugin = daemonsets["gpu-share"]
    assert plugin["hostPID"] is True and plugin["containers"][0]["securityContext"]["capabilities"]["add"] == ["KILL"]
    assert {"/etc/cdi", "/var/run/cdi"} <= {m["mountPath"] for m in plugin["containers"][0]["volumeMounts"]}
    namespaced = [d for d in documents if "namespace" in d["metadata"]]
    assert {d["metadata"]["namespace"] for d in namespaced} == {"gpu-system"}
    cluster_scoped = {
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "Namespace",
    }
    assert not [d["metadata"] for d in namespaced if d["kind"] in cluster_scoped]
    assert {s["namespace"] for d in documents if d["kind"] == "ClusterRoleBinding" for s in d["subjects"]} == {
        "gpu-system"
    }
    assert [d["metadata"]["name"] for d in documents if d["kind"] == "Namespace"] == ["gpu-system"]
    settings = next(d for d in documents if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gpu-share-settings")
    assert settings["data"] == {"domain": "gpu.acme.io"}
    assert not [
        d for d in documents if d["metadata"]["name"] == "gpu-share-admission-limits"
    ]  # kustomize's only: never applied
    policy = next(
        d
        for d in documents
        if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == "gpu-share-shares-per-gpu"
    )
    assert {v["name"]: v["expression"] for v in policy["spec"]["variables"]}["domain"] == "'gpu.acme.io'"
    binding = next(
        d
        for d in documents
        if d["kind"] == "ValidatingAdmissionPolicyBinding" and d["metadata"]["name"] == "gpu-share-shares-per-gpu"
    )
    assert "paramRef" not in binding["spec"]  # the same binding in every namespace
    config = next(d for d in documents if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gpu-share-config")
    assert config["data"]["config.yaml"] == CONFIG.read_text()
    assert "example.com" not in yaml.safe_dump_all(documents)
    for document in documents:
        if document["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(document, VERSIONS[0], strict=True)


@pytest.mark.skipif(not KUBECTL, reason="kubectl is not installed")
def test_an_overlay_changes_the_domain_in_one_place(tmp_path):
    """An overlay merging its domain into gpu-share-settings and listing the base's `domain` component: every key
    under the new domain (a base's own replacements run before an overlay's edits)."""
    base = tmp_path / "daemonset"
    shutil.copytree(ROOT / "daemonset", base)
    kustomization = base / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace("#  - optional/mps ", "  - optional/mps "))
    overlay = tmp_path / "prod"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "resources: [../daemonset]\n"
        "configMapGenerator: [{name: gpu-share-settings, behavior: merge, literals: [domain=acme.io]}]\n"
        "components: [../daemonset/domain]\n"
    )
    proc = subprocess.run([KUBECTL, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    documents = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert "example.com" not in proc.stdout
    keys = {
        e["key"]
        for d in documents
        if d["kind"] == "DaemonSet"
        for t in d["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        for e in t["matchExpressions"]
    }
    assert {"acme.io/gpu-share.enabled", "acme.io/gpu-share.config"} <= keys
    policy = next(
        d
        for d in documents
        if d["metadata"]["name"] == "gpu-share-shares-per-gpu" and d["kind"] == "ValidatingAdmissionPolicy"
    )
    assert {v["name"]: v["expression"] for v in policy["spec"]["variables"]}["domain"] == "'acme.io'"


@pytest.mark.skipif(not KUBECTL, reason="kubectl is not installed")
def test_default_kustomization_grants_no_kill_and_no_host_pid(tmp_path):
    plugin = next(d for d in _render(tmp_path) if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert "hostPID" not in plugin and "runtimeClassName" not in plugin
    assert plugin["containers"][0]["image"] == f"ghcr.io/example/gpu-share:{__version__}"


def test_daemonset_wiring():
    ds = _documents(ROOT / "daemonset" / "03-daemonset.yaml")[0]["spec"]["template"]["spec"]
    container = ds["containers"][0]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
        "/run/gpu-share/mps",
        "/host/proc",
    } <= mounts
    assert (
        container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        and container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    )
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert ds["priorityClassName"] == "system-node-critical"
    # Least privilege: no hostPID, no added capability, the runtime's seccomp profile, every volume used.
    assert "hostPID" not in ds and ds["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert {v["name"] for v in ds["volumes"]} == {m["name"] for m in container["volumeMounts"]}
    # Every flag the manifest passes exists.
    from deviceplugin.cli.main import build_parser

    assert container["command"] == [
        "gpu-share",
        "run",
    ]  # the image's entrypoint is `gpu-share`, its default command `run`
    build_parser().parse_args(["run", *container["args"]])


def _config_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.S):
            if re.search(r"^(version|pools|profiles):", block, flags=re.M):  # a config, complete or not
                blocks.append((path.name, block))
    blocks.append(("daemonset/config/config.yaml", CONFIG.read_text()))
    blocks += [(path.name, path.read_text()) for path in sorted((ROOT / "examples" / "config").glob("*.yaml"))]
    return blocks


@pytest.mark.parametrize(
    "source, text", _config_blocks(), ids=lambda v: v if isinstance(v, str) and len(v) < 40 else ""
)
def test_config_examples_pass_config_check(source, text, tmp_path):
    parse_config_text(text, source)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "deviceplugin.cli", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    # The profile that would run (defaultProfile) serves something on at least one shipped node.
    results = []
    for node in sorted((ROOT / "examples" / "nodes").glob("*.yaml")):
        proc = subprocess.run(
            [sys.executable, "-m", "deviceplugin.cli", "config", "check", str(path), "--node", str(node)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        results.append(proc.stdout + proc.stderr)
        if proc.returncode == 0:
            break
    else:
        pytest.fail("fails on every shipped node:\n" + "\n".join(results))


def test_docs_hold_config_examples():
    assert len(_config_blocks()) >= 4


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((ROOT / "daemonset" / "grafana" / "gpu-share-dashboard.json").read_text())
    queried = {
        m for panel in dashboard["panels"] for t in panel["targets"] for m in re.findall(r"gpushare_[a-z_]+", t["expr"])
    }
    queried |= set(re.findall(r"gpushare_[a-z_]+", json.dumps(dashboard["templating"])))
    exported = _exported_sample_names()
    assert queried and queried <= exported, sorted(queried - exported)


def test_metrics_doc_lists_exactly_the_exported_metrics():
    """docs/metrics.md's node-plugin tables (the extender's section aside) against one real scrape."""
    text = (ROOT / "docs" / "metrics.md").read_text().split("## Scheduler extender")[0]
    documented = set(re.findall(r"^\| `(gpushare_[a-z_]+)`", text, flags=re.M))
    exported = {re.sub(r"_(bucket|count|sum)$", "", n) for n in _exported_sample_names() if not n.endswith("_created")}
    assert documented == exported, (sorted(documented - exported), sorted(exported - documented))


def _exported_sample_names() -> set[str]:
    """Every sample name one real scrape of a running plugin shows (a pod with a GPU process included)."""
    import tempfile
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from deviceplugin.agent.loop import AgentSettings
    from deviceplugin.discovery.simulated import SimulatedInventory
    from deviceplugin.runtime.daemon import build_daemon
    from deviceplugin.runtime.options import DaemonOptions
    from deviceplugin.sim.kubelet import Container, KubeletSimulator, Pod

    from .conftest import EXAMPLES, FAST, cgroup, free_port

    with tempfile.TemporaryDirectory(prefix="gs-", dir="/tmp") as tmp:
        kubelet = KubeletSimulator(Path(tmp) / "dp")
        kubelet.start()
        inventory = SimulatedInventory.from_file(EXAMPLES / "nodes" / "2xT4.yaml", proc_root=Path(tmp) / "proc")
        options = DaemonOptions(
            plugin_dir=Path(tmp) / "dp",
            pod_resources_socket=kubelet.pod_resources_socket,
            metrics_port=free_port(),
            metrics_host="127.0.0.1",
            proc_root=str(Path(tmp) / "proc"),
            timings=FAST,
            agent=AgentSettings(interval=3600),
        )
        daemon = build_daemon(inventory, options, pod_directory=kubelet.pod_directory())
        daemon.start()
        try:
            kubelet.wait_for(
                lambda st: "example.com/gpu-share" in st and st["example.com/gpu-share"].allocatable > 0, timeout=5
            )
            pod = Pod("p", [Container("c", {"example.com/gpu-share": 1})])
            kubelet.admit(pod)
            inventory.add_process(7, daemon.node.gpus[0].uuid, 100, cgroup=cgroup(pod, "c"))
            daemon.agent.sync()
            text = urllib.request.urlopen(f"http://127.0.0.1:{options.metrics_port}/metrics", timeout=5).read().decode()
        finally:
            daemon.stop()
            kubelet.stop()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_rbac_grants_only_what_the_features_use():
    roles = {
        d["metadata"]["name"]: d["rules"]
        for d in _documents(ROOT / "daemonset" / "01-rbac.yaml")
        if d["kind"] == "ClusterRole"
    }
    assert roles == {
        "gpu-share-node": [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        ],
        "gpu-share-pods": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
    }
    policy = _documents(ROOT / "daemonset" / "05-node-patch-policy.yaml")[0]["spec"]
    assert "authentication.kubernetes.io/node-name" in policy["validations"][0]["expression"]
    assert policy["matchConstraints"]["resourceRules"][0]["resources"] == ["nodes"]


def test_image_installs_from_the_lock_which_pins_every_runtime_dependency():
    from packaging.requirements import Requirement

    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.count("--constraint") == 2 and re.search(r"^FROM python:3\.1[3-9]-slim", dockerfile, flags=re.M)
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not pinned: {line}"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        requirement = Requirement(dependency)
        key = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert key in pins and requirement.specifier.contains(pins[key]), (dependency, pins.get(key))


def test_license_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert (
        "Apache License\n                           Version 2.0, January 2004" in text
        and "END OF TERMS AND CONDITIONS" in text
    )
    assert len(text) > 11000

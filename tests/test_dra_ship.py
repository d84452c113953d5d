"""What daemonset/dra/ ships: its kustomization's knobs agree with the device plugin's and render everywhere, RBAC
grants only what the driver calls, the DaemonSet mounts the kubelet's directories at their own paths and never
runs beside the device plugin. (tests/e2e/ applies them to a real API server and schedules with the classes.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deviceplugin import __version__

from .conftest import ROOT

DRA = ROOT / "daemonset" / "dra"
KUBECTL = shutil.which("kubectl")


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_knobs_agree_with_the_device_plugins_and_the_driver_is_named_after_the_domain() -> None:
    ours = yaml.safe_load((DRA / "kustomization.yaml").read_text())
    base = yaml.safe_load((ROOT / "daemonset" / "kustomization.yaml").read_text())
    assert (
        ours["images"]
        == base["images"]
        == [{"name": "gpu-share", "newName": "ghcr.io/example/gpu-share", "newTag": __version__}]
    )
    assert ours["namespace"] == base["namespace"]
    settings = dict(item.split("=", 1) for item in ours["configMapGenerator"][0]["literals"])
    assert settings == {"domain": "example.com", "capacity": "shares"}  # the driver and its directory follow the domain
    [base_settings] = [g for g in base["configMapGenerator"] if g["name"] == "gpu-share-settings"]
    assert f"domain={settings['domain']}" in base_settings["literals"]
    assert ours["resources"] == sorted(p.name for p in DRA.glob("*.yaml") if p.name != "kustomization.yaml")
    assert ours["transformers"] == ["transformers/cluster-scoped.yaml"]


@pytest.mark.skipif(not KUBECTL, reason="kubectl is not installed")
def test_another_domain_renders_into_every_place_that_names_it(tmp_path: Path) -> None:
    copy = tmp_path / "dra"
    shutil.copytree(DRA, copy)
    text = (copy / "kustomization.yaml").read_text().replace("domain=example.com", "domain=gpu.acme.io")
    (copy / "kustomization.yaml").write_text(text.replace("namespace: gpu-share", "namespace: gpu-system"))
    proc = subprocess.run([str(KUBECTL), "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "example.com" not in proc.stdout
    documents = [d for d in yaml.safe_load_all(proc.stdout) if d]
    role = next(d for d in documents if d["kind"] == "ClusterRole")
    assert [r["resourceNames"] for r in role["rules"] if "resourceNames" in r] == [
        ["gpu-share.gpu.acme.io"]
    ]  # status.devices of its driver
    classes = {d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "DeviceClass"}
    assert classes["gpu-share-gpu"]["extendedResourceName"] == "gpu.acme.io/gpu"
    assert all("'gpu-share.' + 'gpu.acme.io'" in c["selectors"][0]["cel"]["expression"] for c in classes.values())
    ds = next(d for d in documents if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert {v["hostPath"]["path"] for v in ds["volumes"] if v["name"] == "plugin-data"} == {
        "/var/lib/kubelet/plugins/gpu-share.gpu.acme.io"
    }
    keys = {
        e["key"]
        for t in ds["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        for e in t["matchExpressions"]
    }
    assert keys == {"gpu.acme.io/gpu-share.api", "gpu.acme.io/gpu-share.enabled"}
    assert {s["namespace"] for d in documents if d["kind"] == "ClusterRoleBinding" for s in d["subjects"]} == {
        "gpu-system"
    }
    namespaced = {(d["kind"], d["metadata"].get("namespace")) for d in documents}
    assert namespaced == {
        ("ServiceAccount", "gpu-system"),
        ("ConfigMap", "gpu-system"),
        ("DaemonSet", "gpu-system"),
        ("ClusterRole", None),
        ("ClusterRoleBinding", None),
        ("ValidatingAdmissionPolicy", None),
        ("ValidatingAdmissionPolicyBinding", None),
        ("DeviceClass", None),
    }  # cluster-scoped objects carry no namespace (kustomize would give them one)


def test_rbac_grants_only_what_the_driver_calls() -> None:
    [role] = [d for d in _documents(DRA / "01-rbac.yaml") if d["kind"] == "ClusterRole"]
    assert role["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices"],
            "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
        },
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"], "verbs": ["patch"]},
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceclaims/driver"],
            "verbs": ["associated-node:patch"],
            "resourceNames": ["gpu-share.example.com"],
        },
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]
    policy = _documents(DRA / "04-slice-policy.yaml")[0]["spec"]
    assert "authentication.kubernetes.io/node-name" in policy["variables"][0]["expression"]
    assert policy["matchConstraints"]["resourceRules"][0]["resources"] == ["resourceslices"]


def test_the_daemonset_mounts_the_kubelets_directories_at_their_own_paths_and_never_runs_beside_the_device_plugin() -> (
    None
):
    ds = _documents(DRA / "03-daemonset.yaml")[0]["spec"]
    pod = ds["template"]["spec"]
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        if mount["name"] in ("plugins-registry", "plugin-data", "cdi", "pod-resources", "mps-root"):
            assert volumes[mount["name"]]["hostPath"]["path"] == mount["mountPath"]
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins/gpu-share.example.com",
        "/var/run/cdi",
        "/var/lib/kubelet/pod-resources",
        # the MPS readiness check reads each pool's control pipe there (as the device plugin does)
        "/run/gpu-share/mps",
    }
    assert container["securityContext"]["privileged"] is True and "--api=dra" in container["args"]
    env = {e["name"]: e.get("valueFrom", {}) for e in container["env"]}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}} and env["POD_UID"] == {
        "fieldRef": {"fieldPath": "metadata.uid"}
    }
    [term] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "example.com/gpu-share.enabled", "operator": "NotIn", "values": ["true"]} in term["matchExpressions"]
    device_plugin = _documents(ROOT / "daemonset" / "03-daemonset.yaml")[0]["spec"]["template"]["spec"]["affinity"][
        "nodeAffinity"
    ]
    for dp_term in device_plugin["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]:
        assert {"key": "example.com/gpu-share.enabled", "operator": "In", "values": ["true"]} in dp_term[
            "matchExpressions"
        ]


def test_the_dra_doc_lists_exactly_the_slice_publishers_metrics() -> None:
    import re

    from deviceplugin.dra.slices import SlicePublisher
    from deviceplugin.state import NodeState

    from .conftest import node

    text = (ROOT / "docs" / "dra.md").read_text().split("### Slice publisher metrics")[1].split("\n## ")[0]
    documented = set(re.findall(r"^\| `(gpushare_[a-z_]+)", text, flags=re.M))
    publisher = SlicePublisher(None, "n", "gpu-share.example.com", node("2xT4"), NodeState())
    exported = {s.name for m in publisher.collector().collect() for s in m.samples}
    assert documented == exported


def test_the_kueue_example_maps_the_shipped_device_classes_and_its_queue_covers_exactly_them() -> None:
    """docs/dra.md's Kueue section (Kueue v0.18's DRA form): every mapped DeviceClass is one daemonset/dra/ ships, and
    the ClusterQueue gives quota on exactly the mapped names."""
    text = (ROOT / "docs" / "dra.md").read_text().split("## Quota with Kueue")[1].split("\n## ")[0]
    configuration, queue = yaml.safe_load_all(text.split("```yaml\n")[1].split("```")[0])
    assert (
        configuration["apiVersion"] == "config.kueue.x-k8s.io/v1beta2"
        and queue["apiVersion"] == "kueue.x-k8s.io/v1beta1"
    )
    mappings = configuration["resources"]["deviceClassMappings"]
    shipped = {d["metadata"]["name"] for d in _documents(DRA / "02-deviceclasses.yaml")}
    assert {c for m in mappings for c in m["deviceClassNames"]} == shipped
    (group,) = queue["spec"]["resourceGroups"]
    names = [m["name"] for m in mappings]
    assert group["coveredResources"] == names == [r["name"] for r in group["flavors"][0]["resources"]]

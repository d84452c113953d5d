"""The Helm chart (deploy/helm/gpu-share), rendered by the real helm binary: lint, every toggle, a non-default domain
reaching every object, the settings it derives from the config, the same objects as the kustomization, and the
admission params equal to what `config check` shows for every shipped config on every shipped node."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deviceplugin import __version__
from deviceplugin.alloc.admission import config_sha256, fleet_limits
from deviceplugin.cli.admission_params import admission_params
from deviceplugin.cli.config_check import check_config
from deviceplugin.cli.main import build_parser
from deviceplugin.config.parse import load_config
from deviceplugin.config.types import ConfigError

from .conftest import EXAMPLES, GPU_CLI, ROOT, node

CHART = ROOT / "deploy" / "helm" / "gpu-share"
CONFIG = ROOT / "daemonset" / "config" / "config.yaml"
NODES = sorted((EXAMPLES / "nodes").glob("*.yaml"))
CONFIGS = sorted((EXAMPLES / "config").glob("*.yaml")) + [CONFIG]
KUBE_VERSION = "1.36.0"  # a version kubernetes-validate ships


def _helm() -> str | None:
    """$HELM, else helm on PATH, else beside the interpreter (.ci/install-helm puts it in .venv/bin)."""
    found = os.environ.get("HELM") or shutil.which("helm")
    beside = Path(sys.executable).parent / "helm"
    return found or (str(beside) if beside.is_file() else None)


HELM = _helm()
needs_helm = pytest.mark.skipif(HELM is None, reason="helm is not installed (.ci/install-helm installs it into .venv/bin)")
EVERY_COMPONENT = {"mps.enabled": "true", "extender.enabled": "true", "scheduler.enabled": "true",
                   "serviceMonitor.enabled": "true", "dashboards.enabled": "true"}
DRA = {"dra.enabled": "true"}  # not in EVERY_COMPONENT: the helm install test shares its API server with tests/e2e's DRA objects
DRA_OBJECTS = {("ServiceAccount", "gpu-share-dra"), ("ClusterRole", "gpu-share-dra"), ("ClusterRoleBinding", "gpu-share-dra"),
               ("DaemonSet", "gpu-share-dra"), ("DeviceClass", "gpu-share-gpu"), ("DeviceClass", "gpu-share-mig"),
               ("DeviceClass", "gpu-share-shares"), ("ValidatingAdmissionPolicy", "gpu-share-dra-own-node-slices"),
               ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-own-node-slices"),
               ("ValidatingAdmissionPolicy", "gpu-share-dra-no-share-mapping"),
               ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-no-share-mapping"),
               ("ValidatingAdmissionPolicy", "gpu-share-dra-own-node"), ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-own-node")}
DRA_ONLY = {"dra.enabled": "true", "dra.draOnly": "true", "plugin.enabled": "false"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "DeviceClass"}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def render(values: dict[str, str] | None = None, *extra: str, namespace: str = "gpu-share") -> list[dict]:
    sets = [f"--set={k}={v}" for k, v in (values or {}).items()]
    proc = helm("template", "gs", str(CHART), "--namespace", namespace, *sets, *extra)
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(documents: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in documents}


def test_chart_version_is_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__


@needs_helm
def test_helm_lint_passes_with_every_component():
    sets = ",".join(f"{k}={v}" for k, v in {**EVERY_COMPONENT, **DRA}.items())
    proc = helm("lint", str(CHART), "--strict", "--set", sets)
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout, proc.stdout


@needs_helm
def test_default_install_is_the_plugin_with_its_admission_policies_and_schema_valid():
    documents = render()
    assert sorted(by_kind(documents)) == sorted([
        ("ServiceAccount", "gpu-share"), ("ClusterRole", "gpu-share-node"), ("ClusterRoleBinding", "gpu-share-node"),
        ("ClusterRole", "gpu-share-pods"), ("ClusterRoleBinding", "gpu-share-pods"), ("ConfigMap", "gpu-share-config"),
        ("DaemonSet", "gpu-share"), ("Service", "gpu-share-metrics"),
        ("ValidatingAdmissionPolicy", "gpu-share-own-node"), ("ValidatingAdmissionPolicyBinding", "gpu-share-own-node"),
        ("ValidatingAdmissionPolicy", "gpu-share-shares-per-gpu"),
        ("ValidatingAdmissionPolicyBinding", "gpu-share-shares-per-gpu"),
        ("ServiceAccount", "gpu-share-admission-test"), ("Role", "gpu-share-admission-test"),  # helm test's hook
        ("RoleBinding", "gpu-share-admission-test"), ("Pod", "gpu-share-admission-test"),
    ])
    for document in documents:
        kubernetes_validate.validate(document, KUBE_VERSION, strict=True)
    plugin = by_kind(documents)[("DaemonSet", "gpu-share")]["spec"]["template"]["spec"]
    assert plugin["containers"][0]["image"] == f"ghcr.io/example/gpu-share:{__version__}"
    assert "hostPID" not in plugin and "runtimeClassName" not in plugin


TOGGLES = {
    "mps.enabled": {("DaemonSet", "gpu-share-mps-mps")},
    "extender.enabled": {("ServiceAccount", "gpu-share-extender"), ("ClusterRole", "gpu-share-extender"),
                         ("ClusterRoleBinding", "gpu-share-extender"), ("Deployment", "gpu-share-extender"), ("Service", "gpu-share-extender"),
                         ("ConfigMap", "gpu-share-scheduler-extender")},
    "serviceMonitor.enabled": {("ServiceMonitor", "gpu-share")},
    "dashboards.enabled": {("ConfigMap", "gpu-share-dashboards")},
    "dra.enabled": DRA_OBJECTS,
}


@needs_helm
@pytest.mark.parametrize("toggle", sorted(TOGGLES))
def test_each_toggle_adds_its_component(toggle):
    base = set(by_kind(render()))
    documents = render({toggle: "true"})
    assert set(by_kind(documents)) - base == TOGGLES[toggle]
    for document in documents:
        if document["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(document, KUBE_VERSION, strict=True)


@needs_helm
def test_toggles_remove_what_they_name():
    kept = set(by_kind(render({"admission.enabled": "false", "nodePatchPolicy.enabled": "false"})))
    assert not {k for k in kept if k[0].startswith("ValidatingAdmissionPolicy")} and ("ConfigMap", "gpu-share-admission-limits") not in kept
    assert not render({"plugin.enabled": "false", "admission.enabled": "false"})
    proc = helm("template", "gs", str(CHART), "--set", "scheduler.enabled=true", check=False)
    assert proc.returncode != 0 and "scheduler.enabled: the second scheduler calls the extender: set extender.enabled=true" in proc.stderr


@needs_helm
def test_a_domain_reaches_every_component_and_no_example_com_is_left():
    sets = {"domain": "acme.io", "image.repository": "registry.acme.io/gpu-share", "image.tag": "9.9.9", **EVERY_COMPONENT, **DRA}
    proc = helm("template", "gs", str(CHART), "--namespace", "gpu-system", *[f"--set={k}={v}" for k, v in sets.items()])
    assert "example.com" not in proc.stdout  # comments included
    documents = [d for d in yaml.safe_load_all(proc.stdout) if d]
    objects = by_kind(documents)
    for name in ("gpu-share", "gpu-share-mps-mps"):
        spec = objects[("DaemonSet", name)]["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert container["image"] == "registry.acme.io/gpu-share:9.9.9"
        assert {"name": "GPU_SHARE_DOMAIN", "value": "acme.io"} in container["env"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert all({"key": "acme.io/gpu-share.enabled", "operator": "In", "values": ["true"]} in t["matchExpressions"] for t in terms)
    mps_terms = objects[("DaemonSet", "gpu-share-mps-mps")]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "acme.io/gpu-share.config", "operator": "In", "values": ["mps"]} in mps_terms[0]["matchExpressions"]
    extender = objects[("Deployment", "gpu-share-extender")]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "GPU_SHARE_DOMAIN", "value": "acme.io"} in extender["env"] and extender["image"] == "registry.acme.io/gpu-share:9.9.9"
    scheduler = yaml.safe_load(objects[("ConfigMap", "gpu-share-scheduler-config")]["data"]["config.yaml"])
    call, every_pod = scheduler["extenders"]
    assert every_pod["urlPrefix"] == "http://gpu-share-extender.gpu-system.svc:8888/all"
    assert call["urlPrefix"] == "http://gpu-share-extender.gpu-system.svc:8888"
    assert {r["name"] for r in call["managedResources"]} >= {"acme.io/gpu-share", "acme.io/gpu"}
    assert all(r["name"].startswith("acme.io/") for r in call["managedResources"])
    assert _policy_variables(objects)["domain"] == "'acme.io'"
    dra = objects[("DaemonSet", "gpu-share-dra")]["spec"]["template"]["spec"]
    assert dra["containers"][0]["image"] == "registry.acme.io/gpu-share:9.9.9"
    assert {"name": "GPU_SHARE_DOMAIN", "value": "acme.io"} in dra["containers"][0]["env"]
    assert {v["hostPath"]["path"] for v in dra["volumes"] if v["name"] == "plugin-data"} == {"/var/lib/kubelet/plugins/gpu-share.acme.io"}
    classes = {name: d["spec"] for (kind, name), d in objects.items() if kind == "DeviceClass"}
    assert classes["gpu-share-gpu"]["extendedResourceName"] == "acme.io/gpu"
    assert all("'gpu-share.' + 'acme.io'" in c["selectors"][0]["cel"]["expression"] for c in classes.values())
    mapping = objects[("ValidatingAdmissionPolicy", "gpu-share-dra-no-share-mapping")]["spec"]["validations"][0]["expression"]
    assert "'acme.io' + '/gpu-share'" in mapping
    assert objects[("ClusterRoleBinding", "gpu-share-dra")]["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-share-dra", "namespace": "gpu-system"}]
    only = by_kind(render({"domain": "acme.io", **DRA_ONLY}))[("ValidatingAdmissionPolicy", "gpu-share-dra-only-share-requests")]
    assert only["spec"]["variables"][0]["expression"] == "'acme.io' + '/gpu-share'"
    binding = objects[("ValidatingAdmissionPolicyBinding", "gpu-share-shares-per-gpu")]["spec"]
    assert binding == {"policyName": "gpu-share-shares-per-gpu", "validationActions": ["Deny"]}  # no params: nothing to lose
    for document in documents:
        namespace = document["metadata"].get("namespace")
        if document["kind"] in CLUSTER_SCOPED:
            assert namespace is None, document["metadata"]  # a cluster-scoped object has no namespace
        elif document["kind"] == "RoleBinding" and document["metadata"]["name"] != "gpu-share-admission-test":
            assert namespace == "kube-system"  # the scheduler's authentication reader
        else:
            assert namespace == "gpu-system", document["metadata"]


@needs_helm
def test_pod_settings_come_from_values():
    documents = render({"plugin.runtimeClassName": "nvidia", "plugin.priorityClassName": "gpu-critical", "plugin.nodeSelector.pool": "gpu",
                        "plugin.extraArgs[0]": "--health-recovery=600", "plugin.extraEnv[0].name": "FAIL_ON_INIT_ERROR",
                        "plugin.resources.limits.memory": "512Mi", "plugin.tolerations": "null", "image.digest": "sha256:" + "a" * 64},
                       "--set-string", "plugin.extraEnv[0].value=false")
    spec = by_kind(documents)[("DaemonSet", "gpu-share")]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert spec["runtimeClassName"] == "nvidia" and spec["priorityClassName"] == "gpu-critical" and spec["nodeSelector"] == {"pool": "gpu"}
    assert "tolerations" not in spec
    assert container["args"][-1] == "--health-recovery=600" and container["env"][-1] == {"name": "FAIL_ON_INIT_ERROR", "value": "false"}
    assert container["resources"]["limits"]["memory"] == "512Mi"
    assert container["image"] == "ghcr.io/example/gpu-share@sha256:" + "a" * 64
    build_parser().parse_args(["run", *container["args"]])  # every flag the chart passes exists


def _policy_variables(objects: dict[tuple[str, str], dict]) -> dict[str, str]:
    """The shares-per-GPU policy's variables, name to expression."""
    return {v["name"]: v["expression"] for v in objects[("ValidatingAdmissionPolicy", "gpu-share-shares-per-gpu")]["spec"]["variables"]}


def _with_config(text: str) -> list[str]:
    """helm flags installing `text` as the config, with the admission values computed for it."""
    values = yaml.safe_load(admission_params_for(text))
    return ["--set-string", "config=" + text.replace(",", "\\,"), "--set", f"admission.configSha256={values['admission']['configSha256']}"] + [
        arg for name, count in values["admission"]["limits"].items() for arg in ("--set-string", f"admission.limits.{name}={count}")]


def admission_params_for(text: str) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        file.write(text)
        file.flush()
        return admission_params(file.name, [str(n) for n in NODES], chart_values=True)


@needs_helm
def test_kill_policy_and_cdi_follow_the_installed_config():
    text = "version: v1\ndeviceListStrategy: cdi\nmemoryWatchdog: {policy: kill}\npools: [{name: s, mode: shared, replicas: 4}]\n"
    documents = render(None, *_with_config(text))
    spec = by_kind(documents)[("DaemonSet", "gpu-share")]["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and spec["containers"][0]["securityContext"]["capabilities"]["add"] == ["KILL"]
    assert {"/etc/cdi", "/var/run/cdi"} <= {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert _policy_variables(by_kind(documents))["limits"] == "{'gpu-share': 4}"
    assert by_kind(documents)[("ConfigMap", "gpu-share-config")]["data"]["config.yaml"] == text


@needs_helm
def test_a_config_without_its_admission_values_is_refused_by_name():
    proc = helm("template", "gs", str(CHART), "--set-file", f"config={EXAMPLES / 'config' / 'default.yaml'}", check=False)
    assert proc.returncode != 0
    assert "admission: its limits were computed for another config" in proc.stderr and "gpu-share config admission-params" in proc.stderr
    for values, message in (({"domain": "Bad_Domain"}, "- at '/domain': 'Bad_Domain' does not match pattern"),
                            ({"admission.limits.gpu-share": "many"}, "- at '/admission/limits/gpu-share': 'many' does not match pattern '^[0-9]+$'"),
                            ({"plugin.nodeSelecter.pool": "gpu"}, "- at '/plugin': additional properties 'nodeSelecter' not allowed"),
                            ({"imge.repository": "x"}, "- at '': additional properties 'imge' not allowed"),  # a typo, refused by name
                            ({"plugin.metricsPort": "http"}, "- at '/plugin/metricsPort': got string, want integer"),
                            ({"dra.enabled": "true", "dra.draOnly": "yes"}, "- at '/dra/draOnly': got string, want boolean")):
        proc = helm("template", "gs", str(CHART), *[f"--set={k}={v}" for k, v in values.items()], check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    # Without the schema (--skip-schema-validation) the templates still refuse a bad domain by name.
    proc = helm("template", "gs", str(CHART), "--skip-schema-validation", "--set", "domain=Bad_Domain", check=False)
    assert proc.returncode != 0 and 'domain: must be a DNS subdomain such as acme.io, got "Bad_Domain"' in proc.stderr, proc.stderr


@needs_helm
def test_one_mps_daemonset_per_mps_pool_of_the_config_on_the_nodes_of_its_profiles():
    text = ("version: v1\ndefaultProfile: fast\nprofiles:\n"
            "  fast: {pools: [{name: quick, mode: shared, backend: mps, replicas: 4, exclusiveProcess: true}]}\n"
            "  both: {pools: [{name: quick, mode: shared, backend: mps, replicas: 4, gpus: {indexes: [0]}}, {name: big, mode: shared, backend: mps, replicas: 2, resource: big-share}]}\n"
            "  whole: {pools: [{name: w, mode: exclusive}]}\n")
    objects = by_kind(render({"mps.enabled": "true"}, *_with_config(text)))
    assert {k for k in objects if k[0] == "DaemonSet"} == {("DaemonSet", "gpu-share"), ("DaemonSet", "gpu-share-mps-quick"), ("DaemonSet", "gpu-share-mps-big")}
    for pool, profiles, default in (("quick", ["both", "fast"], True), ("big", ["both"], False)):
        spec = objects[("DaemonSet", f"gpu-share-mps-{pool}")]["spec"]["template"]["spec"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms[0]["matchExpressions"][1] == {"key": "example.com/gpu-share.config", "operator": "In", "values": profiles}
        assert (len(terms) == 2 and terms[1]["matchExpressions"][1] == {"key": "example.com/gpu-share.config", "operator": "DoesNotExist"}) == default
        shm = next(v for v in spec["volumes"] if v["name"] == "mps-shm")
        assert shm["hostPath"]["path"] == f"/run/gpu-share/mps/{pool}/shm"
        container = spec["containers"][0]
        assert f"--pools={pool}" in container["args"]
        assert container["securityContext"].get("privileged", False) == (pool == "quick")  # exclusiveProcess sets compute modes
        kubernetes_validate.validate(objects[("DaemonSet", f"gpu-share-mps-{pool}")], KUBE_VERSION, strict=True)
        build_parser().parse_args(["mps", *container["args"]])
    proc = helm("template", "gs", str(CHART), "--set", "mps.enabled=true", *_with_config("version: v1\npools: [{name: s, mode: shared}]\n"), check=False)
    assert proc.returncode != 0 and "mps.enabled: the config has no pool with backend: mps" in proc.stderr


@needs_helm
def test_both_ways_of_calling_the_extender_are_the_shipped_scheduler_config():
    """The second scheduler's config and the `extenders` entry for the cluster's own scheduler equal
    daemonset/extender/scheduler/'s (kube-scheduler's field names: a typo would be silently ignored)."""
    objects = by_kind(render({"extender.enabled": "true", "scheduler.enabled": "true"}))
    shipped = yaml.safe_load((ROOT / "daemonset" / "extender" / "scheduler" / "kube-scheduler-config.yaml").read_text())["extenders"]
    way1 = yaml.safe_load(objects[("ConfigMap", "gpu-share-scheduler-extender")]["data"]["extenders.yaml"])["extenders"]
    way2 = yaml.safe_load(objects[("ConfigMap", "gpu-share-scheduler-config")]["data"]["config.yaml"])
    assert way1 == way2["extenders"] == shipped
    shipped_second = next(d for d in yaml.safe_load_all((ROOT / "daemonset" / "extender" / "scheduler" / "second-scheduler.yaml").read_text())
                          if d and d["kind"] == "ConfigMap")
    assert way2["profiles"] == yaml.safe_load(shipped_second["data"]["config.yaml"])["profiles"]


# --- one source of truth: the chart and the kustomization install the same objects ---------------------------


def _kustomize(tmp_path: Path, namespace: str = "gpu-share") -> list[dict]:
    """daemonset/ with the MPS and extender components, in `namespace`."""
    copy = tmp_path / "daemonset"
    shutil.copytree(ROOT / "daemonset", copy)
    kustomization = copy / "kustomization.yaml"
    text = kustomization.read_text().replace("#  - optional/mps", "  - optional/mps").replace("#  - extender", "  - extender")
    kustomization.write_text(text.replace("namespace: gpu-share", f"namespace: {namespace}"))
    proc = subprocess.run(["kubectl", "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _pod_spec(document: dict) -> dict:
    """A pod spec without what only tells the two installs apart (labels, how the domain reaches the env)."""
    spec = yaml.safe_load(yaml.safe_dump(document["spec"]["template"]["spec"]))
    for container in spec["containers"]:
        container.pop("imagePullPolicy", None)
        env = [e for e in container.pop("env", []) if e["name"] != "GPU_SHARE_DOMAIN"]
        if env:
            container["env"] = env
        container["args"] = [a for a in container["args"] if not a.startswith("--metrics-port=")]
    return spec


@needs_helm
@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed")
def test_chart_and_kustomization_install_the_same_objects(tmp_path):
    chart = by_kind(render({"mps.enabled": "true", "extender.enabled": "true"}))
    kustomized = by_kind(_kustomize(tmp_path))
    for ours, theirs in ((("DaemonSet", "gpu-share"),) * 2, (("DaemonSet", "gpu-share-mps-mps"), ("DaemonSet", "gpu-share-mps")),
                         (("Deployment", "gpu-share-extender"),) * 2):
        assert _pod_spec(chart[ours]) == _pod_spec(kustomized[theirs]), ours
    assert chart[("ConfigMap", "gpu-share-config")]["data"] == kustomized[("ConfigMap", "gpu-share-config")]["data"]
    for key in (("ValidatingAdmissionPolicy", "gpu-share-shares-per-gpu"), ("ClusterRole", "gpu-share-node"), ("ClusterRole", "gpu-share-pods")):
        assert chart[key].get("spec", chart[key].get("rules")) == kustomized[key].get("spec", kustomized[key].get("rules")), key


def _without_labels(document: dict) -> dict:
    """The object without its labels and, cluster-scoped, without the namespace kustomize sets on it anyway."""
    dropped = {"labels"} | ({"namespace"} if document["kind"] in CLUSTER_SCOPED else set())
    return {**document, "metadata": {k: v for k, v in document["metadata"].items() if k not in dropped}}


@needs_helm
@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed")
def test_chart_and_dra_kustomization_install_the_same_objects(tmp_path):
    """The chart's DRA driver (dra.enabled, dra.draOnly) is daemonset/dra/ with its dra-only component, object for
    object: the same pod, the same RBAC, DeviceClasses and policies (only the chart's labels differ)."""
    copy = tmp_path / "dra"
    shutil.copytree(ROOT / "daemonset" / "dra", copy)
    kustomization = copy / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace("# components:\n#   - optional/dra-only", "components:\n  - optional/dra-only"))
    proc = subprocess.run(["kubectl", "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    kustomized = by_kind([d for d in yaml.safe_load_all(proc.stdout) if d])
    del kustomized[("ConfigMap", "gpu-share-dra-settings")]  # the kustomization's domain knob; the chart's is `domain`
    chart = {k: d for k, d in by_kind(render(DRA_ONLY)).items() if d["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "gpu-share-dra"}
    assert set(chart) == set(kustomized) == DRA_OBJECTS | {("ValidatingAdmissionPolicy", "gpu-share-dra-only-share-requests"),
                                                          ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-only-share-requests")}
    key = ("DaemonSet", "gpu-share-dra")
    assert _pod_spec(chart.pop(key)) == _pod_spec(theirs := kustomized.pop(key))
    assert by_kind(render(DRA))[key]["spec"]["updateStrategy"] == theirs["spec"]["updateStrategy"]
    for key, theirs in kustomized.items():
        assert _without_labels(chart[key]) == _without_labels(theirs), key


@needs_helm
def test_the_dra_driver_never_selects_a_device_plugin_node():
    """The plugin needs <domain>/gpu-share.enabled=true, the DRA driver never runs where it is set: under the default
    affinities, under a dra.affinity of one's own (the exclusion is added to each term), and a plugin.affinity without
    the opt-in label is refused while the DRA driver is on."""
    def terms(spec: dict) -> list[dict]:
        return spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]

    opt_in = {"key": "example.com/gpu-share.enabled", "operator": "In", "values": ["true"]}
    excluded = {**opt_in, "operator": "NotIn"}
    objects = by_kind(render(DRA))
    plugin, dra = (objects[("DaemonSet", n)]["spec"]["template"]["spec"] for n in ("gpu-share", "gpu-share-dra"))
    assert all(opt_in in t["matchExpressions"] for t in terms(plugin))
    assert terms(dra) == [{"matchExpressions": [{"key": "example.com/gpu-share.api", "operator": "In", "values": ["dra"]}, excluded]}]
    own = {"dra.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key": "pool",
           "dra.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator": "Exists",
           "dra.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[1].matchExpressions[0].key": "zone",
           "dra.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[1].matchExpressions[0].operator": "Exists"}
    dra = by_kind(render({**DRA, **own}))[("DaemonSet", "gpu-share-dra")]["spec"]["template"]["spec"]
    assert terms(dra) == [{"matchExpressions": [{"key": "pool", "operator": "Exists"}, excluded]},
                          {"matchExpressions": [{"key": "zone", "operator": "Exists"}, excluded]}]
    preferred = "dra.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
    dra = by_kind(render({**DRA, f"{preferred}.weight": "1", f"{preferred}.preference.matchExpressions[0].key": "zone",
                          f"{preferred}.preference.matchExpressions[0].operator": "Exists"}))[("DaemonSet", "gpu-share-dra")]["spec"]["template"]["spec"]
    assert terms(dra) == [{"matchExpressions": [excluded]}]  # an affinity without required node terms still gets the exclusion
    plugin_terms = "plugin.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0]"
    pool = {f"{plugin_terms}.key": "pool", f"{plugin_terms}.operator": "Exists"}
    assert render(pool)  # without the DRA driver the plugin's affinity is the user's
    proc = helm("template", "gs", str(CHART), *[f"--set={k}={v}" for k, v in {**DRA, **pool}.items()], check=False)
    assert proc.returncode != 0 and "plugin.affinity: with dra.enabled every nodeSelectorTerm must require example.com/gpu-share.enabled" in proc.stderr
    kept = {f"{plugin_terms}.key": "example.com/gpu-share.enabled", f"{plugin_terms}.operator": "In"}
    assert ("DaemonSet", "gpu-share-dra") in by_kind(render({**DRA, **kept}, "--set-string", f"{plugin_terms}.values[0]=true"))


@needs_helm
def test_dra_pod_settings_and_class_options_come_from_values():
    documents = render({**DRA, "dra.runtimeClassName": "nvidia", "dra.priorityClassName": "gpu-critical", "dra.nodeSelector.pool": "gpu",
                        "dra.extraArgs[0]": "--health-stream-interval=30", "dra.extraEnv[0].name": "KUBELET_ROOT",
                        "dra.extraEnv[0].value": "/var/lib/k0s/kubelet", "dra.resources.limits.memory": "512Mi", "dra.tolerations": "null",
                        "dra.logFormat": "text", "dra.updateStrategy.rollingUpdate.maxSurge": "0",
                        "dra.updateStrategy.rollingUpdate.maxUnavailable": "1", "dra.gpuExtendedResource": "false"})
    objects = by_kind(documents)
    ds = objects[("DaemonSet", "gpu-share-dra")]["spec"]
    spec = ds["template"]["spec"]
    container = spec["containers"][0]
    assert spec["runtimeClassName"] == "nvidia" and spec["priorityClassName"] == "gpu-critical" and spec["nodeSelector"] == {"pool": "gpu"}
    assert "tolerations" not in spec and ds["updateStrategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert container["args"][-2:] == ["--log-format=text", "--health-stream-interval=30"]
    assert container["env"][-1] == {"name": "KUBELET_ROOT", "value": "/var/lib/k0s/kubelet"}
    assert container["resources"]["limits"]["memory"] == "512Mi"
    assert "extendedResourceName" not in objects[("DeviceClass", "gpu-share-gpu")]["spec"]
    build_parser().parse_args(["run", *container["args"]])  # every flag the chart passes exists
    for document in documents:
        kubernetes_validate.validate(document, KUBE_VERSION, strict=True)


@needs_helm
@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed")
def test_dra_host_pid_is_an_opt_in_rendered_as_the_kustomize_component_renders_it(tmp_path):
    """dra.hostPID (default false: not rendered) puts the driver in the host's PID namespace, for the kill policy;
    daemonset/dra/optional/host-pid does the same, and the two pods are equal with it as without it."""
    assert "hostPID" not in by_kind(render(DRA))[("DaemonSet", "gpu-share-dra")]["spec"]["template"]["spec"]
    chart = by_kind(render({**DRA, "dra.hostPID": "true"}))[("DaemonSet", "gpu-share-dra")]
    assert chart["spec"]["template"]["spec"]["hostPID"] is True
    copy = tmp_path / "dra"
    shutil.copytree(ROOT / "daemonset" / "dra", copy)
    kustomization = copy / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace("# components:\n#   - optional/dra-only\n#   - optional/host-pid",
                                                               "components:\n  - optional/host-pid"))
    proc = subprocess.run(["kubectl", "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    kustomized = by_kind([d for d in yaml.safe_load_all(proc.stdout) if d])[("DaemonSet", "gpu-share-dra")]
    assert _pod_spec(chart) == _pod_spec(kustomized)
    proc = helm("template", "gs", str(CHART), "--set=dra.enabled=true", "--set=dra.hostPID=yes", check=False)
    assert proc.returncode != 0 and "hostPID" in proc.stderr  # the schema: a boolean


@needs_helm
def test_dra_only_adds_its_policy_and_needs_the_plugin_off():
    base = set(by_kind(render({**DRA, "plugin.enabled": "false"})))
    documents = render(DRA_ONLY)
    assert set(by_kind(documents)) - base == {("ValidatingAdmissionPolicy", "gpu-share-dra-only-share-requests"),
                                              ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-only-share-requests")}
    assert ("ConfigMap", "gpu-share-config") in base  # the driver mounts the config without the plugin too
    for document in documents:
        kubernetes_validate.validate(document, KUBE_VERSION, strict=True)
    proc = helm("template", "gs", str(CHART), "--set", "dra.enabled=true,dra.draOnly=true", check=False)
    assert proc.returncode != 0 and "dra.draOnly: refuses every pod asking example.com/gpu-share, which the device plugin serves" in proc.stderr
    # The driver reads the same config: a domain key of its own is refused without the plugin too.
    proc = helm("template", "gs", str(CHART), "--set", "dra.enabled=true,plugin.enabled=false,admission.enabled=false",
                "--set-string", "config=version: v1\ndomain: acme.io\n", check=False)
    assert proc.returncode != 0 and "config: its domain key (acme.io) differs from the chart's domain (example.com)" in proc.stderr, proc.stderr


# --- the admission params ------------------------------------------------------------------------------------


def _shown_limits(config: Path, node_file: Path) -> dict[str, int]:
    """The largest `N shares of` per shared resource that `config check --all-profiles` prints on the node."""
    lines: list[str] = []
    try:
        check_config(str(config), str(node_file), None, True, out=lines.append)
    except ConfigError:
        pass  # a profile failing there counts nothing, as in the params
    limits: dict[str, int] = {}
    resource = None
    for line in lines:
        header = re.match(r"^  (\S+) \(shared, (timeSlicing|mps)\):", line)
        if header or re.match(r"^  \S+ \(", line):
            resource = header[1] if header else None
        shares = re.match(r"^    GPU .*: (\d+) shares of", line)
        if shares and resource:
            limits[resource] = max(limits.get(resource, 0), int(shares[1]))
    return limits


@pytest.mark.parametrize("node_file", NODES, ids=lambda p: p.stem)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_admission_params_equal_what_config_check_shows(config, node_file):
    parsed = load_config(config)
    span = {p.resource for pools in parsed.profiles.values() for p in pools if p.allow_span}
    shown = {name: n for name, n in _shown_limits(config, node_file).items() if name not in span}
    assert fleet_limits(parsed, [node(node_file.stem)]).limits == shown


def test_shipped_params_are_computed_from_the_shipped_config():
    nodes = [str(n) for n in NODES]
    (params,) = [d for d in yaml.safe_load_all((ROOT / "daemonset" / "admission" / "params.yaml").read_text()) if d]
    assert params == yaml.safe_load(admission_params(str(CONFIG), nodes, chart_values=False))
    values = yaml.safe_load((CHART / "values.yaml").read_text())["admission"]
    computed = yaml.safe_load(admission_params(str(CONFIG), nodes, chart_values=True))["admission"]
    assert {k: values[k] for k in ("configSha256", "limits")} == computed
    assert computed["configSha256"] == config_sha256(CONFIG.read_text()) and computed["limits"] == {"gpu-share": "20"}


def test_admission_params_command_needs_nodes_for_memory_per_share():
    proc = subprocess.run([*GPU_CLI, "config", "admission-params", str(CONFIG)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "profiles.inference.pools[0].memoryPerShare: the share count depends on the GPU's memory: give --node FILE" in proc.stderr
    proc = subprocess.run([*GPU_CLI, "config", "admission-params", str(EXAMPLES / "config" / "default.yaml")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["data"] == {"limits": "{'gpu-share': 10}"}


# --- against a real API server ---------------------------------------------------------------------------


def _kubectl(controlplane, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    kubectl = controlplane.bin / "kubectl" if (controlplane.bin / "kubectl").is_file() else shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    return subprocess.run([str(kubectl), f"--kubeconfig={controlplane.admin_kubeconfig}", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def _share_pod(name: str, resource: str, count: int) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "containers": [{"name": "server", "image": "busybox", "resources": {"limits": {resource: str(count)}}}]}})


@needs_helm
def test_chart_output_passes_server_side_dry_run(controlplane):
    namespace = f"gs-chart-{os.getpid()}"
    assert _kubectl(controlplane, "create", "namespace", namespace).returncode == 0
    for values in ({**EVERY_COMPONENT, **DRA}, DRA_ONLY):
        documents = [d for d in render({"domain": "acme.io", **values}, namespace=namespace)
                     if d["kind"] != "ServiceMonitor" and "helm.sh/hook" not in d["metadata"].get("annotations", {})]  # no CRD; helm test's own
        proc = _kubectl(controlplane, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(documents))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("(server dry run)") == len(documents), proc.stdout


@needs_helm
def test_helm_install_under_another_domain_admits_exactly_what_one_gpu_holds(controlplane):
    """`helm install --set domain=acme.io` on a real API server: every component installs, and the admission policy
    refuses 21 shares of acme.io/gpu-share and admits 20 (the most one 80 GB GPU has under the shipped inference
    profile); `helm uninstall` removes it all."""
    namespace = f"gs-helm-{os.getpid()}"
    assert _kubectl(controlplane, "create", "namespace", namespace).returncode == 0
    assert _kubectl(controlplane, "create", "serviceaccount", "default", "-n", namespace).returncode == 0  # no SA controller
    kubeconfig = f"--kubeconfig={controlplane.admin_kubeconfig}"
    sets = [f"--set={k}={v}" for k, v in {"domain": "acme.io", "image.repository": "registry.acme.io/gpu-share", **EVERY_COMPONENT}.items()
            if k != "serviceMonitor.enabled"]  # no Prometheus Operator CRD there
    policies_before = _kubectl(controlplane, "get", "validatingadmissionpolicies", "-o", "name").stdout.split()  # other tests' too
    helm("install", "gpu-share", str(CHART), "--namespace", namespace, kubeconfig, *sets)
    try:
        proc = _kubectl(controlplane, "get", "daemonsets,deployments", "-n", namespace, "-o", "name")
        assert sorted(proc.stdout.split()) == ["daemonset.apps/gpu-share", "daemonset.apps/gpu-share-mps-mps",
                                               "deployment.apps/gpu-share-extender", "deployment.apps/gpu-share-scheduler"], proc.stdout + proc.stderr
        deadline = time.monotonic() + 30
        while True:  # the API server loads a new policy within about a second
            proc = _kubectl(controlplane, "create", "--dry-run=server", "-n", namespace, "-f", "-", stdin=_share_pod("big", "acme.io/gpu-share", 21))
            if "asks for 21" in proc.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert proc.returncode != 0 and (
            "container server asks for 21 acme.io/gpu-share but no GPU has more than 20: one container's shares come from one GPU. "
            "Ask for at most 20 acme.io/gpu-share, or for a whole GPU (acme.io/gpu)") in proc.stderr, proc.stderr
        for resource, count in (("acme.io/gpu-share", 20), ("example.com/gpu-share", 50), ("acme.io/gpu", 8)):
            proc = _kubectl(controlplane, "create", "--dry-run=server", "-n", namespace, "-f", "-", stdin=_share_pod("ok", resource, count))
            assert proc.returncode == 0, (resource, count, proc.stderr)
    finally:
        helm("uninstall", "gpu-share", "--namespace", namespace, kubeconfig)
    proc = _kubectl(controlplane, "get", "validatingadmissionpolicies", "-o", "name")
    assert sorted(proc.stdout.split()) == sorted(policies_before), proc.stdout  # uninstall removed what the chart installed


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed")
def test_kustomization_output_passes_server_side_dry_run(controlplane, tmp_path):
    namespace = f"gs-kustomize-{os.getpid()}"
    assert _kubectl(controlplane, "create", "namespace", namespace).returncode == 0
    documents = [d for d in _kustomize(tmp_path, namespace) if d["kind"] != "Namespace"]  # created above
    proc = _kubectl(controlplane, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(documents))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(server dry run)") == len(documents), proc.stdout


def test_changelog_heads_with_the_package_version():
    first = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert first.split()[1] == __version__, first


NODE_PLUGINS = {"gpu-share", "gpu-share-dra"}  # the pods that open device nodes
HOSTILE = [  # values a template once pasted unquoted into YAML: each must be refused by the schema
    {"plugin.priorityClassName": "x\n      hostPID: true\n      hostNetwork: true"},
    {"plugin.runtimeClassName": "x\n      hostIPC: true"},
    {"mps.enabled": "true", "mps.priorityClassName": "x\n      hostNetwork: true"},
    {"dra.enabled": "true", "dra.runtimeClassName": "x\n      hostPID: true"},
    {"extender.enabled": "true", "scheduler.enabled": "true", "scheduler.image": "a\n          securityContext: {privileged: true}"},
    {"extender.enabled": "true", "extender.policy": "x\n            - --kubeconfig=/host"},
    {"extender.enabled": "true", "extender.managedResources[0]": "x\n      ignorable: true"},
    {"extender.enabled": "true", "scheduler.enabled": "true", "scheduler.name": "x\n  hostPID: true"},
    {"image.repository": "a\n          securityContext: {privileged: true}"},
    {"image.tag": "1\n          securityContext: {privileged: true}"},
    {"serviceMonitor.enabled": "true", "serviceMonitor.interval": "30s\n  hostPID: true"},
]


@needs_helm
@pytest.mark.parametrize("values", HOSTILE)
def test_hostile_values_are_refused_naming_the_key(values):
    proc = helm("template", "gs", str(CHART), *[f"--set-string={k}={v}" if k.endswith(("Name", "image", "policy", "]", "repository", "tag", "interval", ".name"))
                                               else f"--set={k}={v}" for k, v in values.items()], check=False)
    assert proc.returncode != 0, proc.stdout
    key = next(k for k in values if not k.endswith(".enabled"))
    assert f"at '/{key.replace('.', '/').replace('[0]', '/0')}'" in proc.stderr, proc.stderr


@needs_helm
def test_no_value_renders_a_host_namespace_beyond_the_plugins_needs():
    """Every component on: no host namespaces (the plugin's kill policy adds hostPID, off by default), privileged only
    in the node plugins (the device plugin, the DRA driver: device nodes), and no hostPath of the host's `/`."""
    for document in render({**EVERY_COMPONENT, **DRA}):
        spec = document.get("spec", {}).get("template", {}).get("spec") or (document["spec"] if document["kind"] == "Pod" else None)
        if not spec:
            continue
        assert not any(spec.get(k) for k in ("hostPID", "hostIPC", "hostNetwork")), document["metadata"]["name"]
        if document["metadata"]["name"] not in NODE_PLUGINS:
            assert not any((c.get("securityContext") or {}).get("privileged") for c in spec["containers"]), document["metadata"]["name"]
        assert all(v["hostPath"]["path"].rstrip("/") for v in spec.get("volumes", []) if "hostPath" in v), document["metadata"]["name"]


@needs_helm
@pytest.mark.parametrize("key, hint", [("schedular.enabled", "additional properties 'schedular' not allowed"),
                                       ("dashboard.enabled", "additional properties 'dashboard' not allowed"),
                                       ("nodeSelector.pool", "set it per component, e.g. plugin.nodeSelector"),
                                       ("tolerations[0].key", "set it per component, e.g. plugin.tolerations")])
def test_unknown_top_level_keys_are_refused_by_name(key, hint):
    proc = helm("template", "gs", str(CHART), f"--set={key}=x" if not key.endswith("enabled") else f"--set={key}=true", check=False)
    assert proc.returncode != 0 and hint in proc.stderr, proc.stderr


def _rules(document: dict) -> list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    """A ClusterRole's rules, one (apiGroups, resources, verbs) per rule, in order."""
    return [(tuple(r.get("apiGroups", ())), tuple(r.get("resources", ())), tuple(r.get("verbs", ()))) for r in document["rules"]]


@needs_helm
@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed")
@pytest.mark.parametrize("scoring", [{"dra.enabled": "true"}, {"extender.dra.enabled": "true"}])
def test_the_extenders_rbac_follows_its_dra_flag_rule_by_rule(tmp_path, scoring):
    """Scoring DRA claims (dra.enabled, or extender.dra.enabled for a driver installed apart) passes --dra-class and
    grants the kustomization's resource.k8s.io reads; without it, the chart grants only the core reads."""
    kustomized = by_kind(_kustomize(tmp_path))[("ClusterRole", "gpu-share-extender")]
    dra_rule = (("resource.k8s.io",), ("resourceslices", "resourceclaims", "resourceclaimtemplates"), ("get", "list", "watch"))
    assert dra_rule in _rules(kustomized)
    with_dra = by_kind(render({"extender.enabled": "true", **scoring}))
    assert _rules(with_dra[("ClusterRole", "gpu-share-extender")]) == _rules(kustomized)
    args = with_dra[("Deployment", "gpu-share-extender")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--dra-class=gpu-share-shares" in args
    without = by_kind(render({"extender.enabled": "true"}))
    assert _rules(without[("ClusterRole", "gpu-share-extender")]) == [r for r in _rules(kustomized) if r != dra_rule]
    assert not any(a.startswith("--dra-class") for a in without[("Deployment", "gpu-share-extender")]["spec"]["template"]["spec"]["containers"][0]["args"])


def _helm_section_commands() -> list[str]:
    """The shell commands of docs/install.md's Helm section, in order (continuations joined, comments dropped)."""
    text = (ROOT / "docs" / "install.md").read_text()
    section = text[text.index("\n## Helm\n"):text.index("\n## kustomize\n")]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line:
                commands.append(re.sub(r"\s+", " ", line))
    return commands


@needs_helm
def test_install_md_helm_commands_keep_the_release_values(controlplane, tmp_path):
    """docs/install.md's Helm section, command by command, on a real API server with the domain acme.io: after the
    DRA and admission-params upgrades the release still has its domain and image, the plugin still reads acme.io, and
    the admission policy refuses the too-big acme.io/gpu-share pod."""
    namespace, node_name = f"gs-docs-{os.getpid()}", f"gpu-node-{os.getpid()}"
    assert _kubectl(controlplane, "create", "-f", "-", stdin=yaml.safe_dump({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node_name}})).returncode == 0
    shutil.copy(CONFIG, tmp_path / "my-config.yaml")
    shutil.copy(EXAMPLES / "nodes" / "2xT4.yaml", tmp_path / "node-a.json")  # YAML is JSON's superset: the CLI reads both
    shutil.copy(EXAMPLES / "nodes" / "8xH100-80GB.yaml", tmp_path / "node-b.json")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gpu-share").write_text(f"#!/bin/sh\nexec {sys.executable} -m deviceplugin.cli \"$@\"\n")
    (bin_dir / "gpu-share").chmod(0o755)
    kubectl = controlplane.bin / "kubectl" if (controlplane.bin / "kubectl").is_file() else shutil.which("kubectl")
    assert kubectl is not None and HELM is not None
    (bin_dir / "kubectl").symlink_to(kubectl)
    (bin_dir / "helm").symlink_to(HELM)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KUBECONFIG": str(controlplane.admin_kubeconfig),
           "PYTHONPATH": str(ROOT)}
    commands = _helm_section_commands()
    assert any("--set-file config=my-config.yaml" in c for c in commands) and any("dra.enabled=true" in c for c in commands)
    try:
        for command in commands:
            command = re.sub(r"(namespace|-n) gpu-share\b", rf"\1 {namespace}", command)
            command = command.replace("deploy/helm/gpu-share", str(CHART)).replace("<gpu-node>", node_name)
            if command.startswith("helm test"):
                continue  # its hook pod needs a kubelet: test_the_admission_policy_refuses_after_install_reenable_and_reinstall runs its check
            proc = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
            if "--dry-run=server" in command:  # the doc's liveness check: refused
                deadline = time.monotonic() + 30
                while "more than 19" not in proc.stderr and time.monotonic() < deadline:  # the updated policy loads within about a second
                    time.sleep(0.5)
                    proc = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
                assert proc.returncode != 0 and "container too-big asks for 21 acme.io/gpu-share but no GPU has more than 19" in proc.stderr, proc.stderr  # H100 80GB: 19 of 4 GiB
                continue
            assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
            if command.startswith("kubectl create namespace"):  # no ServiceAccount controller there
                assert _kubectl(controlplane, "create", "serviceaccount", "default", "-n", namespace).returncode == 0
        values = yaml.safe_load(helm("get", "values", "gpu-share", "-n", namespace, f"--kubeconfig={controlplane.admin_kubeconfig}", "-o", "yaml").stdout)
        assert values["domain"] == "acme.io" and values["image"]["repository"] == "registry.acme.io/gpu-share" and values["dra"]["enabled"]
        plugin = yaml.safe_load(_kubectl(controlplane, "get", "daemonset", "gpu-share", "-n", namespace, "-o", "yaml").stdout)
        env_entries = plugin["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "GPU_SHARE_DOMAIN", "value": "acme.io"} in env_entries
        proc = _kubectl(controlplane, "create", "--dry-run=server", "-n", namespace, "-f", "-", stdin=_share_pod("big", "acme.io/gpu-share", 21))
        deadline = time.monotonic() + 30
        while "asks for 21" not in proc.stderr and time.monotonic() < deadline:  # the API server loads a policy within about a second
            time.sleep(0.5)
            proc = _kubectl(controlplane, "create", "--dry-run=server", "-n", namespace, "-f", "-", stdin=_share_pod("big", "acme.io/gpu-share", 21))
        assert proc.returncode != 0 and "asks for 21 acme.io/gpu-share" in proc.stderr, proc.stderr
    finally:
        helm("uninstall", "gpu-share", "--namespace", namespace, f"--kubeconfig={controlplane.admin_kubeconfig}", check=False)
        _kubectl(controlplane, "delete", "node", node_name)


def _refused_within(controlplane, namespace: str, resource: str, count: int) -> subprocess.CompletedProcess[str]:
    """The server-side dry run of a pod asking `count` of `resource`, once refused or after 30 s."""
    deadline = time.monotonic() + 30
    while True:  # the API server loads a new policy within about a second
        proc = _kubectl(controlplane, "create", "--dry-run=server", "-n", namespace, "-f", "-", stdin=_share_pod("big", resource, count))
        if proc.returncode != 0 or time.monotonic() > deadline:
            return proc
        time.sleep(0.5)


@needs_helm
def test_the_admission_policy_refuses_after_install_reenable_and_reinstall(controlplane):
    """install → admission off and on → uninstall → install, in another namespace and domain: after each step the
    21-share pod is refused (no params object whose informer could die, kubernetes/kubernetes#130887), and the chart's
    `helm test` check, run here with the admin's kubeconfig, says so."""
    namespace = f"gs-again-{os.getpid()}"
    assert _kubectl(controlplane, "create", "namespace", namespace).returncode == 0
    assert _kubectl(controlplane, "create", "serviceaccount", "default", "-n", namespace).returncode == 0  # no SA controller
    kubeconfig = f"--kubeconfig={controlplane.admin_kubeconfig}"
    hook = next(d for d in render({"domain": "acme.io"}, namespace=namespace) if d["kind"] == "Pod" and d["metadata"]["name"] == "gpu-share-admission-test")
    container = hook["spec"]["containers"][0]
    check_env = {**os.environ, "KUBECONFIG": str(controlplane.admin_kubeconfig), **{e["name"]: e["value"] for e in container["env"]}}
    steps = [("install", "--set=domain=acme.io"), ("upgrade", "--reset-then-reuse-values", "--set=admission.enabled=false"),
             ("upgrade", "--reset-then-reuse-values", "--set=admission.enabled=true"), ("uninstall",), ("install", "--set=domain=acme.io")]
    try:
        for verb, *flags in steps:
            helm(verb, "gpu-share", *([str(CHART)] if verb != "uninstall" else []), "--namespace", namespace, kubeconfig, *flags)
            if verb == "uninstall" or "--set=admission.enabled=false" in flags:
                continue
            proc = _refused_within(controlplane, namespace, "acme.io/gpu-share", 21)
            assert proc.returncode != 0 and "asks for 21 acme.io/gpu-share but no GPU has more than 20" in proc.stderr, (verb, flags, proc.stderr)
            check = subprocess.run([sys.executable, "-c", container["args"][0]], env=check_env, capture_output=True, text=True, timeout=60)
            assert check.returncode == 0 and "refused, as it should be: 21 acme.io/gpu-share" in check.stdout, (verb, check.stdout, check.stderr)
    finally:
        helm("uninstall", "gpu-share", "--namespace", namespace, kubeconfig, check=False)
    deadline = time.monotonic() + 30
    while True:  # uninstalled: once the API server drops the policy, the check fails, loudly
        check = subprocess.run([sys.executable, "-c", container["args"][0]], env=check_env, capture_output=True, text=True, timeout=60)
        if check.returncode != 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert check.returncode == 1 and "is not enforcing" in check.stderr, check.stderr


@needs_helm
@pytest.mark.parametrize("root, says", [("/", "must not be /:"), ("/etc/gpu", "must not be inside /etc:"), ("/run", "must not be /run:"),
                                        ("/a/../b", "must be an absolute, normalised path"), ("/srv/mps/", "must be an absolute, normalised path")])
def test_the_chart_refuses_an_mps_root_the_plugin_refuses(root, says, tmp_path):
    """The MPS DaemonSet mounts mpsRoot from the host: the chart applies the plugin's own rule (config/paths.py)."""
    from deviceplugin.config.paths import mps_root_problem

    text = f"version: v1\nmpsRoot: {root}\npools: [{{name: quick, mode: shared, backend: mps, replicas: 4}}]\n"
    assert mps_root_problem(root) is not None  # the plugin refuses it too
    (tmp_path / "config.yaml").write_text(text)
    proc = helm("template", "gs", str(CHART), "--set", "mps.enabled=true", "--set", "admission.enabled=false",
                f"--set-file=config={tmp_path / 'config.yaml'}", check=False)
    assert proc.returncode != 0 and f"config: mpsRoot: {says}" in proc.stderr, proc.stderr


def test_the_charts_files_are_copies_of_the_kustomization_sources():
    """No symlinks in the chart (a copied or packaged chart carries its files); deploy/helm/sync-files.py keeps them
    equal to daemonset/'s."""
    assert not [p for p in CHART.rglob("*") if p.is_symlink()]
    proc = subprocess.run([sys.executable, str(ROOT / "deploy" / "helm" / "sync-files.py"), "--check"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert {str(p.relative_to(CHART / "files")) for p in (CHART / "files").rglob("*") if p.is_file()} == {
        "admission-policy.yaml", "config.yaml", "gpu-share-dashboard.json", "dra/01-rbac.yaml", "dra/02-deviceclasses.yaml",
        "dra/04-slice-policy.yaml", "dra/05-share-mapping-policy.yaml", "dra/06-node-patch-policy.yaml", "dra/dra-only-policy.yaml"}


@needs_helm
def test_a_packaged_chart_renders_from_a_copy_like_the_chart(tmp_path):
    helm("package", str(CHART), "--destination", str(tmp_path))
    (package,) = tmp_path.glob("gpu-share-*.tgz")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(package, elsewhere / package.name)
    shutil.copytree(CHART, elsewhere / "chart")
    values = {"domain": "acme.io", **EVERY_COMPONENT, **DRA}
    expected = render(values)
    sets = [f"--set={k}={v}" for k, v in values.items()]
    for source in (elsewhere / package.name, elsewhere / "chart"):
        proc = helm("template", "gs", str(source), "--namespace", "gpu-share", *sets)
        assert "symbolic link" not in proc.stderr
        assert [d for d in yaml.safe_load_all(proc.stdout) if d] == expected, source

"""The Helm chart (deploy/helm/gpu-share), rendered by the real helm binary: lint, every toggle, a non-default domain
reaching every object, the settings it derives from the config, the same objects as the kustomization, and the
admission params equal to what `config check` shows for every shipped config on every shipped node."""

from __future__ import annotations

import http.client
import os
import re
import shutil
import ssl
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
from deviceplugin.model.quantity import quantity_mib
from tests.support.pki import CLIENT_NAME, SERVER_NAME, Pki, call, client_context

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
needs_helm = pytest.mark.skipif(
    HELM is None, reason="helm is not installed (.ci/install-helm installs it into .venv/bin)"
)
EVERY_COMPONENT = {
    "mps.enabled": "true",
    "extender.enabled": "true",
    "scheduler.enabled": "true",
    "serviceMonitor.enabled": "true",
    "dashboards.enabled": "true",
}
DRA = {
    "dra.enabled": "true"
}  # not in EVERY_COMPONENT: the helm install test shares its API server with tests/e2e's DRA objects
DRA_OBJECTS = {
    ("ServiceAccount", "gpu-share-dra"),
    ("ClusterRole", "gpu-share-dra"),
    ("ClusterRoleBinding", "gpu-share-dra"),
    ("DaemonSet", "gpu-share-dra"),
    ("DeviceClass", "gpu-share-gpu"),
    ("DeviceClass", "gpu-share-mig"),
    ("DeviceClass", "gpu-share-shares"),
    ("ValidatingAdmissionPolicy", "gpu-share-dra-own-node-slices"),
    ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-own-node-slices"),
    ("ValidatingAdmissionPolicy", "gpu-share-dra-no-share-mapping"),
    ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-no-share-mapping"),
    ("ValidatingAdmissionPolicy", "gpu-share-dra-capacity-convention"),
    ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-capacity-convention"),
    ("ValidatingAdmissionPolicy", "gpu-share-dra-own-node"),
    ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-own-node"),
}
DRA_ONLY = {"dra.enabled": "true", "dra.draOnly": "true", "plugin.enabled": "false"}
CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "DeviceClass",
}


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
    assert sorted(by_kind(documents)) == sorted(
        [
            ("ServiceAccount", "gpu-share"),
            ("ClusterRole", "gpu-share-node"),
            ("ClusterRoleBinding", "gpu-share-node"),
            ("ClusterRole", "gpu-share-pods"),
            ("ClusterRoleBinding", "gpu-share-pods"),
            ("ConfigMap", "gpu-share-config"),
            ("DaemonSet", "gpu-share"),
            ("Service", "gpu-share-metrics"),
            ("ValidatingAdmissionPolicy", "gpu-share-own-node"),
            ("ValidatingAdmissionPolicyBinding", "gpu-share-own-node"),
            ("ValidatingAdmissionPolicy", "gpu-share-shares-per-gpu"),
            ("ValidatingAdmissionPolicyBinding", "gpu-share-shares-per-gpu"),
            ("ServiceAccount", "gpu-share-admission-test"),
            ("Role", "gpu-share-admission-test"),  # helm test's hook
            ("RoleBinding", "gpu-share-admission-test"),
            ("Pod", "gpu-share-admission-test"),
        ]
    )
    for document in documents:
        kubernetes_validate.validate(document, KUBE_VERSION, strict=True)
    plugin = by_kind(documents)[("DaemonSet", "gpu-share")]["spec"]["template"]["spec"]
    assert plugin["containers"][0]["image"] == f"ghcr.io/example/gpu-share:{__version__}"
    assert "hostPID" not in plugin and "runtimeClassName" not in plugin


TOGGLES = {
    "mps.enabled": {("DaemonSet", "gpu-share-mps")},
    "extender.enabled": {
        ("ServiceAccount", "gpu-share-extender"),
        ("ClusterRole", "gpu-share-extender"),
        ("ClusterRoleBinding", "gpu-share-extender"),
        ("Deployment", "gpu-share-extender"),
        ("Service", "gpu-share-extender"),
        ("ConfigMap", "gpu-share-scheduler-extender"),
        ("Secret", "gpu-share-extender-tls"),
        ("Secret", "gpu-share-scheduler-tls"),
        ("NetworkPolicy", "gpu-share-extender"),
    },
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
    assert (
        not {k for k in kept if k[0].startswith("ValidatingAdmissionPolicy")}
        and ("ConfigMap", "gpu-share-admission-limits") not in kept
    )
    assert not render({"plugin.enabled": "false", "admission.enabled": "false"})
    proc = helm("template", "gs", str(CHART), "--set", "scheduler.enabled=true", check=False)
    assert (
        proc.returncode != 0
        and "scheduler.enabled: the second scheduler calls the extender: set extender.enabled=true" in proc.stderr
    )


@needs_helm
def test_a_domain_reaches_every_component_and_no_example_com_is_left():
    sets = {
        "domain": "acme.io",
        "image.repository": "registry.acme.io/gpu-share",
        "image.tag": "9.9.9",
        **EVERY_COMPONENT,
        **DRA,
    }
    proc = helm("template", "gs", str(CHART), "--namespace", "gpu-system", *[f"--set={k}={v}" for k, v in sets.items()])
    assert "example.com" not in proc.stdout  # comments included
    documents = [d for d in yaml.safe_load_all(proc.stdout) if d]
    objects = by_kind(documents)
    for name in ("gpu-share", "gpu-share-mps"):
        spec = objects[("DaemonSet", name)]["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert container["image"] == "registry.acme.io/gpu-share:9.9.9"
        assert {"name": "GPU_SHARE_DOMAIN", "value": "acme.io"} in container["env"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert all(
            {"key": "acme.io/gpu-share.enabled", "operator": "In", "values": ["true"]} in t["matchExpressions"]
            for t in terms
        )
    mps_terms = objects[("DaemonSet", "gpu-share-mps")]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert {"key": "acme.io/gpu-share.config", "operator": "In", "values": ["mps"]} in mps_terms[0]["matchExpressions"]
    extender = objects[("Deployment", "gpu-share-extender")]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "GPU_SHARE_DOMAIN", "value": "acme.io"} in extender["env"] and extender[
        "image"
    ] == "registry.acme.io/gpu-share:9.9.9"
    scheduler = yaml.safe_load(objects[("ConfigMap", "gpu-share-scheduler-config")]["data"]["config.yaml"])
    call, every_pod = scheduler["extenders"]
    assert every_pod["urlPrefix"] == "https://gpu-share-extender.gpu-system.svc:8888/all"
    assert call["urlPrefix"] == "https://gpu-share-extender.gpu-system.svc:8888"
    assert (
        call["tlsConfig"]["serverName"] == every_pod["tlsConfig"]["serverName"] == "gpu-share-extender.gpu-system.svc"
    )
    assert {r["name"] for r in call["managedResources"]} >= {"acme.io/gpu-share", "acme.io/gpu"}
    assert all(r["name"].startswith("acme.io/") for r in call["managedResources"])
    assert _policy_variables(objects)["domain"] == "'acme.io'"
    dra = objects[("DaemonSet", "gpu-share-dra")]["spec"]["template"]["spec"]
    assert dra["containers"][0]["image"] == "registry.acme.io/gpu-share:9.9.9"
    assert {"name": "GPU_SHARE_DOMAIN", "value": "acme.io"} in dra["containers"][0]["env"]
    assert {v["hostPath"]["path"] for v in dra["volumes"] if v["name"] == "plugin-data"} == {
        "/var/lib/kubelet/plugins/gpu-share.acme.io"
    }
    classes = {name: d["spec"] for (kind, name), d in objects.items() if kind == "DeviceClass"}
    assert classes["gpu-share-gpu"]["extendedResourceName"] == "acme.io/gpu"
    assert all("'gpu-share.' + 'acme.io'" in c["selectors"][0]["cel"]["expression"] for c in classes.values())
    mapping = objects[("ValidatingAdmissionPolicy", "gpu-share-dra-no-share-mapping")]["spec"]["validations"][0][
        "expression"
    ]
    assert "'acme.io' + '/gpu-share'" in mapping
    assert objects[("ClusterRoleBinding", "gpu-share-dra")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpu-share-dra", "namespace": "gpu-system"}
    ]
    only = by_kind(render({"domain": "acme.io", **DRA_ONLY}))[
        ("ValidatingAdmissionPolicy", "gpu-share-dra-only-share-requests")
    ]
    assert only["spec"]["variables"][0]["expression"] == "'acme.io' + '/gpu-share'"
    binding = objects[("ValidatingAdmissionPolicyBinding", "gpu-share-shares-per-gpu")]["spec"]
    assert binding == {
        "policyName": "gpu-share-shares-per-gpu",
        "validationActions": ["Deny"],
    }  # no params: nothing to lose
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
    documents = render(
        {
            "plugin.runtimeClassName": "nvidia",
            "plugin.priorityClassName": "gpu-critical",
            "plugin.nodeSelector.pool": "gpu",
            "plugin.extraArgs[0]": "--health-recovery=600",
            "plugin.extraEnv[0].name": "FAIL_ON_INIT_ERROR",
            "plugin.resources.limits.memory": "512Mi",
            "plugin.tolerations[0].key": "gpu",
            "plugin.tolerations[0].operator": "Exists",
            "image.digest": "sha256:" + "a" * 64,
        },
        "--set-string",
        "plugin.extraEnv[0].value=false",
    )
    spec = by_kind(documents)[("DaemonSet", "gpu-share")]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert (
        spec["runtimeClassName"] == "nvidia"
        and spec["priorityClassName"] == "gpu-critical"
        and spec["nodeSelector"] == {"pool": "gpu"}
    )
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert container["args"][-1] == "--health-recovery=600" and container["env"][-1] == {
        "name": "FAIL_ON_INIT_ERROR",
        "value": "false",
    }
    assert container["resources"] == {"limits": {"memory": "512Mi"}}  # a component's key replaces the built-in one
    assert container["image"] == "ghcr.io/example/gpu-share@sha256:" + "a" * 64
    build_parser().parse_args(["run", *container["args"]])  # every flag the chart passes exists


def _policy_variables(objects: dict[tuple[str, str], dict]) -> dict[str, str]:
    """The shares-per-GPU policy's variables, name to expression."""
    return {
        v["name"]: v["expression"]
        for v in objects[("ValidatingAdmissionPolicy", "gpu-share-shares-per-gpu")]["spec"]["variables"]
    }


def _with_config(text: str) -> list[str]:
    """helm flags installing `text` as the config, with the admission values computed for it."""
    values = yaml.safe_load(admission_params_for(text))
    return [
        "--set-string",
        "config=" + text.replace(",", "\\,"),
        "--set",
        f"admission.configSha256={values['admission']['configSha256']}",
    ] + [
        arg
        for name, count in values["admission"]["limits"].items()
        for arg in ("--set-string", f"admission.limits.{name}={count}")
    ]


def admission_params_for(text: str) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        file.write(text)
        file.flush()
        return admission_params(file.name, [str(n) for n in NODES], chart_values=True)


@needs_helm
def test_kill_policy_and_cdi_follow_the_installed_config():
    text = (
        "version: v1\ndeviceListStrategy: cdi\nmemoryWatchdog: {policy: kill}\n"
        "pools: [{name: s, mode: shared, replicas: 4}]\n"
    )
    documents = render(None, *_with_config(text))
    spec = by_kind(documents)[("DaemonSet", "gpu-share")]["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and spec["containers"][0]["securityContext"]["capabilities"]["add"] == ["KILL"]
    assert {"/etc/cdi", "/var/run/cdi"} <= {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert _policy_variables(by_kind(documents))["limits"] == "{'gpu-share': 4}"
    assert by_kind(documents)[("ConfigMap", "gpu-share-config")]["data"]["config.yaml"] == text


@needs_helm
@pytest.mark.parametrize("config", sorted((EXAMPLES / "config").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_config_installs_under_another_domain(config):
    """The example configs carry no domain key of their own, so the chart's `domain` applies to them."""
    proc = helm(
        "template",
        "gs",
        str(CHART),
        "--set",
        "domain=acme.io",
        "--set",
        "admission.enabled=false",
        f"--set-file=config={config}",
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "domain:" not in config.read_text()


@needs_helm
def test_a_config_without_its_admission_values_is_refused_by_name():
    proc = helm(
        "template", "gs", str(CHART), "--set-file", f"config={EXAMPLES / 'config' / 'default.yaml'}", check=False
    )
    assert proc.returncode != 0
    assert (
        "admission: its limits were computed for another config" in proc.stderr
        and "gpu-share config admission-params" in proc.stderr
    )
    for values, message in (
        ({"domain": "Bad_Domain"}, "- at '/domain': 'Bad_Domain' does not match pattern"),
        (
            {"admission.limits.gpu-share": "many"},
            "- at '/admission/limits/gpu-share': 'many' does not match pattern '^[0-9]+$'",
        ),
        ({"plugin.nodeSelecter.pool": "gpu"}, "- at '/plugin': additional properties 'nodeSelecter' not allowed"),
        ({"imge.repository": "x"}, "- at '': additional properties 'imge' not allowed"),  # a typo, refused by name
        ({"plugin.metricsPort": "http"}, "- at '/plugin/metricsPort': got string, want integer"),
        ({"dra.enabled": "true", "dra.draOnly": "yes"}, "- at '/dra/draOnly': got string, want boolean"),
    ):
        proc = helm("template", "gs", str(CHART), *[f"--set={k}={v}" for k, v in values.items()], check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    # Without the schema (--skip-schema-validation) the templates still refuse a bad domain by name.
    proc = helm("template", "gs", str(CHART), "--skip-schema-validation", "--set", "domain=Bad_Domain", check=False)
    assert (
        proc.returncode != 0 and 'domain: must be a DNS subdomain such as acme.io, got "Bad_Domain"' in proc.stderr
    ), proc.stderr


@needs_helm
def test_one_mps_daemonset_per_mps_pool_of_the_config_on_the_nodes_of_its_profiles():
    text = (
        "version: v1\ndefaultProfile: fast\nprofiles:\n"
        "  fast: {pools: [{name: quick, mode: shared, backend: mps, replicas: 4, exclusiveProcess: true}]}\n"
        "  both: {pools: [{name: quick, mode: shared, backend: mps, replicas: 4, gpus: {indexes: [0]}}, "
        "{name: big, mode: shared, backend: mps, replicas: 2, resource: big-share}]}\n"
        "  whole: {pools: [{name: w, mode: exclusive}]}\n"
    )
    objects = by_kind(render({"mps.enabled": "true"}, *_with_config(text)))
    assert {k for k in objects if k[0] == "DaemonSet"} == {
        ("DaemonSet", "gpu-share"),
        ("DaemonSet", "gpu-share-mps-quick"),
        ("DaemonSet", "gpu-share-mps-big"),
    }
    for pool, profiles, default in (("quick", ["both", "fast"], True), ("big", ["both"], False)):
        spec = objects[("DaemonSet", f"gpu-share-mps-{pool}")]["spec"]["template"]["spec"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms[0]["matchExpressions"][1] == {
            "key": "example.com/gpu-share.config",
            "operator": "In",
            "values": profiles,
        }
        assert (
            len(terms) == 2
            and terms[1]["matchExpressions"][1] == {"key": "example.com/gpu-share.config", "operator": "DoesNotExist"}
        ) == default
        shm = next(v for v in spec["volumes"] if v["name"] == "mps-shm")
        assert shm["hostPath"]["path"] == f"/run/gpu-share/mps/{pool}/shm"
        container = spec["containers"][0]
        assert f"--pools={pool}" in container["args"]
        assert container["securityContext"].get("privileged", False) == (
            pool == "quick"
        )  # exclusiveProcess sets compute modes
        kubernetes_validate.validate(objects[("DaemonSet", f"gpu-share-mps-{pool}")], KUBE_VERSION, strict=True)
        build_parser().parse_args(["mps", *container["args"]])
    proc = helm(
        "template",
        "gs",
        str(CHART),
        "--set",
        "mps.enabled=true",
        *_with_config("version: v1\npools: [{name: s, mode: shared}]\n"),
        check=False,
    )
    assert proc.returncode != 0 and "mps.enabled: the config has no pool with backend: mps" in proc.stderr


@needs_helm
def test_both_ways_of_calling_the_extender_are_the_shipped_scheduler_config():
    """The second scheduler's config and the `extenders` entry for the cluster's own scheduler equal
    daemonset/extender/scheduler/'s (kube-scheduler's field names: a typo would be silently ignored)."""
    objects = by_kind(render({"extender.enabled": "true", "scheduler.enabled": "true"}))
    shipped = yaml.safe_load(
        (ROOT / "daemonset" / "extender" / "scheduler" / "kube-scheduler-config.yaml").read_text()
    )["extenders"]
    way1 = yaml.safe_load(objects[("ConfigMap", "gpu-share-scheduler-extender")]["data"]["extenders.yaml"])["extenders"]
    way2 = yaml.safe_load(objects[("ConfigMap", "gpu-share-scheduler-config")]["data"]["config.yaml"])
    assert way1 == way2["extenders"] == shipped
    shipped_second = next(
        d
        for d in yaml.safe_load_all(
            (ROOT / "daemonset" / "extender" / "scheduler" / "second-scheduler.yaml").read_text()
        )
        if d and d["kind"] == "ConfigMap"
    )
    assert way2["profiles"] == yaml.safe_load(shipped_second["data"]["config.yaml"])["profiles"]


@needs_helm
def test_the_extender_manages_every_resource_the_config_advertises():
    """extender.managedResources plus each pool's own resource: examples/config/mig-mixed.yaml's mig-share, and the
    MIG profiles an A100/H100 80GB advertises (4g.40gb included)."""
    objects = by_kind(
        render(
            {"extender.enabled": "true", "admission.enabled": "false"},
            f"--set-file=config={EXAMPLES / 'config' / 'mig-mixed.yaml'}",
        )
    )
    call = yaml.safe_load(objects[("ConfigMap", "gpu-share-scheduler-extender")]["data"]["extenders.yaml"])[
        "extenders"
    ][0]
    names = [r["name"] for r in call["managedResources"]]
    assert names == [
        f"example.com/{n}"
        for n in (
            "gpu-share",
            "gpu",
            "mig-1g.10gb",
            "mig-1g.20gb",
            "mig-2g.20gb",
            "mig-3g.40gb",
            "mig-4g.40gb",
            "mig-7g.80gb",
            "mig-share",
        )
    ]


# --- one source of truth: the chart and the kustomization install the same objects ---------------------------


def _kustomize(tmp_path: Path, namespace: str = "gpu-share") -> list[dict]:
    """daemonset/ with the MPS and extender components, in `namespace`."""
    copy = tmp_path / "daemonset"
    shutil.copytree(ROOT / "daemonset", copy)
    kustomization = copy / "kustomization.yaml"
    text = (
        kustomization.read_text()
        .replace("#  - optional/mps", "  - optional/mps")
        .replace("#  - extender", "  - extender")
    )
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
    for ours, theirs in (
        (("DaemonSet", "gpu-share"),) * 2,
        (("DaemonSet", "gpu-share-mps"),) * 2,
        (("Deployment", "gpu-share-extender"),) * 2,
    ):
        assert _pod_spec(chart[ours]) == _pod_spec(kustomized[theirs]), ours
    assert chart[("ConfigMap", "gpu-share-config")]["data"] == kustomized[("ConfigMap", "gpu-share-config")]["data"]
    for key in (
        ("ValidatingAdmissionPolicy", "gpu-share-shares-per-gpu"),
        ("ClusterRole", "gpu-share-node"),
        ("ClusterRole", "gpu-share-pods"),
    ):
        assert chart[key].get("spec", chart[key].get("rules")) == kustomized[key].get(
            "spec", kustomized[key].get("rules")
        ), key


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
    kustomization.write_text(
        kustomization.read_text().replace(
            "# components:\n#   - optional/dra-only", "components:\n  - optional/dra-only"
        )
    )
    proc = subprocess.run(["kubectl", "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    kustomized = by_kind([d for d in yaml.safe_load_all(proc.stdout) if d])
    del kustomized[("ConfigMap", "gpu-share-dra-settings")]  # the kustomization's domain knob; the chart's is `domain`
    chart = {
        k: d
        for k, d in by_kind(render(DRA_ONLY)).items()
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "gpu-share-dra"
    }
    assert (
        set(chart)
        == set(kustomized)
        == DRA_OBJECTS
        | {
            ("ValidatingAdmissionPolicy", "gpu-share-dra-only-share-requests"),
            ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-only-share-requests"),
        }
    )
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
    assert terms(dra) == [
        {"matchExpressions": [{"key": "example.com/gpu-share.api", "operator": "In", "values": ["dra"]}, excluded]}
    ]
    own = {
        "dra.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].key": "pool",
        "dra.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].operator": "Exists",
        "dra.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[1].matchExpressions[0].key": "zone",
        "dra.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[1].matchExpressions[0].operator": "Exists",
    }
    dra = by_kind(render({**DRA, **own}))[("DaemonSet", "gpu-share-dra")]["spec"]["template"]["spec"]
    assert terms(dra) == [
        {"matchExpressions": [{"key": "pool", "operator": "Exists"}, excluded]},
        {"matchExpressions": [{"key": "zone", "operator": "Exists"}, excluded]},
    ]
    preferred = "dra.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
    dra = by_kind(
        render(
            {
                **DRA,
                f"{preferred}.weight": "1",
                f"{preferred}.preference.matchExpressions[0].key": "zone",
                f"{preferred}.preference.matchExpressions[0].operator": "Exists",
            }
        )
    )[("DaemonSet", "gpu-share-dra")]["spec"]["template"]["spec"]
    assert terms(dra) == [
        {"matchExpressions": [excluded]}
    ]  # an affinity without required node terms still gets the exclusion
    plugin_terms = (
        "plugin.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0]"
    )
    pool = {f"{plugin_terms}.key": "pool", f"{plugin_terms}.operator": "Exists"}
    assert render(pool)  # without the DRA driver the plugin's affinity is the user's
    proc = helm("template", "gs", str(CHART), *[f"--set={k}={v}" for k, v in {**DRA, **pool}.items()], check=False)
    assert (
        proc.returncode != 0
        and "plugin.affinity: with dra.enabled every nodeSelectorTerm must require example.com/gpu-share.enabled"
        in proc.stderr
    )
    kept = {f"{plugin_terms}.key": "example.com/gpu-share.enabled", f"{plugin_terms}.operator": "In"}
    assert ("DaemonSet", "gpu-share-dra") in by_kind(
        render({**DRA, **kept}, "--set-string", f"{plugin_terms}.values[0]=true")
    )


POD_COMPONENTS = {
    ("DaemonSet", "gpu-share"): "plugin",
    ("DaemonSet", "gpu-share-mps"): "mps",
    ("DaemonSet", "gpu-share-dra"): "dra",
    ("Deployment", "gpu-share-extender"): "extender",
    ("Deployment", "gpu-share-scheduler"): "scheduler",
}
GLOBAL_SETTINGS = {
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "example.com/gpu-share.enabled", "operator": "In", "values": ["true"]},
                            {"key": "zone", "operator": "In", "values": ["a"]},
                        ]
                    }
                ]
            }
        }
    },
    "resources": {"requests": {"cpu": "50m", "memory": "100Mi"}, "limits": {"memory": "300Mi"}},
    "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}},
}


def _render_values(tmp_path: Path, values: dict) -> dict[tuple[str, str], dict]:
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    return by_kind(render({**EVERY_COMPONENT, **DRA}, "-f", str(tmp_path / "values.yaml")))


def _settings(objects: dict[tuple[str, str], dict], key: tuple[str, str]) -> dict:
    """A component's five pod settings as rendered (the DRA driver's affinity without the term it always adds)."""
    spec = objects[key]["spec"]
    pod = spec["template"]["spec"]
    affinity = yaml.safe_load(yaml.safe_dump(pod.get("affinity")))
    for term in (
        dig(affinity, "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms") or []
    ):
        term["matchExpressions"] = [e for e in term["matchExpressions"] if e["operator"] != "NotIn"]
    return {
        "nodeSelector": pod.get("nodeSelector"),
        "tolerations": pod.get("tolerations"),
        "affinity": affinity,
        "resources": pod["containers"][0]["resources"],
        "updateStrategy": spec.get("updateStrategy"),
    }


def dig(value, *keys):
    for key in keys:
        value = (value or {}).get(key)
    return value


@needs_helm
def test_top_level_pod_settings_reach_every_component_and_a_components_own_wins(tmp_path):
    """NVIDIA-style top-level nodeSelector, tolerations, affinity, resources and updateStrategy reach the pods of every
    component (updateStrategy: the DaemonSets'); a component's own key, where set, wins over it; unset on both levels,
    the component keeps its built-in default. The DRA driver has an affinity of its own throughout: a top-level one
    keeps the plugin's opt-in label, where the driver never runs (refused for it, below)."""
    dra_affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "example.com/gpu-share.api", "operator": "In", "values": ["dra"]}]}
                ]
            }
        }
    }
    builtin = {key: _settings(_render_values(tmp_path, {}), key) for key in POD_COMPONENTS}
    objects = _render_values(tmp_path, {**GLOBAL_SETTINGS, "dra": {"affinity": dra_affinity}})
    for key, component in POD_COMPONENTS.items():
        got = _settings(objects, key)
        expected = {
            **GLOBAL_SETTINGS,
            "updateStrategy": GLOBAL_SETTINGS["updateStrategy"] if key[0] == "DaemonSet" else None,
            **({"affinity": dra_affinity} if component == "dra" else {}),
        }
        assert got == expected, component
        assert builtin[key] != got, component
    own = {
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "own", "operator": "Exists"}],
        "resources": {"limits": {"cpu": "2"}},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "example.com/gpu-share.enabled", "operator": "In", "values": ["true"]}
                            ]
                        }
                    ]
                }
            }
        },
    }
    for component in POD_COMPONENTS.values():  # each alone: the others keep the top-level settings
        mine = {**own, **({"updateStrategy": {"type": "OnDelete"}} if component in ("plugin", "mps", "dra") else {})}
        mine |= {"affinity": dra_affinity} if component == "dra" else {}
        objects = _render_values(tmp_path, {**GLOBAL_SETTINGS, "dra": {"affinity": dra_affinity}, component: mine})
        for key, other in POD_COMPONENTS.items():
            got = _settings(objects, key)
            if other == component:
                assert got == {**mine, "updateStrategy": mine.get("updateStrategy")}, component
            else:
                assert (
                    got["nodeSelector"] == GLOBAL_SETTINGS["nodeSelector"]
                    and got["resources"] == GLOBAL_SETTINGS["resources"]
                ), (component, other)
    for document in objects.values():
        if document["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(document, KUBE_VERSION, strict=True)
    hook = objects[("Pod", "gpu-share-admission-test")]["spec"]  # `helm test`'s pod gets them too, where it runs
    assert {k: hook.get(k) for k in ("nodeSelector", "tolerations", "affinity")} == {
        k: GLOBAL_SETTINGS[k] for k in ("nodeSelector", "tolerations", "affinity")
    }
    (tmp_path / "values.yaml").write_text(
        yaml.safe_dump(GLOBAL_SETTINGS)
    )  # the DRA driver would get the plugin's label
    proc = helm(
        "template", "gs", str(CHART), "--set", "dra.enabled=true", "-f", str(tmp_path / "values.yaml"), check=False
    )
    assert (
        proc.returncode != 0
        and "dra.affinity: a nodeSelectorTerm requires example.com/gpu-share.enabled" in proc.stderr
    ), proc.stderr
    assert "give the DRA driver a dra.affinity of its own" in proc.stderr


@needs_helm
def test_install_mds_pod_settings_example_renders_as_it_says(tmp_path):
    text = (ROOT / "docs" / "install.md").read_text()
    section = text[text.index("### Pod settings for every component") : text.index("### The DRA driver")]
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S)[1])
    objects = _render_values(tmp_path, example)
    for key, component in POD_COMPONENTS.items():
        got = _settings(objects, key)
        assert got["tolerations"] == example["tolerations"] and got["resources"] == example["resources"], component
        assert got["nodeSelector"] == ({"node-pool": "system"} if component == "extender" else {"node-pool": "gpu"}), (
            component
        )
        if key[0] == "DaemonSet":
            assert got["updateStrategy"] == (
                {"type": "OnDelete"} if component == "mps" else example["updateStrategy"]
            ), component


def test_builtin_pod_settings_are_the_kustomizations():
    """The chart's built-in defaults (templates/_helpers.tpl) are what daemonset/'s manifests set."""
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    builtins = yaml.safe_load(text[text.index('{{- define "gpu-share.builtins" -}}') + 35 :].split("{{- end -}}")[0])
    manifests = {
        "plugin": ROOT / "daemonset" / "03-daemonset.yaml",
        "mps": ROOT / "daemonset" / "optional" / "mps" / "mps-daemonset.yaml",
        "dra": ROOT / "daemonset" / "dra" / "03-daemonset.yaml",
        "extender": ROOT / "daemonset" / "extender" / "01-deployment.yaml",
    }
    for component, path in manifests.items():
        (workload,) = [
            d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] in ("DaemonSet", "Deployment")
        ]
        pod = workload["spec"]["template"]["spec"]
        assert builtins[component]["resources"] == pod["containers"][0]["resources"], component
        assert builtins[component].get("tolerations") == pod.get("tolerations"), component
        if workload["kind"] == "DaemonSet":
            assert builtins[component]["updateStrategy"] == workload["spec"]["updateStrategy"], component


@needs_helm
def test_dra_pod_settings_and_class_options_come_from_values():
    documents = render(
        {
            **DRA,
            "dra.runtimeClassName": "nvidia",
            "dra.priorityClassName": "gpu-critical",
            "dra.nodeSelector.pool": "gpu",
            "dra.extraArgs[0]": "--health-stream-interval=30",
            "dra.extraEnv[0].name": "KUBELET_ROOT",
            "dra.extraEnv[0].value": "/var/lib/k0s/kubelet",
            "dra.resources.limits.memory": "512Mi",
            "dra.tolerations[0].key": "gpu",
            "dra.tolerations[0].operator": "Exists",
            "dra.logFormat": "text",
            "dra.updateStrategy.rollingUpdate.maxSurge": "0",
            "dra.updateStrategy.rollingUpdate.maxUnavailable": "1",
            "dra.gpuExtendedResource": "false",
        }
    )
    objects = by_kind(documents)
    ds = objects[("DaemonSet", "gpu-share-dra")]["spec"]
    spec = ds["template"]["spec"]
    container = spec["containers"][0]
    assert (
        spec["runtimeClassName"] == "nvidia"
        and spec["priorityClassName"] == "gpu-critical"
        and spec["nodeSelector"] == {"pool": "gpu"}
    )
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}] and ds["updateStrategy"] == {
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}
    }
    assert container["args"][-2:] == ["--log-format=text", "--health-stream-interval=30"]
    assert container["env"][-1] == {"name": "KUBELET_ROOT", "value": "/var/lib/k0s/kubelet"}
    assert container["resources"]["limits"]["memory"] == "512Mi"
    assert "extendedResourceName" not in objects[("DeviceClass", "gpu-share-gpu")]["spec"]
    build_parser().parse_args(["run", *container["args"]])  # every flag the chart passes exists
    for document in documents:
        kubernetes_validate.validate(document, KUBE_VERSION, strict=True)


@needs_helm
def test_the_capacity_convention_follows_dra_capacity_and_the_configs_pools(tmp_path):
    """dra.capacity picks the capacity the policy lets claims name; its message's pools are the config's shared pools
    (memoryPerShare in MiB, replicas, the plugin's default of 10), as the kustomization's file holds for the shipped
    config (test_chart_and_dra_kustomization_install_the_same_objects)."""

    def variables(objects: dict[tuple[str, str], dict]) -> dict[str, str]:
        policy = objects[("ValidatingAdmissionPolicy", "gpu-share-dra-capacity-convention")]
        return {v["name"]: v["expression"] for v in policy["spec"]["variables"]}

    assert variables(by_kind(render(DRA)))["capacity"] == "'shares'"
    (tmp_path / "config.yaml").write_text(
        "version: v1\ndefaultProfile: small\nprofiles:\n"
        "  small: {pools: [{name: s, mode: shared, memoryPerShare: 1536Mi}, {name: w, mode: exclusive}]}\n"
        "  big: {pools: [{name: b, mode: shared, memoryPerShare: 8G}, {name: d, mode: shared}]}\n"
    )
    found = variables(
        by_kind(
            render(
                {**DRA, "dra.capacity": "memory", "admission.enabled": "false"},
                f"--set-file=config={tmp_path / 'config.yaml'}",
            )
        )
    )
    assert found["capacity"] == "'memory'"
    assert found["pools"] == (
        "[{'name': 'big/b', 'replicas': '0', 'mib': '7629'}, {'name': 'big/d', 'replicas': '10', 'mib': '0'}, "
        "{'name': 'small/s', 'replicas': '0', 'mib': '1536'}]"
    )
    assert quantity_mib("8G") == 7629 and quantity_mib("1536Mi") == 1536  # the plugin's own conversion
    proc = helm("template", "gs", str(CHART), "--set", "dra.enabled=true,dra.capacity=bytes", check=False)
    assert proc.returncode != 0 and "at '/dra/capacity': value must be one of 'shares', 'memory'" in proc.stderr, (
        proc.stderr
    )


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
    kustomization.write_text(
        kustomization.read_text().replace(
            "# components:\n#   - optional/dra-only\n#   - optional/host-pid", "components:\n  - optional/host-pid"
        )
    )
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
    assert set(by_kind(documents)) - base == {
        ("ValidatingAdmissionPolicy", "gpu-share-dra-only-share-requests"),
        ("ValidatingAdmissionPolicyBinding", "gpu-share-dra-only-share-requests"),
    }
    assert ("ConfigMap", "gpu-share-config") in base  # the driver mounts the config without the plugin too
    for document in documents:
        kubernetes_validate.validate(document, KUBE_VERSION, strict=True)
    proc = helm("template", "gs", str(CHART), "--set", "dra.enabled=true,dra.draOnly=true", check=False)
    assert (
        proc.returncode != 0
        and "dra.draOnly: refuses every pod asking example.com/gpu-share, which the device plugin serves" in proc.stderr
    )
    # The driver reads the same config: a domain key of its own is refused without the plugin too.
    proc = helm(
        "template",
        "gs",
        str(CHART),
        "--set",
        "dra.enabled=true,plugin.enabled=false,admission.enabled=false",
        "--set-string",
        "config=version: v1\ndomain: acme.io\n",
        check=False,
    )
    assert (
        proc.returncode != 0
        and "config: its domain key (acme.io) differs from the chart's domain (example.com)" in proc.stderr
    ), proc.stderr


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
    proc = subprocess.run(
        [*GPU_CLI, "config", "admission-params", str(CONFIG)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert (
        "profiles.inference.pools[0].memoryPerShare: the share count depends on the GPU's memory: give --node FILE"
        in proc.stderr
    )
    proc = subprocess.run(
        [*GPU_CLI, "config", "admission-params", str(EXAMPLES / "config" / "default.yaml")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["data"] == {"limits": "{'gpu-share': 10}"}


# --- against a real API server ---------------------------------------------------------------------------


def _kubectl(controlplane, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    kubectl = controlplane.bin / "kubectl" if (controlplane.bin / "kubectl").is_file() else shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    return subprocess.run(
        [str(kubectl), f"--kubeconfig={controlplane.admin_kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _share_pod(name: str, resource: str, count: int) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "containers": [{"name": "server", "image": "busybox", "resources": {"limits": {resource: str(count)}}}]
            },
        }
    )


@needs_helm
def test_chart_output_passes_server_side_dry_run(controlplane):
    namespace = f"gs-chart-{os.getpid()}"
    assert _kubectl(controlplane, "create", "namespace", namespace).returncode == 0
    for values in ({**EVERY_COMPONENT, **DRA}, DRA_ONLY):
        documents = [
            d
            for d in render({"domain": "acme.io", **values}, namespace=namespace)
            if d["kind"] != "ServiceMonitor" and "helm.sh/hook" not in d["metadata"].get("annotations", {})
        ]  # no CRD; helm test's own
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
    assert (
        _kubectl(controlplane, "create", "serviceaccount", "default", "-n", namespace).returncode == 0
    )  # no SA controller
    kubeconfig = f"--kubeconfig={controlplane.admin_kubeconfig}"
    sets = [
        f"--set={k}={v}"
        for k, v in {"domain": "acme.io", "image.repository": "registry.acme.io/gpu-share", **EVERY_COMPONENT}.items()
        if k != "serviceMonitor.enabled"
    ]  # no Prometheus Operator CRD there
    policies_before = _kubectl(
        controlplane, "get", "validatingadmissionpolicies", "-o", "name"
    ).stdout.split()  # other tests' too
    helm("install", "gpu-share", str(CHART), "--namespace", namespace, kubeconfig, *sets)
    try:
        proc = _kubectl(controlplane, "get", "daemonsets,deployments", "-n", namespace, "-o", "name")
        assert sorted(proc.stdout.split()) == [
            "daemonset.apps/gpu-share",
            "daemonset.apps/gpu-share-mps",
            "deployment.apps/gpu-share-extender",
            "deployment.apps/gpu-share-scheduler",
        ], proc.stdout + proc.stderr
        deadline = time.monotonic() + 30
        while True:  # the API server loads a new policy within about a second
            proc = _kubectl(
                controlplane,
                "create",
                "--dry-run=server",
                "-n",
                namespace,
                "-f",
                "-",
                stdin=_share_pod("big", "acme.io/gpu-share", 21),
            )
            if "asks for 21" in proc.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert (
            proc.returncode != 0
            and (
                "container server asks for 21 acme.io/gpu-share but no GPU has more than 20: one container's "
                "shares come from one GPU. "
                "Ask for at most 20 acme.io/gpu-share, or for a whole GPU (acme.io/gpu)"
            )
            in proc.stderr
        ), proc.stderr
        for resource, count in (("acme.io/gpu-share", 20), ("example.com/gpu-share", 50), ("acme.io/gpu", 8)):
            proc = _kubectl(
                controlplane,
                "create",
                "--dry-run=server",
                "-n",
                namespace,
                "-f",
                "-",
                stdin=_share_pod("ok", resource, count),
            )
            assert proc.returncode == 0, (resource, count, proc.stderr)
    finally:
        helm("uninstall", "gpu-share", "--namespace", namespace, kubeconfig)
    proc = _kubectl(controlplane, "get", "validatingadmissionpolicies", "-o", "name")
    assert sorted(proc.stdout.split()) == sorted(policies_before), (
        proc.stdout
    )  # uninstall removed what the chart installed


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
    {
        "extender.enabled": "true",
        "scheduler.enabled": "true",
        "scheduler.image": "a\n          securityContext: {privileged: true}",
    },
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
    proc = helm(
        "template",
        "gs",
        str(CHART),
        *[
            f"--set-string={k}={v}"
            if k.endswith(("Name", "image", "policy", "]", "repository", "tag", "interval", ".name"))
            else f"--set={k}={v}"
            for k, v in values.items()
        ],
        check=False,
    )
    assert proc.returncode != 0, proc.stdout
    key = next(k for k in values if not k.endswith(".enabled"))
    assert f"at '/{key.replace('.', '/').replace('[0]', '/0')}'" in proc.stderr, proc.stderr


@needs_helm
def test_no_value_renders_a_host_namespace_beyond_the_plugins_needs():
    """Every component on: no host namespaces (the plugin's kill policy adds hostPID, off by default), privileged only
    in the node plugins (the device plugin, the DRA driver: device nodes), and no hostPath of the host's `/`."""
    for document in render({**EVERY_COMPONENT, **DRA}):
        spec = document.get("spec", {}).get("template", {}).get("spec") or (
            document["spec"] if document["kind"] == "Pod" else None
        )
        if not spec:
            continue
        assert not any(spec.get(k) for k in ("hostPID", "hostIPC", "hostNetwork")), document["metadata"]["name"]
        if document["metadata"]["name"] not in NODE_PLUGINS:
            assert not any((c.get("securityContext") or {}).get("privileged") for c in spec["containers"]), document[
                "metadata"
            ]["name"]
        assert all(v["hostPath"]["path"].rstrip("/") for v in spec.get("volumes", []) if "hostPath" in v), document[
            "metadata"
        ]["name"]


@needs_helm
@pytest.mark.parametrize(
    "key, hint",
    [
        ("schedular.enabled", "additional properties 'schedular' not allowed"),
        ("dashboard.enabled", "additional properties 'dashboard' not allowed"),
        ("runtimeClassName", "set it per component, e.g. plugin.runtimeClassName"),
        ("priorityClassName", "set it per component, e.g. plugin.priorityClassName"),
        ("tolerations[0].operator", "at '/tolerations/0/operator': value must be one of"),
        ("resources.limits.cpu", "at '/resources/limits/cpu': 'x' does not match pattern"),
        ("nameOverride", "its object names are fixed, one release per cluster"),
        ("migStrategy", "strategy in the config (docs/migration.md)"),
        ("mps.enableHostPID", "MPS daemons run in their own containers"),
        ("mps.root", "mpsRoot"),
    ],
)
def test_unknown_top_level_keys_are_refused_by_name(key, hint):
    proc = helm(
        "template",
        "gs",
        str(CHART),
        f"--set={key}=x" if not key.endswith("enabled") else f"--set={key}=true",
        check=False,
    )
    assert proc.returncode != 0 and hint in proc.stderr, proc.stderr


def _rules(document: dict) -> list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    """A ClusterRole's rules, one (apiGroups, resources, verbs) per rule, in order."""
    return [
        (tuple(r.get("apiGroups", ())), tuple(r.get("resources", ())), tuple(r.get("verbs", ())))
        for r in document["rules"]
    ]


@needs_helm
@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed")
@pytest.mark.parametrize("scoring", [{"dra.enabled": "true"}, {"extender.dra.enabled": "true"}])
def test_the_extenders_rbac_follows_its_dra_flag_rule_by_rule(tmp_path, scoring):
    """Scoring DRA claims (dra.enabled, or extender.dra.enabled for a driver installed apart) passes --dra-class and
    grants the kustomization's resource.k8s.io reads; without it, the chart grants only the core reads."""
    kustomized = by_kind(_kustomize(tmp_path))[("ClusterRole", "gpu-share-extender")]
    dra_rule = (
        ("resource.k8s.io",),
        ("resourceslices", "resourceclaims", "resourceclaimtemplates"),
        ("get", "list", "watch"),
    )
    assert dra_rule in _rules(kustomized)
    with_dra = by_kind(render({"extender.enabled": "true", **scoring}))
    assert _rules(with_dra[("ClusterRole", "gpu-share-extender")]) == _rules(kustomized)
    args = with_dra[("Deployment", "gpu-share-extender")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--dra-class=gpu-share-shares" in args
    without = by_kind(render({"extender.enabled": "true"}))
    assert _rules(without[("ClusterRole", "gpu-share-extender")]) == [r for r in _rules(kustomized) if r != dra_rule]
    assert not any(
        a.startswith("--dra-class")
        for a in without[("Deployment", "gpu-share-extender")]["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def _helm_section_commands() -> list[str]:
    """The shell commands of docs/install.md's Helm section, in order (continuations joined, comments dropped)."""
    text = (ROOT / "docs" / "install.md").read_text()
    section = text[text.index("\n## Helm\n") : text.index("\n## kustomize\n")]
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
    assert (
        _kubectl(
            controlplane,
            "create",
            "-f",
            "-",
            stdin=yaml.safe_dump({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node_name}}),
        ).returncode
        == 0
    )
    shutil.copy(CONFIG, tmp_path / "my-config.yaml")
    shutil.copy(
        EXAMPLES / "nodes" / "2xT4.yaml", tmp_path / "node-a.json"
    )  # YAML is JSON's superset: the CLI reads both
    shutil.copy(EXAMPLES / "nodes" / "8xH100-80GB.yaml", tmp_path / "node-b.json")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gpu-share").write_text(f'#!/bin/sh\nexec {sys.executable} -m deviceplugin.cli "$@"\n')
    (bin_dir / "gpu-share").chmod(0o755)
    kubectl = controlplane.bin / "kubectl" if (controlplane.bin / "kubectl").is_file() else shutil.which("kubectl")
    assert kubectl is not None and HELM is not None
    (bin_dir / "kubectl").symlink_to(kubectl)
    (bin_dir / "helm").symlink_to(HELM)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "KUBECONFIG": str(controlplane.admin_kubeconfig),
        "PYTHONPATH": str(ROOT),
    }
    commands = _helm_section_commands()
    assert any("--set-file config=my-config.yaml" in c for c in commands) and any(
        "dra.enabled=true" in c for c in commands
    )
    try:
        for command in commands:
            command = re.sub(r"(namespace|-n) gpu-share\b", rf"\1 {namespace}", command)
            command = command.replace("deploy/helm/gpu-share", str(CHART)).replace("<gpu-node>", node_name)
            if command.startswith("helm test"):
                # its hook pod needs a kubelet: test_the_admission_policy_refuses_after_install_reenable_and_reinstall
                # runs its check
                continue
            proc = subprocess.run(
                command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
            )
            if "--dry-run=server" in command:  # the doc's liveness check: refused
                deadline = time.monotonic() + 30
                while (
                    "more than 19" not in proc.stderr and time.monotonic() < deadline
                ):  # the updated policy loads within about a second
                    time.sleep(0.5)
                    proc = subprocess.run(
                        command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
                    )
                assert (
                    proc.returncode != 0
                    and "container too-big asks for 21 acme.io/gpu-share but no GPU has more than 19" in proc.stderr
                ), proc.stderr  # H100 80GB: 19 of 4 GiB
                continue
            assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
            if command.startswith("kubectl create namespace"):  # no ServiceAccount controller there
                assert _kubectl(controlplane, "create", "serviceaccount", "default", "-n", namespace).returncode == 0
        values = yaml.safe_load(
            helm(
                "get",
                "values",
                "gpu-share",
                "-n",
                namespace,
                f"--kubeconfig={controlplane.admin_kubeconfig}",
                "-o",
                "yaml",
            ).stdout
        )
        assert (
            values["domain"] == "acme.io"
            and values["image"]["repository"] == "registry.acme.io/gpu-share"
            and values["dra"]["enabled"]
        )
        plugin = yaml.safe_load(
            _kubectl(controlplane, "get", "daemonset", "gpu-share", "-n", namespace, "-o", "yaml").stdout
        )
        env_entries = plugin["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "GPU_SHARE_DOMAIN", "value": "acme.io"} in env_entries
        proc = _kubectl(
            controlplane,
            "create",
            "--dry-run=server",
            "-n",
            namespace,
            "-f",
            "-",
            stdin=_share_pod("big", "acme.io/gpu-share", 21),
        )
        deadline = time.monotonic() + 30
        while (
            "asks for 21" not in proc.stderr and time.monotonic() < deadline
        ):  # the API server loads a policy within about a second
            time.sleep(0.5)
            proc = _kubectl(
                controlplane,
                "create",
                "--dry-run=server",
                "-n",
                namespace,
                "-f",
                "-",
                stdin=_share_pod("big", "acme.io/gpu-share", 21),
            )
        assert proc.returncode != 0 and "asks for 21 acme.io/gpu-share" in proc.stderr, proc.stderr
    finally:
        helm(
            "uninstall",
            "gpu-share",
            "--namespace",
            namespace,
            f"--kubeconfig={controlplane.admin_kubeconfig}",
            check=False,
        )
        _kubectl(controlplane, "delete", "node", node_name)
        _wait_until_memory_claims_pass(controlplane, namespace)


def _wait_until_memory_claims_pass(controlplane, namespace: str) -> None:
    """After an uninstall with dra.enabled: the DRA capacity policy refuses memory claims for gpu-share-shares
    cluster-wide until the API server drops it; wait for that (tests/e2e/test_dra_scheduling.py mixes both)."""
    claim = yaml.safe_dump(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "after"},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpu-share-shares",
                                "capacity": {"requests": {"memory": "1Gi"}},
                            },
                        }
                    ]
                }
            },
        }
    )
    deadline = time.monotonic() + 30
    while _kubectl(controlplane, "create", "--dry-run=server", "-n", namespace, "-f", "-", stdin=claim).returncode != 0:
        assert time.monotonic() < deadline, "the DRA capacity policy is still enforced 30 s after the uninstall"
        time.sleep(0.5)


def _refused_within(controlplane, namespace: str, resource: str, count: int) -> subprocess.CompletedProcess[str]:
    """The server-side dry run of a pod asking `count` of `resource`, once refused or after 30 s."""
    deadline = time.monotonic() + 30
    while True:  # the API server loads a new policy within about a second
        proc = _kubectl(
            controlplane,
            "create",
            "--dry-run=server",
            "-n",
            namespace,
            "-f",
            "-",
            stdin=_share_pod("big", resource, count),
        )
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
    assert (
        _kubectl(controlplane, "create", "serviceaccount", "default", "-n", namespace).returncode == 0
    )  # no SA controller
    kubeconfig = f"--kubeconfig={controlplane.admin_kubeconfig}"
    hook = next(
        d
        for d in render({"domain": "acme.io"}, namespace=namespace)
        if d["kind"] == "Pod" and d["metadata"]["name"] == "gpu-share-admission-test"
    )
    container = hook["spec"]["containers"][0]
    check_env = {
        **os.environ,
        "KUBECONFIG": str(controlplane.admin_kubeconfig),
        **{e["name"]: e["value"] for e in container["env"]},
    }
    steps = [
        ("install", "--set=domain=acme.io"),
        ("upgrade", "--reset-then-reuse-values", "--set=admission.enabled=false"),
        ("upgrade", "--reset-then-reuse-values", "--set=admission.enabled=true"),
        ("uninstall",),
        ("install", "--set=domain=acme.io"),
    ]
    try:
        for verb, *flags in steps:
            helm(
                verb,
                "gpu-share",
                *([str(CHART)] if verb != "uninstall" else []),
                "--namespace",
                namespace,
                kubeconfig,
                *flags,
            )
            if verb == "uninstall" or "--set=admission.enabled=false" in flags:
                continue
            proc = _refused_within(controlplane, namespace, "acme.io/gpu-share", 21)
            assert (
                proc.returncode != 0 and "asks for 21 acme.io/gpu-share but no GPU has more than 20" in proc.stderr
            ), (verb, flags, proc.stderr)
            check = subprocess.run(
                [sys.executable, "-c", container["args"][0]], env=check_env, capture_output=True, text=True, timeout=60
            )
            assert check.returncode == 0 and "refused, as it should be: 21 acme.io/gpu-share" in check.stdout, (
                verb,
                check.stdout,
                check.stderr,
            )
    finally:
        helm("uninstall", "gpu-share", "--namespace", namespace, kubeconfig, check=False)
    deadline = time.monotonic() + 30
    while True:  # uninstalled: once the API server drops the policy, the check fails, loudly
        check = subprocess.run(
            [sys.executable, "-c", container["args"][0]], env=check_env, capture_output=True, text=True, timeout=60
        )
        if check.returncode != 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert check.returncode == 1 and "is not enforcing" in check.stderr, check.stderr


@needs_helm
def test_require_scheduler_name_refuses_share_pods_that_bypass_the_second_scheduler(controlplane):
    """scheduler.requireSchedulerName (off by default): a pod asking for a managed resource without the second
    scheduler's schedulerName is refused, naming the container, the resource and the schedulerName to set; with it, or
    asking for no managed resource, the pod is admitted. Bound to this test's namespace (the API server is shared)."""
    assert not any(
        d["metadata"]["name"] == "gpu-share-require-scheduler-name"
        for d in render({"extender.enabled": "true", "scheduler.enabled": "true"})
    )
    namespace = f"gs-schedname-{os.getpid()}"
    assert _kubectl(controlplane, "create", "namespace", namespace).returncode == 0
    assert _kubectl(controlplane, "label", "namespace", namespace, f"gpu-share-test={namespace}").returncode == 0
    assert (
        _kubectl(controlplane, "create", "serviceaccount", "default", "-n", namespace).returncode == 0
    )  # no SA controller
    documents = [
        d
        for d in render(
            {
                "domain": "acme.io",
                "extender.enabled": "true",
                "scheduler.enabled": "true",
                "scheduler.requireSchedulerName": "true",
            }
        )
        if d["metadata"]["name"] == "gpu-share-require-scheduler-name"
    ]
    assert sorted(d["kind"] for d in documents) == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    for document in documents:
        document["metadata"]["name"] = namespace
        if document["kind"] == "ValidatingAdmissionPolicyBinding":
            document["spec"] |= {
                "policyName": namespace,
                "matchResources": {"namespaceSelector": {"matchLabels": {"gpu-share-test": namespace}}},
            }

    def pod(scheduler: str | None, limits: dict[str, str]) -> str:
        spec = {"containers": [{"name": "server", "image": "busybox", "resources": {"limits": limits}}]}
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "p"},
                "spec": spec | ({"schedulerName": scheduler} if scheduler else {}),
            }
        )

    try:
        assert _kubectl(controlplane, "apply", "-f", "-", stdin=yaml.safe_dump_all(documents)).returncode == 0
        bypass = pod(None, {"acme.io/gpu-share": "2"})
        deadline = time.monotonic() + 30
        while True:  # the API server loads a new policy within about a second
            proc = _kubectl(controlplane, "create", "--dry-run=server", "-n", namespace, "-f", "-", stdin=bypass)
            if proc.returncode != 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert (
            proc.returncode != 0
            and (
                "container server asks for acme.io/gpu-share but the pod's schedulerName is default-scheduler: "
                "set spec.schedulerName: gpu-share"
            )
            in proc.stderr
        ), proc.stderr
        for admitted in (
            pod("gpu-share", {"acme.io/gpu-share": "2"}),
            pod(None, {"cpu": "1"}),
            pod(None, {"example.com/gpu-share": "1"}),
        ):
            proc = _kubectl(controlplane, "create", "--dry-run=server", "-n", namespace, "-f", "-", stdin=admitted)
            assert proc.returncode == 0, (admitted, proc.stderr)
    finally:  # cluster-scoped
        _kubectl(
            controlplane,
            "delete",
            "validatingadmissionpolicybinding,validatingadmissionpolicy",
            namespace,
            "--ignore-not-found",
        )


@needs_helm
@pytest.mark.parametrize(
    "root, says",
    [
        ("/", "must not be /:"),
        ("/etc/gpu", "must not be inside /etc:"),
        ("/run", "must not be /run:"),
        ("/a/../b", "must be an absolute, normalised path"),
        ("/srv/mps/", "must be an absolute, normalised path"),
    ],
)
def test_the_chart_refuses_an_mps_root_the_plugin_refuses(root, says, tmp_path):
    """The MPS DaemonSet mounts mpsRoot from the host: the chart applies the plugin's own rule (config/paths.py)."""
    from deviceplugin.config.paths import mps_root_problem

    text = f"version: v1\nmpsRoot: {root}\npools: [{{name: quick, mode: shared, backend: mps, replicas: 4}}]\n"
    assert mps_root_problem(root) is not None  # the plugin refuses it too
    (tmp_path / "config.yaml").write_text(text)
    proc = helm(
        "template",
        "gs",
        str(CHART),
        "--set",
        "mps.enabled=true",
        "--set",
        "admission.enabled=false",
        f"--set-file=config={tmp_path / 'config.yaml'}",
        check=False,
    )
    assert proc.returncode != 0 and f"config: mpsRoot: {says}" in proc.stderr, proc.stderr


@needs_helm
def test_the_chart_refuses_an_mps_pool_name_the_plugin_refuses(tmp_path):
    """An MPS pool's name reaches the MPS DaemonSet's name, labels and flags: the chart applies the plugin's
    POOL_NAME."""
    (tmp_path / "config.yaml").write_text(
        'version: v1\npools: [{name: "a\\n  hostPID: true", mode: shared, backend: mps, replicas: 4}]\n'
    )
    proc = helm(
        "template",
        "gs",
        str(CHART),
        "--set",
        "mps.enabled=true",
        "--set",
        "admission.enabled=false",
        f"--set-file=config={tmp_path / 'config.yaml'}",
        check=False,
    )
    assert (
        proc.returncode != 0
        and "config: profile default: an MPS pool's name must be 1-40 characters of [a-z0-9-]" in proc.stderr
    ), proc.stderr


def test_the_charts_files_are_copies_of_the_kustomization_sources():
    """No symlinks in the chart (a copied or packaged chart carries its files); deploy/helm/sync-files.py keeps them
    equal to daemonset/'s."""
    assert not [p for p in CHART.rglob("*") if p.is_symlink()]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "helm" / "sync-files.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert {str(p.relative_to(CHART / "files")) for p in (CHART / "files").rglob("*") if p.is_file()} == {
        "admission-policy.yaml",
        "config.yaml",
        "gpu-share-dashboard.json",
        "dra/01-rbac.yaml",
        "dra/02-deviceclasses.yaml",
        "dra/04-slice-policy.yaml",
        "dra/05-share-mapping-policy.yaml",
        "dra/06-capacity-policy.yaml",
        "dra/07-node-patch-policy.yaml",
        "dra/dra-only-policy.yaml",
    }


@needs_helm
def test_a_packaged_chart_renders_from_a_copy_like_the_chart(tmp_path):
    helm("package", str(CHART), "--destination", str(tmp_path))
    (package,) = tmp_path.glob("gpu-share-*.tgz")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(package, elsewhere / package.name)
    shutil.copytree(CHART, elsewhere / "chart")
    values = {"domain": "acme.io", **EVERY_COMPONENT, **DRA}
    expected = _without_generated_certificates(render(values))
    sets = [f"--set={k}={v}" for k, v in values.items()]
    for source in (elsewhere / package.name, elsewhere / "chart"):
        proc = helm("template", "gs", str(source), "--namespace", "gpu-share", *sets)
        assert "symbolic link" not in proc.stderr
        assert _without_generated_certificates([d for d in yaml.safe_load_all(proc.stdout) if d]) == expected, source


def _without_generated_certificates(documents: list[dict]) -> list[dict]:
    """The documents with the extender's Secrets' data (new certificates at each render) set to their keys alone."""
    return [{**d, "data": sorted(d["data"])} if d["kind"] == "Secret" else d for d in documents]


# --- the extender's TLS: generated certificates, kept across upgrades; the NetworkPolicy --------------------------


def _write_pki(objects: dict[tuple[str, str], dict], folder: Path) -> Pki:
    """The chart's two Secrets as the files docs/security.md's commands make (extender.*, scheduler.*, ca.crt)."""
    import base64

    folder.mkdir()
    server, client = (
        objects[("Secret", name)]["data"] for name in ("gpu-share-extender-tls", "gpu-share-scheduler-tls")
    )
    assert server["ca.crt"] == client["ca.crt"]
    for secret, stem in ((server, "extender"), (client, "scheduler")):
        (folder / f"{stem}.crt").write_bytes(base64.b64decode(secret["tls.crt"]))
        (folder / f"{stem}.key").write_bytes(base64.b64decode(secret["tls.key"]))
    (folder / "ca.crt").write_bytes(base64.b64decode(server["ca.crt"]))
    return Pki(folder)


@needs_helm
def test_the_charts_generated_certificates_let_the_scheduler_and_no_one_else_call_the_extender(tmp_path):
    """The extender started with the chart's Secrets and flags answers the scheduler's certificate (checked for the
    tlsConfig's serverName), 401 to a client without one; another install's scheduler certificate fails the
    handshake."""
    from deviceplugin.extender.http import ExtenderHTTPServer
    from deviceplugin.extender.tls import ServerTLS, TLSSettings
    from tests.support.extender import SHARE, annotation, args, extender, pod

    objects = by_kind(render({"extender.enabled": "true", "scheduler.enabled": "true"}))
    pki = _write_pki(objects, tmp_path / "mine")
    other = _write_pki(by_kind(render({"extender.enabled": "true"})), tmp_path / "other")
    flags = dict(
        a.split("=", 1)
        for a in objects[("Deployment", "gpu-share-extender")]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert flags["--client-names"] == CLIENT_NAME
    ext = extender({"n": annotation((4, 0))})
    tls = ServerTLS(
        TLSSettings(pki.path("extender.crt"), pki.path("extender.key"), pki.path("ca.crt"), frozenset({CLIENT_NAME}))
    )
    server = ExtenderHTTPServer(ext, ext.metrics, lambda: (True, "ready"), port=0, host="127.0.0.1", tls=tls)
    server.start()
    try:
        assert (
            SERVER_NAME
            == yaml.safe_load(objects[("ConfigMap", "gpu-share-scheduler-config")]["data"]["config.yaml"])["extenders"][
                0
            ]["tlsConfig"]["serverName"]
        )
        assert call(server.port, client_context(pki, pki), "POST", "/filter", args(pod("p", {SHARE: 1}), "n"))[0] == 200
        assert (
            call(server.port, client_context(pki, None), "POST", "/filter", args(pod("q", {SHARE: 1}), "n"))[0] == 401
        )
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
            call(server.port, client_context(pki, other), "POST", "/filter", args(pod("r", {SHARE: 1}), "n"))
        assert ext.cache.counts()["reservations"] == 1
    finally:
        server.stop()


@needs_helm
def test_an_upgrade_keeps_the_generated_certificates(controlplane):
    """helm install, then upgrade, on a real API server: the Secrets hold the same certificates (lookup), so the
    scheduler's copy (way 1's on the control-plane nodes) stays valid."""
    namespace = f"gs-tls-{os.getpid()}"
    kubeconfig = f"--kubeconfig={controlplane.admin_kubeconfig}"
    base = [
        "--namespace",
        namespace,
        kubeconfig,
        "--set",
        "extender.enabled=true,plugin.enabled=false,admission.enabled=false",
    ]
    try:
        helm("install", "gpu-share", str(CHART), "--create-namespace", *base)
        first = _kubectl(
            controlplane,
            "get",
            "secret",
            "gpu-share-scheduler-tls",
            "gpu-share-extender-tls",
            "-n",
            namespace,
            "-o",
            "yaml",
        )
        helm("upgrade", "gpu-share", str(CHART), *base, "--set", "extender.policy=binpack")
        again = _kubectl(
            controlplane,
            "get",
            "secret",
            "gpu-share-scheduler-tls",
            "gpu-share-extender-tls",
            "-n",
            namespace,
            "-o",
            "yaml",
        )
        datas = [[item["data"] for item in yaml.safe_load(proc.stdout)["items"]] for proc in (first, again)]
        assert datas[0] == datas[1] and all(set(d) == {"tls.crt", "tls.key", "ca.crt"} for d in datas[0])
    finally:
        helm("uninstall", "gpu-share", "--namespace", namespace, kubeconfig, check=False)
        _kubectl(controlplane, "delete", "namespace", namespace, "--wait=false")


@needs_helm
@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed")
def test_the_charts_network_policy_is_the_kustomizations_and_takes_way_1s_addresses(tmp_path):
    chart = by_kind(render({"extender.enabled": "true"}))[("NetworkPolicy", "gpu-share-extender")]
    kustomized = by_kind(_kustomize(tmp_path))[("NetworkPolicy", "gpu-share-extender")]
    assert (
        chart["spec"]["ingress"] == kustomized["spec"]["ingress"]
        and chart["spec"]["policyTypes"] == kustomized["spec"]["policyTypes"]
    )
    way1 = by_kind(
        render(
            {
                "extender.enabled": "true",
                "extender.networkPolicy.extraFrom[0].ipBlock.cidr": "10.0.0.0/24",
                "extender.networkPolicy.metricsNamespace": "observability",
            }
        )
    )[("NetworkPolicy", "gpu-share-extender")]
    peers = way1["spec"]["ingress"][0]["from"]
    assert {"ipBlock": {"cidr": "10.0.0.0/24"}} in peers
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}} in peers
    assert ("NetworkPolicy", "gpu-share-extender") not in by_kind(
        render({"extender.enabled": "true", "extender.networkPolicy.enabled": "false"})
    )


@needs_helm
def test_a_workload_file_reaches_the_extender_as_its_task_shapes(tmp_path):
    """`--set-file extender.workload=pods.csv`: a ConfigMap, mounted, read by --workload, and a checksum annotation
    that restarts the extender (it reads the file once); the file parses as the extender parses it."""
    from deviceplugin.extender.service import workload_shapes

    pods = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,8000,65536,8,1000\nb,4000,16384,1,300\n"
    (tmp_path / "pods.csv").write_text(pods)
    objects = by_kind(render({"extender.enabled": "true"}, "--set-file", f"extender.workload={tmp_path / 'pods.csv'}"))
    assert objects[("ConfigMap", "gpu-share-extender-workload")]["data"] == {"pods.csv": pods}
    template = objects[("Deployment", "gpu-share-extender")]["spec"]["template"]
    container = template["spec"]["containers"][0]
    assert "--workload=/etc/gpu-share-extender/workload/pods.csv" in container["args"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "workload")
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == "workload")
    assert mount["mountPath"] == "/etc/gpu-share-extender/workload" and volume["configMap"]["name"] == (
        "gpu-share-extender-workload"
    )
    assert len(template["metadata"]["annotations"]["gpu-share/workload-sha256"]) == 64
    written = tmp_path / "mounted.csv"
    written.write_text(objects[("ConfigMap", "gpu-share-extender-workload")]["data"]["pods.csv"])
    assert {(s.num_gpu, s.gpu_milli) for s, _ in workload_shapes(str(written)).shapes} == {(8, 1000), (1, 300)}
    plain = by_kind(render({"extender.enabled": "true"}))
    assert ("ConfigMap", "gpu-share-extender-workload") not in plain
    spec = plain[("Deployment", "gpu-share-extender")]["spec"]["template"]
    assert not any(a.startswith("--workload") for a in spec["spec"]["containers"][0]["args"])


@needs_helm
def test_a_workload_file_the_extender_cannot_use_fails_the_render_naming_the_key(tmp_path):
    (tmp_path / "pods.csv").write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,8000,65536,8,1000\n")
    (tmp_path / "big.csv").write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "éééé,1,1,1,1000\n" * 60_000)
    for sets, says in (
        (["--set", "extender.policy=binpack", "--set-file", f"extender.workload={tmp_path / 'pods.csv'}"],
         "extender.workload: the task shapes are for policy fgd or fgdstrand, extender.policy is binpack"),
        # 960,044 characters (the schema counts them), 1,200,044 bytes
        (["--set-file", f"extender.workload={tmp_path / 'big.csv'}"],
         "a ConfigMap holds at most 1 MiB"),
    ):  # fmt: skip
        proc = helm("template", "gs", str(CHART), "--set", "extender.enabled=true", *sets, check=False)
        assert proc.returncode != 0 and says in proc.stderr, proc.stderr

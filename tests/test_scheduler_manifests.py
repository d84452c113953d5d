"""The extender's manifests, both scheduler configurations, and the admission policy's CEL on sample pods."""

from __future__ import annotations

import re
from pathlib import Path

import celpy
import pytest
import yaml

from deviceplugin.cli.main import build_parser
from tests.support.resources import resources_of

from .conftest import ROOT

EXTENDER = ROOT / "daemonset" / "extender"
ADMISSION = ROOT / "daemonset" / "admission"
EXTENDER_KEYS = {
    "urlPrefix",
    "filterVerb",
    "prioritizeVerb",
    "weight",
    "httpTimeout",
    "nodeCacheCapable",
    "ignorable",
    "managedResources",
    "enableHTTPS",
    "tlsConfig",
}
TLS_CONFIG_KEYS = {
    "insecure",
    "serverName",
    "certFile",
    "keyFile",
    "caFile",
    "certData",
    "keyData",
    "caData",
}  # kube-scheduler's ExtenderTLSConfig
SCHEDULER_TLS = "/etc/gpu-share-scheduler-tls"


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def scheduler_configs() -> list[dict]:
    standalone = documents(EXTENDER / "scheduler" / "kube-scheduler-config.yaml")
    configmap = next(d for d in documents(EXTENDER / "scheduler" / "second-scheduler.yaml") if d["kind"] == "ConfigMap")
    return standalone + [yaml.safe_load(configmap["data"]["config.yaml"])]


@pytest.mark.parametrize("config", scheduler_configs(), ids=["cluster-scheduler", "second-scheduler"])
def test_scheduler_configs_call_the_extender(config):
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1" and config["kind"] == "KubeSchedulerConfiguration"
    extender, every_pod = config["extenders"]
    assert set(extender) == EXTENDER_KEYS  # kube-scheduler's field names: a typo would be silently ignored
    assert set(every_pod) == EXTENDER_KEYS - {"managedResources"}  # none: kube-scheduler calls it for every pod
    assert (
        every_pod["urlPrefix"] == extender["urlPrefix"] + "/all"
        and every_pod["ignorable"] is True
        and every_pod["weight"] == 20
    )
    assert extender["nodeCacheCapable"] is True and extender["ignorable"] is False
    assert extender["filterVerb"] == "filter" and extender["prioritizeVerb"] == "prioritize"
    assert extender["urlPrefix"] == "https://gpu-share-extender.gpu-share.svc:8888"
    assert (
        extender["enableHTTPS"] is every_pod["enableHTTPS"] is True and extender["tlsConfig"] == every_pod["tlsConfig"]
    )
    assert set(extender["tlsConfig"]) <= TLS_CONFIG_KEYS and not extender["tlsConfig"].get("insecure")
    assert extender["tlsConfig"] == {
        "serverName": "gpu-share-extender.gpu-share.svc",
        "certFile": f"{SCHEDULER_TLS}/tls.crt",
        "keyFile": f"{SCHEDULER_TLS}/tls.key",
        "caFile": f"{SCHEDULER_TLS}/ca.crt",
    }
    assert extender["weight"] == 20  # the recommended configuration (docs/scheduler.md)
    names = {r["name"] for r in extender["managedResources"]}
    assert {"example.com/gpu-share", "example.com/gpu"} <= names and all(n.startswith("example.com/") for n in names)


def test_second_scheduler_is_the_official_image_named_gpu_share():
    docs = {d["kind"]: d for d in documents(EXTENDER / "scheduler" / "second-scheduler.yaml")}
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].startswith("registry.k8s.io/kube-scheduler:v1.")
    (profile,) = scheduler_configs()[1]["profiles"]
    assert profile["schedulerName"] == "gpu-share"
    (fit,) = profile["pluginConfig"]
    assert (
        fit["name"] == "NodeResourcesFit" and fit["args"]["scoringStrategy"]["type"] == "LeastAllocated"
    )  # docs/scheduler.md (the sweep, issue 34)


def test_the_extender_authenticates_the_certificate_the_second_scheduler_mounts():
    """The extender serves its Secret's certificate and accepts the verbs from gpu-share-scheduler only; the second
    scheduler mounts the Secret of that client certificate where its tlsConfig reads; the NetworkPolicy admits it."""
    extender = next(d for d in documents(EXTENDER / "01-deployment.yaml") if d["kind"] == "Deployment")["spec"][
        "template"
    ]["spec"]
    (container,) = extender["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in extender["volumes"]}
    assert secrets == {"tls": "gpu-share-extender-tls"}
    flags = dict(a.split("=", 1) for a in container["args"])
    assert (
        flags["--tls-cert-file"] == f"{mounts['tls']}/tls.crt"
        and flags["--tls-private-key-file"] == f"{mounts['tls']}/tls.key"
    )
    assert flags["--client-ca-file"] == f"{mounts['tls']}/ca.crt" and flags["--client-names"] == "gpu-share-scheduler"
    assert {p["httpGet"]["scheme"] for p in (container["readinessProbe"], container["livenessProbe"])} == {"HTTPS"}
    scheduler = next(
        d for d in documents(EXTENDER / "scheduler" / "second-scheduler.yaml") if d["kind"] == "Deployment"
    )["spec"]["template"]
    spec = scheduler["spec"]
    assert {m["mountPath"] for m in spec["containers"][0]["volumeMounts"] if m["name"] == "tls"} == {SCHEDULER_TLS}
    assert {v["secret"]["secretName"] for v in spec["volumes"] if v["name"] == "tls"} == {"gpu-share-scheduler-tls"}
    (policy,) = documents(EXTENDER / "03-networkpolicy.yaml")
    assert policy["spec"]["podSelector"]["matchLabels"] == extender_labels()
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": container["ports"][0]["name"], "protocol": "TCP"}]
    peers = [p.get("podSelector", {}).get("matchLabels") for p in rule["from"]]
    assert scheduler["metadata"]["labels"] in peers


def extender_labels() -> dict:
    return next(d for d in documents(EXTENDER / "01-deployment.yaml") if d["kind"] == "Deployment")["spec"]["template"][
        "metadata"
    ]["labels"]


def test_extender_rbac_only_reads():
    role = next(d for d in documents(EXTENDER / "00-rbac.yaml") if d["kind"] == "ClusterRole")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices", "resourceclaims", "resourceclaimtemplates"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    deployment = documents(EXTENDER / "01-deployment.yaml")[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["gpu-share", "extender"] and container["ports"][0]["containerPort"] == 8888
    args = build_parser().parse_args(["extender", *container["args"]])  # every flag exists
    assert args.port == container["ports"][0]["containerPort"]
    assert container["image"] == "gpu-share"  # the kustomization's images set it
    assert container["env"] == [
        {"name": "GPU_SHARE_DOMAIN", "valueFrom": {"configMapKeyRef": {"name": "gpu-share-settings", "key": "domain"}}}
    ]
    assert {container["readinessProbe"]["httpGet"]["path"], container["livenessProbe"]["httpGet"]["path"]} == {
        "/readyz",
        "/healthz",
    }


# --- the admission policy, evaluated by a CEL interpreter -------------------------------------------


def policy_variables(domain: str | None = None, limits: dict[str, int] | None = None) -> list[dict]:
    """The shipped policy's variables, with another `domain` or `limits` (as the domain component or the chart set
    them)."""
    (policy,) = documents(ADMISSION / "policy.yaml")
    variables = [dict(v) for v in policy["spec"]["variables"]]
    for variable in variables:
        if variable["name"] == "domain" and domain is not None:
            variable["expression"] = f"'{domain}'"
        if variable["name"] == "limits" and limits is not None:
            variable["expression"] = "{" + ", ".join(f"'{k}': {v}" for k, v in limits.items()) + "}"
    return variables


def admit(pod: dict, domain: str | None = None, limits: dict[str, int] | None = None) -> tuple[bool, str]:
    """(allowed, message) as the API server would evaluate the policy (with another domain or limits)."""
    (policy,) = documents(ADMISSION / "policy.yaml")
    spec = policy["spec"]
    assert "paramKind" not in spec  # nothing outside the policy can switch it off
    env = celpy.Environment()
    activation = {"object": celpy.json_to_cel(pod)}
    variables = {}
    for variable in policy_variables(domain, limits):
        variables[celpy.celtypes.StringType(variable["name"])] = env.program(
            env.compile(variable["expression"])
        ).evaluate(activation)
        activation["variables"] = celpy.celtypes.MapType(variables)
    (validation,) = spec["validations"]
    allowed = bool(env.program(env.compile(validation["expression"])).evaluate(activation))
    return allowed, "" if allowed else str(
        env.program(env.compile(validation["messageExpression"])).evaluate(activation)
    )


def pod(*containers: dict, init: tuple[dict, ...] = ()) -> dict:
    def spec(i: int, limits: dict) -> dict:
        return {"name": f"c{i}", "resources": {"limits": limits}} if limits else {"name": f"c{i}"}

    body = {"spec": {"containers": [spec(i, c) for i, c in enumerate(containers)]}}
    if init:
        body["spec"]["initContainers"] = [spec(9, c) for c in init]
    return body


def test_admission_refuses_more_shares_than_any_gpu_and_says_what_to_ask_for():
    allowed, message = admit(pod({"example.com/gpu-share": "21"}))
    assert not allowed
    assert message == (
        "container c0 asks for 21 example.com/gpu-share but no GPU has more than 20: one container's shares come "
        "from one GPU. "
        "Ask for at most 20 example.com/gpu-share, or for a whole GPU (example.com/gpu)"
    )
    assert admit(pod({"example.com/gpu-share": "20"}, {}, {"cpu": "2"})) == (True, "")
    assert admit(pod({"example.com/gpu": "4"}))[0]  # not listed: not checked
    assert admit(pod({"example.com/mig-3g.40gb": "2"}))[0]  # several MIG instances: fine
    allowed, message = admit(pod({"example.com/gpu-share": "1"}, init=({"example.com/gpu-share": "21"},)))
    assert not allowed and message.startswith("container c9 asks for 21")
    assert admit({"spec": {"containers": [{"name": "plain"}]}}) == (True, "")


def test_admission_takes_the_domain_and_limits_from_its_variables():
    limits = {"gpu-share": 4, "small": 2}
    allowed, message = admit(pod({"acme.io/small": "3"}), "acme.io", limits)
    assert not allowed and message == (
        "container c0 asks for 3 acme.io/small but no GPU has more than 2: one container's shares come from one GPU. "
        "Ask for at most 2 acme.io/small, or for a whole GPU (acme.io/gpu)"
    )
    assert admit(pod({"example.com/gpu-share": "50"}), "acme.io", limits)[0]  # another domain: not checked
    assert admit(pod({"acme.io/gpu-share": "4"}), "acme.io", limits)[0]
    assert admit(pod({"acme.io/gpu-share": "50"}), "acme.io", {})[0]  # no limits: nothing checked


def test_admission_policy_holds_its_limits_and_binds_without_params():
    docs = {
        d["kind"]: d for name in ("policy.yaml", "params.yaml", "binding.yaml") for d in documents(ADMISSION / name)
    }
    binding = docs["ValidatingAdmissionPolicyBinding"]["spec"]
    assert binding == {
        "policyName": docs["ValidatingAdmissionPolicy"]["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    assert docs["ValidatingAdmissionPolicy"]["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE"]
    assert docs["ConfigMap"]["metadata"]["annotations"] == {
        "config.kubernetes.io/local-config": "true"
    }  # kustomize's only


# --- the demo's scheduler step ------------------------------------------------------------------------


SAMPLES = [
    {"server": {"example.com/gpu-share": 21}},
    {"a": {"example.com/gpu-share": 20}, "b": {"example.com/gpu": 3}},
    {"a": {"example.com/gpu-share": 2}, "b": {"example.com/gpu-share": 21}},
    {"plain": {}},
]


@pytest.mark.parametrize("containers", SAMPLES)
def test_the_demo_answers_as_the_policy_does(containers):
    from deviceplugin.sim.scheduler import admission_refusal

    body = {
        "spec": {
            "containers": [
                {"name": n, "resources": {"limits": {r: str(c) for r, c in req.items()}}}
                for n, req in containers.items()
            ]
        }
    }
    allowed, message = admit(body)
    variables = {v["name"]: v["expression"] for v in policy_variables()}
    limits = {k: int(v) for k, v in re.findall(r"'([^']+)': (\d+)", variables["limits"])}
    assert admission_refusal(containers, limits, variables["domain"].strip("'")) == (None if allowed else message)


def test_demo_step_refuses_too_big_and_skips_the_fragmented_node():
    from deviceplugin.config.parse import load_config
    from deviceplugin.discovery.simulated import SimulatedInventory
    from deviceplugin.sim.scheduler import run_scheduler_step

    builtin = ROOT / "deviceplugin" / "builtin"
    node = SimulatedInventory.from_file(builtin / "demo-node.yaml").discover()
    lines: list[str] = []
    resources = resources_of(load_config(builtin / "demo-config.yaml"), node)
    shared = next(r for r in resources if r.pool.shared)
    run_scheduler_step(resources, lines.append, too_big=(shared, 11))
    text = "\n".join(lines)
    assert (
        "too-big (11 shares) is refused at creation: container server asks for 11 example.com/gpu-share but no "
        "GPU has more than 10" in text
    )
    assert (
        "node-a: skipped: gpu-share: container server asks for 6 shares of example.com/gpu-share on one GPU; the "
        "most free on one GPU is 3 (free 3+3 on 2 GPUs)" in text
    )
    assert "node-b: fits (score 10/10): bound there, its 6 shares land on GPU 1" in text

"""The extender's manifests, both scheduler configurations, and the admission policy's CEL on sample pods."""

from __future__ import annotations

from pathlib import Path

import celpy
import pytest
import yaml

from deviceplugin import __version__
from deviceplugin.cli.main import build_parser

from .conftest import ROOT

EXTENDER = ROOT / "daemonset" / "extender"
ADMISSION = ROOT / "daemonset" / "admission" / "gpu-share-admission.yaml"
EXTENDER_KEYS = {"urlPrefix", "filterVerb", "prioritizeVerb", "weight", "httpTimeout", "nodeCacheCapable", "ignorable", "managedResources"}


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
    assert every_pod["urlPrefix"] == extender["urlPrefix"] + "/all" and every_pod["ignorable"] is True and every_pod["weight"] == 20
    assert extender["nodeCacheCapable"] is True and extender["ignorable"] is False
    assert extender["filterVerb"] == "filter" and extender["prioritizeVerb"] == "prioritize"
    assert extender["urlPrefix"] == "http://gpu-share-extender.gpu-share.svc:8888"
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
    assert fit["name"] == "NodeResourcesFit" and fit["args"]["scoringStrategy"]["type"] == "MostAllocated"  # docs/scheduler.md


def test_extender_rbac_only_reads():
    role = next(d for d in documents(EXTENDER / "00-rbac.yaml") if d["kind"] == "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list", "watch"]},
                             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices", "resourceclaims", "resourceclaimtemplates"],
                              "verbs": ["get", "list", "watch"]}]
    deployment = documents(EXTENDER / "01-deployment.yaml")[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["gpu-share", "extender"] and container["ports"][0]["containerPort"] == 8888  # not the image's `run`
    args = build_parser().parse_args(["extender", *container["args"]])  # every flag exists
    assert args.port == container["ports"][0]["containerPort"]
    assert container["image"] == f"ghcr.io/example/gpu-share:{__version__}"  # the kustomization's image and version
    assert {container["readinessProbe"]["httpGet"]["path"], container["livenessProbe"]["httpGet"]["path"]} == {"/readyz", "/healthz"}


# --- the admission policy, evaluated by a CEL interpreter -------------------------------------------


def admit(pod: dict) -> tuple[bool, str]:
    """(allowed, message) as the API server would evaluate the policy with its params ConfigMap."""
    params, policy = (d for d in documents(ADMISSION) if d["kind"] in ("ConfigMap", "ValidatingAdmissionPolicy"))
    spec = policy["spec"]
    env = celpy.Environment()
    activation = {"object": celpy.json_to_cel(pod), "params": celpy.json_to_cel(params)}
    variables = {}
    for variable in spec["variables"]:
        variables[celpy.celtypes.StringType(variable["name"])] = env.program(env.compile(variable["expression"])).evaluate(activation)
        activation["variables"] = celpy.celtypes.MapType(variables)
    (validation,) = spec["validations"]
    allowed = bool(env.program(env.compile(validation["expression"])).evaluate(activation))
    return allowed, "" if allowed else str(env.program(env.compile(validation["messageExpression"])).evaluate(activation))


def pod(*containers: dict, init: tuple[dict, ...] = ()) -> dict:
    def spec(i: int, limits: dict) -> dict:
        return {"name": f"c{i}", "resources": {"limits": limits}} if limits else {"name": f"c{i}"}

    body = {"spec": {"containers": [spec(i, c) for i, c in enumerate(containers)]}}
    if init:
        body["spec"]["initContainers"] = [spec(9, c) for c in init]
    return body


def test_admission_refuses_more_shares_than_any_gpu_and_says_what_to_ask_for():
    allowed, message = admit(pod({"example.com/gpu-share": "12"}))
    assert not allowed
    assert message == (
        "container c0 asks for 12 example.com/gpu-share but no GPU has more than 10: one container's shares come from one GPU. "
        "Ask for at most 10 example.com/gpu-share, or for a whole GPU (example.com/gpu)"
    )
    assert admit(pod({"example.com/gpu-share": "10"}, {}, {"cpu": "2"})) == (True, "")
    assert admit(pod({"example.com/gpu": "4"}))[0]  # not listed: not checked
    assert admit(pod({"example.com/mig-3g.40gb": "2"}))[0]  # several MIG instances: fine
    allowed, message = admit(pod({"example.com/gpu-share": "1"}, init=({"example.com/gpu-share": "11"},)))
    assert not allowed and message.startswith("container c9 asks for 11")
    assert admit({"spec": {"containers": [{"name": "plain"}]}}) == (True, "")


def test_admission_policy_binds_to_its_params():
    docs = {d["kind"]: d for d in documents(ADMISSION)}
    binding = docs["ValidatingAdmissionPolicyBinding"]["spec"]
    assert binding["policyName"] == docs["ValidatingAdmissionPolicy"]["metadata"]["name"]
    assert binding["paramRef"]["name"] == docs["ConfigMap"]["metadata"]["name"] and binding["validationActions"] == ["Deny"]
    assert docs["ValidatingAdmissionPolicy"]["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE"]


# --- the demo's scheduler step ------------------------------------------------------------------------


SAMPLES = [
    {"server": {"example.com/gpu-share": 12}},
    {"a": {"example.com/gpu-share": 10}, "b": {"example.com/gpu": 3}},
    {"a": {"example.com/gpu-share": 2}, "b": {"example.com/gpu-share": 11}},
    {"plain": {}},
]


@pytest.mark.parametrize("containers", SAMPLES)
def test_the_demo_answers_as_the_policy_does(containers):
    from deviceplugin.sim.scheduler import admission_refusal

    params = next(d for d in documents(ADMISSION) if d["kind"] == "ConfigMap")
    body = {"spec": {"containers": [{"name": n, "resources": {"limits": {r: str(c) for r, c in req.items()}}} for n, req in containers.items()]}}
    allowed, message = admit(body)
    assert admission_refusal(containers, {k: int(v) for k, v in params["data"].items()}) == (None if allowed else message)


def test_demo_step_refuses_too_big_and_skips_the_fragmented_node():
    from deviceplugin.config.parse import load_config
    from deviceplugin.sim.scheduler import run_scheduler_step
    from deviceplugin.alloc.plan import build_resources
    from deviceplugin.discovery.simulated import SimulatedInventory

    builtin = ROOT / "deviceplugin" / "builtin"
    node = SimulatedInventory.from_file(builtin / "demo-node.yaml").discover()
    lines: list[str] = []
    resources = build_resources(load_config(builtin / "demo-config.yaml"), node)
    shared = next(r for r in resources if r.pool.shared)
    run_scheduler_step(resources, lines.append, too_big=(shared, 11))
    text = "\n".join(lines)
    assert "too-big (11 shares) is refused at creation: container server asks for 11 example.com/gpu-share but no GPU has more than 10" in text
    assert "node-a: skipped: gpu-share: container server asks for 6 shares of example.com/gpu-share on one GPU; the most free on one GPU is 3 (free 3+3 on 2 GPUs)" in text
    assert "node-b: fits (score 10/10): bound there, its 6 shares land on GPU 1" in text

"""The extender inside a real kube-scheduler, and the admission policy on a real API server (skipped without the
binaries).

Simulated GPU nodes (Node objects, their kubelets' admission and the node plugins' annotations played by
benchmarks/standin.py), the `gpu-share extender` service in this process, kube-scheduler v1.36 calling it over mutual
TLS as the shipped config does (certificates made by docs/security.md's commands).
"""

from __future__ import annotations

import random
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.standin import GpuNode, StandInPlugins, scheduler_config, share_pod_body
from tests.support.pki import CLIENT_NAME, Pki, make_pki

ROOT = Path(__file__).resolve().parents[2]


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


SCHEDULER_TLS = "/etc/gpu-share-scheduler-tls/"
TLS_FILES = {
    "tls.crt": "scheduler.crt",
    "tls.key": "scheduler.key",
    "ca.crt": "ca.crt",
}  # the Secret's keys: the files docs/security.md makes


def shipped_config(name: str, extender: Extender) -> dict:
    """daemonset/extender/scheduler/kube-scheduler-config.yaml as shipped, with the extender's URL and certificates here
    (its serverName unchanged) and profile `name`."""
    config = yaml.safe_load((ROOT / "daemonset/extender/scheduler/kube-scheduler-config.yaml").read_text())
    for entry in config["extenders"]:
        entry["urlPrefix"] = entry["urlPrefix"].replace("https://gpu-share-extender.gpu-share.svc:8888", extender.url)
        tls = entry["tlsConfig"]
        for key in ("certFile", "keyFile", "caFile"):
            assert tls[key].startswith(SCHEDULER_TLS)
            tls[key] = extender.pki.path(TLS_FILES[tls[key].removeprefix(SCHEDULER_TLS)])
    config["profiles"] = [{"schedulerName": name}]
    return {k: v for k, v in config.items() if k not in ("apiVersion", "kind")}


def namespace(core: Any, name: str) -> None:
    core.create_namespace({"metadata": {"name": name}})
    core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})  # no ServiceAccount controller


@dataclass(frozen=True)
class Extender:
    url: str
    pki: Pki
    service: Any


@pytest.fixture(scope="module")
def extender(controlplane: Any, tmp_path_factory):
    """The extender as the shipped Deployment runs it: HTTPS, the verbs for the client certificate
    gpu-share-scheduler."""

    from deviceplugin.extender.service import ExtenderOptions, ExtenderService
    from deviceplugin.extender.tls import TLSSettings

    pki = make_pki(tmp_path_factory.mktemp("extender") / "pki")
    tls = TLSSettings(pki.path("extender.crt"), pki.path("extender.key"), pki.path("ca.crt"), frozenset({CLIENT_NAME}))
    options = ExtenderOptions(port=0, host="127.0.0.1", policy="fgdstrand", tls=tls)
    service = ExtenderService(controlplane.rest_client(), options)
    service.start()
    try:
        assert wait_until(lambda: service.watch.ready()[0], 30), service.watch.ready()
        yield Extender(f"https://127.0.0.1:{service.server.port}", pki, service)
    finally:
        service.stop()


def test_a_burst_of_share_pods_through_the_extender_all_admitted_none_pending_that_fits(
    controlplane: Any, extender: Extender
) -> None:
    from kubernetes import client

    run = secrets.token_hex(3)
    api = controlplane.api_client()
    core = client.CoreV1Api(api)
    labels = {"gpu-share-e2e": f"burst-{run}"}
    nodes = [GpuNode(f"burst-{run}-{i}", gpus=4, cpu_milli=64_000, memory_mib=262_144) for i in range(4)]
    plugins = StandInPlugins(api, nodes, labels, republish=(0.5, 1.5), seed=7)
    plugins.create_nodes()
    plugins.start()
    ns = f"burst-{run}"
    namespace(core, ns)
    name = f"gs-{run}"
    controlplane.scheduler(shipped_config(name, extender), name)
    try:
        rng = random.Random(11)
        sizes: list[int] = []
        while sum(sizes) < 150:  # 160 shares on 16 GPUs: a burst of about 95 % of them, 1-10 shares each
            sizes.append(rng.randint(1, 10))
        for i, shares in enumerate(sizes):
            core.create_namespaced_pod(ns, share_pod_body(f"p{i}", shares, 1000, 1024, name, labels))

        def pending() -> list[tuple[str, int]]:
            pods = core.list_namespaced_pod(ns).items
            return [
                (p.metadata.name, int(p.spec.containers[0].resources.limits["example.com/gpu-share"]))
                for p in pods
                if not p.spec.node_name
            ]

        def settled() -> bool:
            """Every pod is bound, or fits on no GPU now and the nodes have published their last change."""
            waiting = pending()
            free = [f for units in plugins.free().values() for f in units]
            return not plugins.pending_republish() and all(count > max(free) for _, count in waiting)

        assert wait_until(settled, 120), (pending(), plugins.free())
        assert plugins.failures == [] and plugins.errors == []
        assert plugins.admitted == len(sizes) - len(pending())
        assert plugins.used_shares() >= 128, plugins.free()  # most of the 160 shares: the scheduler placed the burst
        metrics = extender.service.metrics  # every call came over mutual TLS, none refused
        assert metrics.requests.labels("filter", "ok")._value.get() >= len(sizes) - len(pending())
        assert sum(metrics.unauthenticated.labels(r)._value.get() for r in ("handshake", "no-certificate", "name")) == 0
    finally:
        controlplane.stop_process(f"kube-scheduler#{name}")
        plugins.stop()


def test_the_admission_policy_refuses_a_pod_larger_than_any_gpu_on_the_real_api_server(controlplane: Any) -> None:
    from kubernetes import client

    api = controlplane.api_client()
    core, admission = client.CoreV1Api(api), client.AdmissionregistrationV1Api(api)
    policy, binding = (
        yaml.safe_load((ROOT / "daemonset/admission" / f).read_text()) for f in ("policy.yaml", "binding.yaml")
    )
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    limit = int(variables["limits"].removeprefix("{'gpu-share': ").removesuffix("}"))  # the shipped policy's one limit
    # The shipped objects under names of this test's own, bound to this test's namespace only: the session's API
    # server is shared with the chart's tests. No params object: the limits are the policy's own variables.
    run = secrets.token_hex(3)
    name, ns = f"gpu-share-shares-per-gpu-{run}", f"admission-{run}"
    policy["metadata"]["name"] = binding["metadata"]["name"] = binding["spec"]["policyName"] = name
    binding["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
    admission.create_validating_admission_policy(policy)
    admission.create_validating_admission_policy_binding(binding)
    refused_and_admitted(core, limit, name, ns)


def refused_and_admitted(core: Any, limit: int, name: str, ns: str) -> None:
    from kubernetes.client.rest import ApiException

    namespace(core, ns)

    def create(name: str, shares: int) -> str:
        """'' when the API server admits the pod (dry run), else its refusal."""
        try:
            core.create_namespaced_pod(
                ns, share_pod_body(name, shares, 100, 64, "default-scheduler", {}), dry_run="All"
            )
            return ""
        except ApiException as err:
            assert err.status == 422, err
            return str(err.body)

    # A new policy takes effect once the API server has compiled it: wait for the first refusal.
    assert wait_until(lambda: bool(create("too-big", limit + 1)), 30)
    message = create("too-big", limit + 1)
    assert (
        f"ValidatingAdmissionPolicy '{name}' with binding '{name}' denied request: container main asks "
        f"for {limit + 1} example.com/gpu-share but no GPU has more than {limit}: one container's shares come "
        "from one GPU. Ask for at most "
        f"{limit} example.com/gpu-share, or for a whole GPU (example.com/gpu)"
    ) in message
    assert create("fits", limit) == ""


def test_dra_claims_scored_by_the_extender_land_on_the_less_fragmenting_node(controlplane: Any) -> None:
    """kube-scheduler alone allocates DRA claims first fit and spreads by CPU (LeastAllocated): the 4-share claim
    would go to the emptier node and split a fresh GPU. The extender's DRA entry sends it to the node whose GPU
    has exactly 4 shares left."""
    from kubernetes import client

    from benchmarks.standin import (
        DRA_DRIVER,
        claim_pod_body,
        create_node,
        device_class,
        every_pod_entry,
        resource_slice,
        share_claim,
    )
    from deviceplugin.extender.service import ExtenderOptions, ExtenderService

    run = secrets.token_hex(3)
    api = controlplane.api_client()
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    labels = {"gpu-share-e2e": f"dra-{run}"}
    ns = f"dra-{run}"
    namespace(core, ns)
    dra_class = f"gpu-share-shares-{run}"  # the session's API server is shared: a class of this test's own
    resource.create_device_class(device_class(dra_class))
    tight, empty = (GpuNode(f"dra-{run}-{k}", gpus=2, cpu_milli=16_000, memory_mib=65_536) for k in ("tight", "empty"))
    for node in (tight, empty):
        create_node(core, node, labels, {})
        resource.create_resource_slice(resource_slice(node))
    # tight: 6 of gpu-0's 10 shares held by an allocated claim, and half its CPU used by a plain pod.
    held = resource.create_namespaced_resource_claim(ns, share_claim("held", 6, dra_class))
    allocation = {
        "devices": {
            "results": [
                {
                    "request": "gpu",
                    "driver": DRA_DRIVER,
                    "pool": tight.name,
                    "device": "gpu-0",
                    "shareID": "0b0c0d0e-0000-4000-8000-00000000000a",
                    "consumedCapacity": {"shares": "6", "memory": str(6 * 8192 << 20)},
                }
            ]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [tight.name]}]}]
        },
    }
    resource.patch_namespaced_resource_claim_status("held", ns, {"status": {"allocation": allocation}})
    busy = share_pod_body("busy", 0, 8000, 1024, "none", labels)
    busy["spec"]["nodeName"] = tight.name
    core.create_namespaced_pod(ns, busy)
    assert held.metadata.uid
    service = ExtenderService(
        controlplane.rest_client(),
        ExtenderOptions(port=0, host="127.0.0.1", policy="fgdstrand", dra_classes=(dra_class,)),
    )
    service.start()
    name = f"gs-dra-{run}"
    try:
        assert wait_until(lambda: service.watch.ready()[0], 30), service.watch.ready()
        url = f"http://127.0.0.1:{service.server.port}"
        config = scheduler_config(name, None)
        config["extenders"] = [every_pod_entry(url, weight=20)]
        controlplane.scheduler(config, name)
        resource.create_namespaced_resource_claim(ns, share_claim("want", 4, dra_class))
        core.create_namespaced_pod(ns, claim_pod_body("p", "want", 1000, 1024, name, labels))

        def allocated() -> Any:
            claim = resource.read_namespaced_resource_claim("want", ns)
            return claim.status.allocation if claim.status else None

        assert wait_until(
            lambda: allocated() is not None and bool(core.read_namespaced_pod("p", ns).spec.node_name), 60
        ), controlplane.log_tail(f"kube-scheduler#{name}")
        (result,) = allocated().devices.results
        assert (result.pool, result.device, core.read_namespaced_pod("p", ns).spec.node_name) == (
            tight.name,
            "gpu-0",
            tight.name,
        )
        assert service.metrics.requests.labels("all-prioritize", "ok")._value.get() >= 1
    finally:
        controlplane.stop_process(f"kube-scheduler#{name}")
        service.stop()


def test_a_reservation_is_made_only_for_the_scheduler_and_ends_when_its_pod_binds_elsewhere_or_is_deleted(
    controlplane: Any, tmp_path: Path
) -> None:
    """Over the API server: a filter with the scheduler's certificate reserves the pod's shares on the nodes it passed;
    one without a certificate is refused and reserves nothing; binding the pod to another node (another scheduler,
    say) and deleting a pod each end the reservation, seen through the extender's pod watch."""
    from kubernetes import client

    from deviceplugin.extender.service import ExtenderOptions, ExtenderService
    from deviceplugin.extender.tls import TLSSettings
    from tests.support.pki import call, client_context

    run = secrets.token_hex(3)
    api = controlplane.api_client()
    core = client.CoreV1Api(api)
    labels = {"gpu-share-e2e": f"reserve-{run}"}
    nodes = [GpuNode(f"reserve-{run}-{k}", gpus=1, cpu_milli=8_000, memory_mib=16_384) for k in ("a", "b", "elsewhere")]
    StandInPlugins(api, nodes, labels).create_nodes()
    ns = f"reserve-{run}"
    namespace(core, ns)
    pki = make_pki(tmp_path / "pki")
    tls = TLSSettings(pki.path("extender.crt"), pki.path("extender.key"), pki.path("ca.crt"), frozenset({CLIENT_NAME}))
    service = ExtenderService(controlplane.rest_client(), ExtenderOptions(port=0, host="127.0.0.1", tls=tls))
    service.start()
    scheduler, anonymous = client_context(pki, pki), client_context(pki, None)

    def filter_call(context: Any, name: str) -> tuple[int, str]:
        body = {
            "Pod": api.sanitize_for_serialization(core.read_namespaced_pod(name, ns)),
            "NodeNames": [nodes[0].name, nodes[1].name],
        }
        return call(service.server.port, context, "POST", "/filter", body)

    def reservations() -> int:
        return service.cache.counts()["reservations"]

    try:
        assert wait_until(lambda: service.watch.ready()[0], 30), service.watch.ready()
        for name in ("binds", "deleted"):
            core.create_namespaced_pod(
                ns, share_pod_body(name, 6, 100, 64, "no-scheduler", labels)
            )  # no scheduler of that name runs
        status, text = filter_call(anonymous, "binds")
        assert status == 401 and reservations() == 0
        status, text = filter_call(scheduler, "binds")
        assert (
            status == 200
            and yaml.safe_load(text)["NodeNames"] == [nodes[0].name, nodes[1].name]
            and reservations() == 1
        )
        # Reserved: the other pod's 6 of 10 shares no longer fit beside it on either node.
        assert yaml.safe_load(filter_call(scheduler, "deleted")[1])["NodeNames"] == [] and reservations() == 1
        binding = {"metadata": {"name": "binds"}, "target": {"apiVersion": "v1", "kind": "Node", "name": nodes[2].name}}
        core.create_namespaced_pod_binding(
            "binds", ns, binding, _preload_content=False
        )  # the client cannot read the answer back
        assert wait_until(lambda: reservations() == 0, 30)
        status, text = filter_call(scheduler, "deleted")
        assert yaml.safe_load(text)["NodeNames"] == [nodes[0].name, nodes[1].name] and reservations() == 1
        core.delete_namespaced_pod("deleted", ns, grace_period_seconds=0)
        assert wait_until(lambda: reservations() == 0, 30)
    finally:
        service.stop()
        for node in nodes:
            core.delete_node(node.name)


def test_the_documented_commands_create_the_secrets_the_shipped_pods_mount(controlplane: Any, tmp_path: Path) -> None:
    """docs/security.md's commands, every one, on the real API server (in a namespace of this test): the two Secrets
    hold the keys the extender's flags and the schedulers' tlsConfig read, and the extender takes the scheduler's."""
    import base64
    import os
    import shutil
    import subprocess

    from kubernetes import client

    from deviceplugin.extender.tls import ServerTLS, TLSSettings
    from tests.support.pki import SERVER_NAME, documented_commands

    core = client.CoreV1Api(controlplane.api_client())
    ns = f"tls-docs-{secrets.token_hex(3)}"
    namespace(core, ns)
    kubectl = controlplane.bin / "kubectl" if (controlplane.bin / "kubectl").is_file() else shutil.which("kubectl")
    assert kubectl is not None
    env = {**os.environ, "KUBECONFIG": str(controlplane.admin_kubeconfig)}
    for command in documented_commands():
        command = command.replace("kubectl -n gpu-share ", f"{kubectl} -n {ns} ")
        proc = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (command, proc.stderr)
    deployment = next(d for d in yaml.safe_load_all((ROOT / "daemonset/extender/01-deployment.yaml").read_text()) if d)
    spec = deployment["spec"]["template"]["spec"]
    flags = dict(a.split("=", 1) for a in spec["containers"][0]["args"] if "=" in a)
    mount = spec["containers"][0]["volumeMounts"][0]["mountPath"] + "/"
    files = tmp_path / "mounted"
    for secret_name, folder in (
        (spec["volumes"][0]["secret"]["secretName"], "extender"),
        ("gpu-share-scheduler-tls", "scheduler"),
    ):
        data = core.read_namespaced_secret(secret_name, ns).data
        assert set(data) == {"tls.crt", "tls.key", "ca.crt"}
        (files / folder).mkdir(parents=True)
        for key, value in data.items():
            (files / folder / key).write_bytes(base64.b64decode(value))
    tls = TLSSettings(
        *(
            str(files / "extender" / flags[f].removeprefix(mount))
            for f in ("--tls-cert-file", "--tls-private-key-file", "--client-ca-file")
        ),
        frozenset(flags["--client-names"].split(",")),
    )
    config = yaml.safe_load((ROOT / "daemonset/extender/scheduler/kube-scheduler-config.yaml").read_text())[
        "extenders"
    ][0]["tlsConfig"]
    assert config["serverName"] == SERVER_NAME
    context = ssl.create_default_context(cafile=str(files / "scheduler" / Path(config["caFile"]).name))
    context.load_cert_chain(
        files / "scheduler" / Path(config["certFile"]).name, files / "scheduler" / Path(config["keyFile"]).name
    )
    server = ServerTLS(tls)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[Any] = []
    thread = threading.Thread(
        target=lambda: accepted.append(server.handshake(listener.accept()[0], 5, lambda waited: False))
    )
    thread.start()
    with context.wrap_socket(socket.create_connection(listener.getsockname()), server_hostname=config["serverName"]):
        thread.join(10)
    assert accepted and server.refusal(accepted[0]) is None  # the scheduler's certificate, the name the extender wants
    accepted[0].close()
    listener.close()

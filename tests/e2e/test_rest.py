"""`kube.rest` against the real API server: kubeconfigs with a token, a token file and client certificates (the CA
verified), every verb, pagination and selectors, a watch and the connection kept alive after it, Status errors. The
DRA driver's start never imports the `kubernetes` package. Against local sockets (hung, trickling, over-bound
servers): `tests/unit/kube/test_rest.py`."""

from __future__ import annotations

import base64
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.kube.rest import ApiAccessError, ApiError, RestClient, load_kubeconfig
from deviceplugin.kube.watch import ResponseTooLarge, watch_events


def _kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    return path


def _namespace(api: RestClient) -> str:
    name = f"rest-{uuid.uuid4().hex[:8]}"
    api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def test_every_verb_with_a_token_kubeconfig(controlplane: Any) -> None:
    api = RestClient(load_kubeconfig(controlplane.admin_kubeconfig))
    ns = _namespace(api)
    maps = f"/api/v1/namespaces/{ns}/configmaps"
    for i in range(5):
        api.create(maps, {"metadata": {"name": f"m{i}", "labels": {"parity": str(i % 2)}}, "data": {"i": str(i)}})
    pages = list(api.pages(maps, limit=2))
    assert [len(p["items"]) for p in pages] == [2, 2, 1]
    odd = api.list(maps, label_selector="parity=1")["items"]
    assert sorted(m["metadata"]["name"] for m in odd) == ["m1", "m3"]
    assert [m["metadata"]["name"] for m in api.list(maps, field_selector="metadata.name=m4")["items"]] == ["m4"]
    api.patch(f"{maps}/m0", {"data": {"merge": "1"}}, "merge")
    api.patch(f"{maps}/m0", {"data": {"strategic": "1"}}, "strategic")
    applied = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "m0", "namespace": ns},
        "data": {"apply": "1"},
    }
    api.patch(f"{maps}/m0", applied, "apply", field_manager="rest-test", force=True)
    assert api.get(f"{maps}/m0")["data"] == {"i": "0", "merge": "1", "strategic": "1", "apply": "1"}
    version = api.list(maps)["metadata"]["resourceVersion"]
    response = api.watch(maps, version, field_selector="metadata.name=m1", seconds=5, silence=5.0)
    api.delete(f"{maps}/m1")
    try:
        event = next(e for e in watch_events(response, 1 << 20) if e["type"] != "BOOKMARK")
    finally:
        response.release_conn()
    assert event["type"] == "DELETED" and event["object"]["metadata"]["name"] == "m1"
    with pytest.raises(ApiError) as gone:
        api.get(f"{maps}/m1")
    assert (gone.value.status, gone.value.reason) == (404, "NotFound")
    assert gone.value.message == 'configmaps "m1" not found'
    with pytest.raises(ResponseTooLarge, match="over 100 bytes"):
        api.list(maps, max_bytes=100)
    api.delete(f"/api/v1/namespaces/{ns}")


def test_client_certificates_and_a_verified_ca_from_data_fields(controlplane: Any, tmp_path: Path) -> None:
    pki = controlplane.work / "pki"

    def data(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    path = _kubeconfig(
        tmp_path / "certs.kubeconfig",
        {"server": controlplane.server, "certificate-authority-data": data("ca.crt")},
        {"client-certificate-data": data("admin.crt"), "client-key-data": data("admin.key")},
    )
    connection = load_kubeconfig(path)
    assert connection.verify and connection.ca_data and connection.cert_data and not connection.cert_file
    api = RestClient(connection)
    assert api.get("/version")["major"]
    assert api._pool.pool is not None
    api._pool.pool.get(block=False).close()  # its idle connection: the next call connects again, reading no file
    assert api.get("/version")["major"]
    files = _kubeconfig(
        tmp_path / "files.kubeconfig",
        {"server": controlplane.server, "certificate-authority": str(pki / "ca.crt")},
        {"client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")},
    )
    assert RestClient(load_kubeconfig(files)).get("/version")["major"]
    other_ca = tmp_path / "other-ca.crt"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(tmp_path / "k"),
            "-out",
            str(other_ca),
            "-days",
            "1",
            "-subj",
            "/CN=other",
        ],
        check=True,
        capture_output=True,
    )
    wrong = _kubeconfig(
        tmp_path / "wrong.kubeconfig",
        {"server": controlplane.server, "certificate-authority": str(other_ca)},
        {"token": controlplane.admin_token},
    )
    with pytest.raises(ApiError, match="CERTIFICATE_VERIFY_FAILED"):
        RestClient(load_kubeconfig(wrong)).get("/version")


def test_a_token_file_is_read_again_when_it_changes(controlplane: Any, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("not-a-token\n")
    path = _kubeconfig(
        tmp_path / "k", {"server": controlplane.server, "insecure-skip-tls-verify": True}, {"tokenFile": str(token)}
    )
    api = RestClient(load_kubeconfig(path))
    with pytest.raises(ApiError) as refused:
        api.get("/api/v1/namespaces/default")
    assert refused.value.status == 401
    token.write_text(controlplane.admin_token + "\n")
    assert api.get("/api/v1/namespaces/default")["metadata"]["name"] == "default"


@pytest.mark.parametrize(
    "user, field",
    [
        ({"exec": {"command": "x"}}, "exec"),
        ({"auth-provider": {"name": "gcp"}}, "auth-provider"),
        ({"username": "a", "password": "b"}, "password"),
    ],
)
def test_unsupported_kubeconfig_fields_are_refused_by_name(tmp_path: Path, user: dict[str, Any], field: str) -> None:
    path = _kubeconfig(tmp_path / "k", {"server": "https://127.0.0.1:1"}, user)
    with pytest.raises(ApiAccessError, match=f"user field '{field}' is not supported"):
        load_kubeconfig(path)


def test_the_api_server_keeps_the_connection_alive_after_a_watch_ends(controlplane: Any) -> None:
    """kube-apiserver ends a watch at its timeoutSeconds with the connection kept alive: the next call reuses it
    (tests/support/fake_kube.py answers the same; docs/kubelet.md, which facts are verified)."""
    api = RestClient(load_kubeconfig(controlplane.admin_kubeconfig))
    version = api.list("/api/v1/namespaces", limit=1)["metadata"]["resourceVersion"]
    response = api.watch("/api/v1/namespaces", version, seconds=1)
    assert all(e["type"] in ("BOOKMARK", "ADDED", "MODIFIED") for e in watch_events(response, 1 << 20))  # ends
    response.release_conn()
    made = api._pool.num_connections
    api.list("/api/v1/namespaces", limit=1)
    assert api._pool.num_connections == made  # reused: the server did not close it


_PROBE = """
import os, runpy, sys
real_exit = os._exit
def exit_reporting(status):  # the driver ends with os._exit (signals.exit_now): report first
    open(REPORT, "w").write(" ".join(sorted(m for m in sys.modules if m.split(".")[0] == "kubernetes")) or "none")
    real_exit(status)
os._exit = exit_reporting
sys.argv[0] = "gpu-share"
runpy.run_module("deviceplugin.cli", run_name="__main__")
"""


def test_the_dra_driver_never_imports_the_kubernetes_package(controlplane: Any, tmp_path: Path) -> None:
    """A claim prepared and its status written, the slice published, labels and the Node read, then SIGTERM: at exit
    no `kubernetes` module is in sys.modules."""
    from tests.e2e.test_dra_node import DRIVER, Driver, _allocate, _claim, _ref
    from tests.support.kubeobjects import namespace, ready_node, request, slices

    api = controlplane.api_client()
    node_name = f"rest-{uuid.uuid4().hex[:8]}"
    ready_node(api, node_name)
    ns = namespace(api, node_name)
    report = tmp_path / "modules"
    probe = _PROBE.replace("REPORT", repr(str(report)))
    driver = Driver(controlplane, node_name)
    driver.args = [sys.executable, "-c", probe, *driver.args[3:]]
    try:
        driver.start()
        driver.kubelet.wait_registered(DRIVER, timeout=30)
        claim = _allocate(api, _claim(api, ns, "c", "any", 1), node_name, "gpu-0", 1)
        driver.kubelet.prepare(DRIVER, [_ref(claim)])
        deadline = time.monotonic() + 30
        while not slices(api, node_name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slices(api, node_name)
        assert driver.stop() == 0, driver.log()
    finally:
        driver.close()
        request(api, "DELETE", f"/api/v1/nodes/{node_name}")  # the session's API server is shared
    assert report.read_text() == "none", f"the driver imported {report.read_text()}"


def test_list_pages_are_bounded_by_bytes(controlplane: Any) -> None:
    """The list-then-watch loop (`kube.listwatch`, here as the extender's): a page over the byte bound is read again at
    half the size; a single object over it fails the list."""
    from deviceplugin.extender import watch

    admin = RestClient(load_kubeconfig(controlplane.admin_kubeconfig))
    ns = _namespace(admin)
    for i in range(6):
        admin.create(f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": f"m{i}"}, "data": {"x": "y" * 4000}})
    listed: list[dict[str, Any]] = []
    every = watch.ResourceWatch(
        "configmaps", admin, f"/api/v1/namespaces/{ns}/configmaps", listed.extend, lambda kind, obj: None
    )
    every.max_page_bytes = 10_000  # two of these ConfigMaps, not 500
    every._list()
    assert sorted(m["metadata"]["name"] for m in listed) == [f"m{i}" for i in range(6)]
    every.max_page_bytes = 3_000
    with pytest.raises(ResponseTooLarge, match="configmaps: response over 3000 bytes"):
        every._list()
    admin.delete(f"/api/v1/namespaces/{ns}")


def test_resource_claims_offer_no_field_selector_beyond_name_and_namespace(controlplane: Any) -> None:
    """Why the DRA driver lists every claim (docs/dra.md): v1.36 refuses a selector on the allocation's pool or node."""
    api = RestClient(load_kubeconfig(controlplane.admin_kubeconfig))
    claims = "/apis/resource.k8s.io/v1/resourceclaims"
    for selector in ("status.allocation.devices.results.pool=n", "status.allocation.nodeSelector=n", "spec.nodeName=n"):
        with pytest.raises(ApiError) as refused:
            api.list(claims, field_selector=selector)
        assert refused.value.status == 400 and "is not a known field selector" in refused.value.message, refused.value
    assert api.list(claims, field_selector="metadata.namespace=default")["kind"] == "ResourceClaimList"


def test_in_cluster_credentials_verify_the_ca_and_follow_a_rotated_token(
    controlplane: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deviceplugin.kube import rest

    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes((controlplane.work / "pki" / "ca.crt").read_bytes())
    (account / "token").write_text("expired")
    monkeypatch.setattr(rest, "SERVICE_ACCOUNT", account)
    port = controlplane.server.rsplit(":", 1)[1]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    api = rest.connect()
    assert api.connection.verify and api.connection.token_file == str(account / "token")
    with pytest.raises(ApiError) as refused:
        api.get("/version", timeout=5)
    assert refused.value.status == 401
    rotated = account / "token.new"  # the kubelet swaps a projected token in with a rename
    rotated.write_text(controlplane.admin_token)
    rotated.replace(account / "token")
    assert api.get("/api/v1/namespaces/default")["metadata"]["name"] == "default"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ApiAccessError, match="not in a cluster.*no kubeconfig at"):
        rest.connect()

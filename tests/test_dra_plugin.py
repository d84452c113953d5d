"""The DRA kubelet plugin over real gRPC on real Unix sockets, driven by the fake kubelet
(tests/support/dra_kubelet.py):
registration, prepare / repeat / unprepare on v1 and v1beta1, per-claim errors, health, a 1,000-claim batch, a claim's
SharingConfig in its CDI env."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.api import dra_health_v1alpha1_pb2 as health_pb
from deviceplugin.dra.devices import ClaimError
from deviceplugin.dra.kubeletplugin import KubeletPlugin, PluginSettings
from deviceplugin.dra.prepare import ClaimRef
from deviceplugin.dra.registration import PluginPaths
from deviceplugin.state import NodeState
from tests.conftest import wait_until
from tests.support.dra import DRIVER, claim, make_driver, result
from tests.support.dra_kubelet import FakeDraKubelet, PrepareError


class Claims:
    """An in-memory claim source (the API-backed one is tested against a real API server in test_dra_e2e.py)."""

    def __init__(self) -> None:
        self.bodies: dict[str, dict[str, Any]] = {}

    def add(self, results: list[dict[str, Any]], **kw: Any) -> tuple[str, str, str]:
        ref, body = claim(results, **kw)
        self.bodies[ref.uid] = body
        return (ref.namespace, ref.name, ref.uid)

    def cached(self, ref: ClaimRef) -> dict[str, Any] | None:
        return None  # every claim is read with get(), as on its first prepare

    def get(self, ref: ClaimRef, timeout: float) -> dict[str, Any]:
        if ref.uid not in self.bodies:
            raise ClaimError(f"claim {ref} not found in the API")
        return self.bodies[ref.uid]


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gs-dra-", dir="/tmp"))  # socket paths must stay under 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(root: Path, known: tuple[str, ...] | None = None, state: NodeState | None = None, **settings: Any):
    state = state or NodeState()
    claims = Claims()
    driver = make_driver(root, state=state)
    paths = PluginPaths(root / "plugins_registry", root / "plugins", DRIVER)
    plugin = KubeletPlugin(driver, claims, state, paths, PluginSettings(**settings))
    kubelet = FakeDraKubelet(paths.registrar_dir, **({"known": known} if known else {})).start()
    plugin.start()
    return plugin, kubelet, claims, paths


@pytest.fixture
def started(root: Path):
    items: list[tuple[KubeletPlugin, FakeDraKubelet]] = []

    def start(**kw: Any):
        plugin, kubelet, claims, paths = _start(root, **kw)
        items.append((plugin, kubelet))
        return plugin, kubelet, claims, paths

    yield start
    for plugin, kubelet in items:
        kubelet.stop()
        plugin.stop()


def test_registration_advertises_v1_first_and_an_absolute_endpoint_served_before_the_registration_socket(
    started,
) -> None:
    plugin, kubelet, _, paths = started()
    driver = kubelet.wait_registered(DRIVER)
    assert driver.service == "v1.DRAPlugin" and driver.endpoint == str(paths.dra_socket) == str(
        paths.plugins_dir / DRIVER / "dra.sock"
    )
    assert paths.registration_socket == paths.registrar_dir / f"{DRIVER}-reg.sock"
    assert plugin.registration.registered.wait(5)
    plugin.stop()
    assert kubelet.wait_deregistered(DRIVER)
    assert not paths.dra_socket.exists() and not paths.registration_socket.exists()


def test_prepare_repeat_and_unprepare_over_v1(started) -> None:
    plugin, kubelet, claims, _ = started()
    kubelet.wait_registered(DRIVER)
    ref = claims.add([result("gpu-0", shares=2, request="gpu/small")])
    first = kubelet.prepare(DRIVER, [ref])[ref[2]]
    (device,) = first
    assert list(device.request_names) == ["gpu"] and device.pool_name == "2xT4" and device.device_name == "gpu-0"
    assert device.share_id == claims.bodies[ref[2]]["status"]["allocation"]["devices"]["results"][0]["shareID"]
    assert list(device.cdi_device_ids) == [f"k8s.{DRIVER}/claim={ref[2]}-0"]
    again = kubelet.prepare(DRIVER, [ref])[ref[2]]
    assert [list(d.cdi_device_ids) for d in again] == [list(device.cdi_device_ids)]
    assert plugin.driver.ledger() == {"gpu-0": 2}
    kubelet.unprepare(DRIVER, [ref])
    kubelet.unprepare(DRIVER, [ref])  # idempotent
    assert plugin.driver.ledger() == {} and not any(plugin.driver.cdi.root.glob("*.json"))


def test_an_older_kubelet_takes_v1beta1_and_gets_the_same_devices_without_share_ids(started) -> None:
    plugin, kubelet, claims, _ = started(known=("v1beta1.DRAPlugin",))
    assert kubelet.wait_registered(DRIVER).service == "v1beta1.DRAPlugin"
    ref = claims.add([result("gpu-1", shares=1)])
    (device,) = kubelet.prepare(DRIVER, [ref])[ref[2]]
    assert device.device_name == "gpu-1" and list(device.cdi_device_ids) == [f"k8s.{DRIVER}/claim={ref[2]}-0"]
    assert not hasattr(device, "share_id")
    kubelet.unprepare(DRIVER, [ref])
    assert plugin.driver.ledger() == {}


def test_per_claim_errors_are_in_the_map_and_the_ledger_refuses_a_fifth_share(started) -> None:
    plugin, kubelet, claims, _ = started()
    kubelet.wait_registered(DRIVER)
    full = claims.add([result("gpu-0", shares=4)])
    kubelet.prepare(DRIVER, [full])
    over = claims.add([result("gpu-0", shares=1)])
    gone = ("default", "gone", "00000000-0000-0000-0000-000000000000")
    errors = kubelet.prepare_errors(DRIVER, [over, gone, full])
    assert set(errors) == {over[2], gone[2], full[2]} and errors[full[2]] == ""
    assert "gpu-0 has 4 shares; prepared claims hold 4 and this claim needs 1" in errors[over[2]]
    assert "not found" in errors[gone[2]]
    with pytest.raises(PrepareError, match="NodePrepareResources failed for ResourceClaim"):
        kubelet.prepare(DRIVER, [over])


def test_health_streams_every_device_and_an_unhealthy_gpu_is_refused(started) -> None:
    state = NodeState()
    plugin, kubelet, claims, _ = started(state=state, health_interval=0.2)
    health = kubelet.wait_health(DRIVER, lambda h: len(h) == 2)
    assert health == {"2xT4/gpu-0": (health_pb.HEALTHY, "healthy"), "2xT4/gpu-1": (health_pb.HEALTHY, "healthy")}
    driver = kubelet.wait_registered(DRIVER)
    count = driver.health_messages
    kubelet.wait_health(DRIVER, lambda h: driver.health_messages >= count + 2)  # resent while nothing changes
    gpu1 = plugin.driver.devices[1].unit.gpu.uuid
    state.set_health({gpu1: "XID 48 (double-bit ECC error)"})
    health = kubelet.wait_health(DRIVER, lambda h: h["2xT4/gpu-1"][0] == health_pb.UNHEALTHY)
    assert "XID 48" in health["2xT4/gpu-1"][1] and health["2xT4/gpu-0"][0] == health_pb.HEALTHY
    ref = claims.add([result("gpu-1", shares=1)])
    assert "device gpu-1 is Unhealthy" in kubelet.prepare_errors(DRIVER, [ref])[ref[2]]
    state.set_health({})
    kubelet.wait_health(DRIVER, lambda h: h["2xT4/gpu-1"][0] == health_pb.HEALTHY)
    assert kubelet.prepare(DRIVER, [ref])[ref[2]][0].device_name == "gpu-1"


def test_a_thousand_claims_in_one_call(started) -> None:
    plugin, kubelet, claims, _ = started()
    kubelet.wait_registered(DRIVER)
    refs = [claims.add([result(f"gpu-{i % 2}", shares=1)], name=f"c{i}") for i in range(1000)]
    errors = kubelet.prepare_errors(DRIVER, refs)
    assert len(errors) == 1000
    ok = [uid for uid, error in errors.items() if not error]
    assert len(ok) == 8  # 2 GPUs x 4 shares; the ledger refuses the rest, each with its message
    assert all("has 4 shares" in e for e in errors.values() if e)
    kubelet.unprepare(DRIVER, refs)
    assert plugin.driver.ledger() == {} and plugin.driver.prepared() == []


def test_a_cached_claim_is_prepared_while_another_pods_claim_read_hangs(root: Path) -> None:
    """The kubelet prepares each pod on its own: pod A's claim read hangs, pod B's (cached, prepared before) is
    answered."""
    import threading

    from tests.support.dra import MemoryClaims

    state, source = NodeState(), MemoryClaims()
    driver = make_driver(root, state=state)
    paths = PluginPaths(root / "plugins_registry", root / "plugins", DRIVER)
    plugin = KubeletPlugin(driver, source, state, paths)
    kubelet = FakeDraKubelet(paths.registrar_dir).start()
    plugin.start()
    try:
        kubelet.wait_registered(DRIVER)
        b_ref, b = claim([result("gpu-0", shares=1)], name="b")
        a_ref, a = claim([result("gpu-1", shares=1)], name="a")
        source.put(b)
        source.put(a)
        kubelet.prepare(DRIVER, [(b_ref.namespace, b_ref.name, b_ref.uid)])
        release = source.hang[a_ref.uid] = threading.Event()
        pod_a = threading.Thread(
            target=kubelet.prepare_errors, args=(DRIVER, [(a_ref.namespace, a_ref.name, a_ref.uid)])
        )
        pod_a.start()
        assert wait_until(lambda: a_ref.uid in source.gets, 10)
        (device,) = kubelet.prepare(DRIVER, [(b_ref.namespace, b_ref.name, b_ref.uid)])[b_ref.uid]
        assert device.device_name == "gpu-0" and pod_a.is_alive() and not release.is_set()
        release.set()
        pod_a.join()
        assert plugin.driver.ledger() == {"gpu-0": 1, "gpu-1": 1}
    finally:
        kubelet.stop()
        plugin.stop()


def test_a_claim_named_twice_in_one_call_gets_its_devices_once(started) -> None:
    plugin, kubelet, claims, _ = started()
    kubelet.wait_registered(DRIVER)
    ref = claims.add([result("gpu-0", shares=1)])
    assert [d.device_name for d in kubelet.prepare(DRIVER, [ref, ref])[ref[2]]] == ["gpu-0"]
    assert plugin.driver.ledger() == {"gpu-0": 1}


def test_the_after_prepare_hook_gets_the_prepared_claims_and_cannot_fail_the_prepare(started) -> None:
    """The claims' status writer hangs off `after_prepare` (dra.claimstatus): it gets every claim prepared in the
    call, not the refused ones, and whatever it raises the kubelet gets the prepared devices."""
    plugin, kubelet, claims, _ = started()
    kubelet.wait_registered(DRIVER)
    seen: list[list[str]] = []

    def hook(prepared: list[Any]) -> None:
        seen.append(sorted(c.uid for c in prepared))
        raise RuntimeError("the API is down")

    plugin.after_prepare = hook
    good = claims.add([result("gpu-0", shares=2)])
    bad = claims.add([result("gpu-9", shares=1)])  # no such device: refused
    devices = kubelet.prepare(DRIVER, [good])[good[2]]
    assert [d.device_name for d in devices] == ["gpu-0"]
    assert "gpu-9" in kubelet.prepare_errors(DRIVER, [bad])[bad[2]]
    assert seen == [[good[2]]]  # the refused claim's call prepared nothing: no call


def test_a_claims_sharing_config_reaches_its_containers_env_over_the_wire(started) -> None:
    """SharingConfig through NodePrepareResources: a lower MPS limit in the CDI spec the runtime injects, the class's
    config before the claim's (the claim's wins, a `requests` filter narrows it), and a value over what the claim
    consumed refused for that claim alone, naming the field."""
    import json

    from deviceplugin.dra.sharingconfig import api_version

    def config(percent: int, source: str, requests: list[str] | None = None) -> dict[str, Any]:
        mps = {"strategy": "mps", "mpsConfig": {"defaultActiveThreadPercentage": percent}}
        parameters = {"apiVersion": api_version(DRIVER), "kind": "SharingConfig", "sharing": mps}
        entry = {"source": source, "opaque": {"driver": DRIVER, "parameters": parameters}}
        return {**entry, "requests": requests} if requests else entry

    def env(uid: str, cdi_id: str) -> dict[str, str]:
        """The env the runtime injects for a CDI ID the kubelet got: its device in the claim's spec file."""
        spec = json.loads(plugin.driver.cdi.spec_path(uid).read_text())
        device = next(d for d in spec["devices"] if f"{spec['kind']}={d['name']}" == cdi_id)
        return dict(e.split("=", 1) for e in device["containerEdits"]["env"])

    plugin, kubelet, claims, _ = started()
    kubelet.wait_registered(DRIVER)
    merged = claims.add([result("gpu-0", shares=2, request="a"), result("gpu-1", shares=2, request="b")])
    claims.bodies[merged[2]]["status"]["allocation"]["devices"]["config"] = [
        {"source": "FromClass", "opaque": {"driver": "gpu.nvidia.com", "parameters": {"kind": "GpuConfig"}}},  # unread
        config(40, "FromClass"),
        config(15, "FromClaim", requests=["a"]),
    ]
    too_high = claims.add([result("gpu-0", shares=1)], name="greedy")
    claims.bodies[too_high[2]]["status"]["allocation"]["devices"]["config"] = [config(30, "FromClaim")]
    errors = kubelet.prepare_errors(DRIVER, [merged, too_high])
    assert errors[merged[2]] == ""
    field = "config[0] (FromClaim): sharing.mpsConfig.defaultActiveThreadPercentage"
    assert f"{field}: 30 is more than the 25 % the claim consumed" in errors[too_high[2]]
    devices = {d.request_names[0]: d for d in kubelet.prepare(DRIVER, [merged])[merged[2]]}
    a, b = (env(merged[2], devices[r].cdi_device_ids[0]) for r in ("a", "b"))
    assert a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "15" and b["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert a["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == b["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=7680M"  # 2 of 4 shares
    assert plugin.driver.ledger() == {"gpu-0": 2, "gpu-1": 2}

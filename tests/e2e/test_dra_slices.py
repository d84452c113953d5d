"""The slice publisher against the real API server: the pool it publishes, taints from the node state within a
second, republishing after the kubelet's wipe and after foreign edits, backoff while the Node is missing, a prompt
stop."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.config.parse import parse_config_text
from deviceplugin.config.types import default_config
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.dra.devices import MAX_DEVICES_PER_SLICE
from deviceplugin.dra.slices import SlicePublisher
from deviceplugin.kube.dranames import driver_name
from deviceplugin.state import NodeState
from tests.conftest import EXAMPLES, node, wait_until
from tests.support.kubeobjects import ready_node, request, slices
from tests.support.resources import resources_of

DRIVER = driver_name("example.com")
_names = itertools.count()


def fresh(prefix: str) -> str:
    return f"{prefix}-{next(_names)}-{int(time.time() * 1000) % 100000}"


@pytest.fixture
def publish(controlplane: Any) -> Iterator[Any]:
    """publish(node_file, config_file, node_name=None) -> (publisher, state, node info, node name), started."""
    started: list[SlicePublisher] = []

    def start(
        node_file: str | Path = "8xA100-80GB-mig",
        config_file: str = "mig-mixed",
        name: str | None = None,
        create_node: bool = True,
    ):
        api = controlplane.api_client()
        name = name or fresh("dra")
        if create_node:
            ready_node(api, name)
        info = node(node_file) if isinstance(node_file, str) else SimulatedInventory.from_file(node_file).discover()
        config = parse_config_text((EXAMPLES / "config" / f"{config_file}.yaml").read_text(), config_file)
        state = NodeState()
        publisher = SlicePublisher(
            controlplane.rest_client(),
            name,
            DRIVER,
            info,
            state,
            resync_interval=30.0,
            backoff_initial=0.02,
            backoff_max=0.2,
            request_timeout=5.0,
        )
        publisher.on_config(config, resources_of(config, info))
        publisher.start()
        started.append(publisher)
        return publisher, state, info, name, api

    yield start
    for publisher in started:
        publisher.stop()


def test_the_pool_is_published_as_slices_owned_by_the_node(publish: Any) -> None:
    publisher, _, info, name, api = publish()
    assert publisher.wait_published(10)
    found = slices(api, name)
    assert [s["metadata"]["name"] for s in found] == [f"{name}-{DRIVER}-0000"]
    spec = found[0]["spec"]
    assert (
        spec["driver"] == DRIVER
        and spec["nodeName"] == name
        and spec["pool"] == {"name": name, "generation": 1, "resourceSliceCount": 1}
    )
    node_uid = request(api, "GET", f"/api/v1/nodes/{name}")["metadata"]["uid"]
    assert found[0]["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid, "controller": True}
    ]
    names = [d["name"] for d in spec["devices"]]
    assert names[:2] == ["gpu-0-mig-1-0", "gpu-0-mig-2-0"] and "gpu-7" in names
    shared = next(d for d in spec["devices"] if d["name"] == "gpu-7")
    assert shared["allowMultipleAllocations"] is True and set(shared["capacity"]) == {"shares", "memory"}
    assert publisher.stats.errors == {"publish": 0, "watch": 0}
    metrics = {(s.name, tuple(s.labels.items())): s.value for m in publisher.collector().collect() for s in m.samples}
    assert metrics[("gpushare_dra_slice_writes_total", (("operation", "create"),))] == 1
    assert metrics[("gpushare_dra_slices", ())] == 1 and metrics[("gpushare_dra_pool_generation", ())] == 1


def test_more_than_64_devices_are_several_slices_and_no_device_is_one_empty_slice(
    publish: Any, tmp_path: Path, caplog: Any
) -> None:
    gpus = [
        {
            "index": i,
            "uuid": f"GPU-00000000-0000-4000-8000-{i:012d}",
            "model": "NVIDIA H100 80GB HBM3",
            "memoryMiB": 81559,
        }
        for i in range(70)
    ]
    (tmp_path / "node.yaml").write_text(yaml.safe_dump({"name": "big", "gpus": gpus}))
    publisher, state, info, name, api = publish(tmp_path / "node.yaml", "default")
    assert publisher.wait_published(10)
    found = slices(api, name)
    assert [len(s["spec"]["devices"]) for s in found] == [MAX_DEVICES_PER_SLICE, 6]
    assert [s["spec"]["pool"] for s in found] == [{"name": name, "generation": 1, "resourceSliceCount": 2}] * 2
    assert found[0]["spec"]["devices"][0]["name"] == "gpu-0" and found[1]["spec"]["devices"][0]["name"] == "gpu-64"
    # A taint on a device of each slice changes both: the next generation, every slice rewritten.
    state.set_health({info.gpus[0].uuid: "XID 31", info.gpus[65].uuid: "XID 31"})
    assert publisher.wait_published(2)
    assert [s["spec"]["pool"]["generation"] for s in slices(api, name)] == [2, 2]
    # One slice changing keeps the generation.
    state.set_health({info.gpus[0].uuid: "XID 31"})
    assert publisher.wait_published(2)
    assert [s["spec"]["pool"]["generation"] for s in slices(api, name)] == [2, 2]
    publisher.on_config(default_config(), [])  # a profile serving nothing on this node
    assert publisher.wait_published(2)
    found = slices(api, name)
    assert (
        len(found) == 1
        and found[0]["spec"].get("devices", []) == []
        and found[0]["spec"]["pool"]["resourceSliceCount"] == 1
    )
    assert "changed ResourceSlice" not in caplog.text  # the server kept every write as sent


def test_an_xid_taints_the_gpu_and_its_mig_instances_within_a_second_and_recovery_removes_it(publish: Any) -> None:
    publisher, state, info, name, api = publish()
    assert publisher.wait_published(10)
    assert wait_until(lambda: publisher.watch.streams >= 1, timeout=5) and publisher.wait_published(
        5
    )  # the watch's first look
    lists, updates = publisher.stats.rounds, publisher.stats.writes["update"]
    gpu0 = info.gpus[0]
    started = time.monotonic()
    state.set_health({gpu0.uuid: "XID 79"}, frozenset({gpu0.uuid}))
    assert publisher.wait_published(1.0)
    took = time.monotonic() - started
    assert (publisher.stats.rounds, publisher.stats.writes["update"]) == (lists, updates + 1)  # one PUT, no list
    devices = slices(api, name)[0]["spec"]["devices"]
    tainted = {d["name"]: d.get("taints", []) for d in devices}
    assert took < 1.0
    for device, taints in tainted.items():
        if device.startswith("gpu-0-"):
            assert [(t["key"], t["value"], t["effect"]) for t in taints] == [
                (f"{DRIVER}/unhealthy", "reset-required", "NoSchedule")
            ]
            assert taints[0]["timeAdded"]
        else:
            assert taints == []
    state.set_health({})
    assert publisher.wait_published(1.0)
    assert all("taints" not in d for d in slices(api, name)[0]["spec"]["devices"])


def test_the_kubelets_wipe_and_a_foreign_edit_are_repaired_at_once(publish: Any) -> None:
    publisher, _, _, name, api = publish()
    assert publisher.wait_published(10)
    original = slices(api, name)[0]
    request(
        api, "DELETE", "/apis/resource.k8s.io/v1/resourceslices", query=[("fieldSelector", f"spec.nodeName={name}")]
    )
    started = time.monotonic()
    assert wait_until(lambda: len(slices(api, name)) == 1, timeout=5)
    took = time.monotonic() - started
    assert took < 2.0, took
    assert slices(api, name)[0]["spec"]["devices"] == original["spec"]["devices"]
    edited = slices(api, name)[0]
    edited["spec"]["devices"] = edited["spec"]["devices"][:1]
    request(api, "PUT", f"/apis/resource.k8s.io/v1/resourceslices/{edited['metadata']['name']}", edited)
    assert wait_until(
        lambda: len(slices(api, name)[0]["spec"]["devices"]) == len(original["spec"]["devices"]), timeout=5
    )


def test_a_missing_node_is_retried_with_backoff_counted_and_published_once_it_exists(publish: Any, caplog: Any) -> None:
    name = fresh("late")
    publisher, _, _, _, api = publish(name=name, create_node=False)
    assert wait_until(lambda: publisher.stats.errors["publish"] >= 2, timeout=5)
    assert "404" in publisher.stats.last_error or "Not Found" in publisher.stats.last_error
    assert "DRA slices (publish) failed, retrying with backoff" in caplog.text
    errors = {
        tuple(s.labels.items()): s.value
        for m in publisher.collector().collect()
        for s in m.samples
        if m.name == "gpushare_dra_slice_errors"
    }
    assert errors[(("loop", "publish"),)] >= 2
    assert not publisher.wait_published(0.05)
    ready_node(api, name)
    assert publisher.wait_published(5)
    assert len(slices(api, name)) == 1


def test_stop_ends_both_threads_promptly(publish: Any) -> None:
    publisher, *_ = publish()
    assert publisher.wait_published(10)
    assert wait_until(lambda: publisher.watch.streams >= 1, timeout=5)
    started = time.monotonic()
    publisher.stop()
    assert time.monotonic() - started < 1.0
    assert not publisher.running


def test_two_writers_that_disagree_cost_a_few_writes_per_second_not_a_loop(controlplane: Any) -> None:
    api = controlplane.api_client()
    name = fresh("fight")
    ready_node(api, name)
    info = node("2xT4")
    publishers = []
    for replicas in (4, 8):  # two driver versions side by side, each sure of its own slices
        config = parse_config_text(f"version: v1\npools: [{{name: s, mode: shared, replicas: {replicas}}}]\n", "fight")
        publisher = SlicePublisher(
            controlplane.rest_client(),
            name,
            DRIVER,
            info,
            NodeState(),
            backoff_initial=0.02,
            backoff_max=0.2,
            write_burst=3,
            write_rate=2.0,
        )
        publisher.on_config(config, resources_of(config, info))
        publishers.append(publisher)
    try:
        started = time.monotonic()
        for publisher in publishers:
            publisher.start()
        assert wait_until(lambda: any(p.stats.deferred > 0 for p in publishers), timeout=10)  # the limit holds one back
        time.sleep(2.0)  # let them fight: the bound below is per elapsed time
        elapsed = time.monotonic() - started
        for publisher in publishers:
            writes = sum(publisher.stats.writes.values())
            assert writes <= 3 + 2.0 * elapsed + 2, (writes, elapsed)
    finally:
        for publisher in publishers:
            publisher.stop()


def test_in_a_rolling_update_the_newer_instance_publishes_and_the_older_stops_writing(controlplane: Any) -> None:
    """Two instances of the driver on one node that disagree (an old and a new version): each stamps its slices
    (`<driver>/writer`, its start time first); the older, once it sees a newer stamp, stops writing for good."""
    api = controlplane.api_client()
    name = fresh("rolling")
    ready_node(api, name)
    info = node("2xT4")

    def publisher(replicas: int, writer: str) -> SlicePublisher:
        config = parse_config_text(
            f"version: v1\npools: [{{name: s, mode: shared, replicas: {replicas}}}]\n", "rolling"
        )
        p = SlicePublisher(
            controlplane.rest_client(),
            name,
            DRIVER,
            info,
            NodeState(),
            backoff_initial=0.02,
            backoff_max=0.2,
            writer=writer,
        )
        p.on_config(config, resources_of(config, info))
        return p

    def shares() -> set[str]:
        return {d["capacity"]["shares"]["value"] for s in slices(api, name) for d in s["spec"]["devices"]}

    old, new = publisher(4, "1000-old-pod"), publisher(8, "2000-new-pod")
    try:
        old.start()
        assert old.wait_published(10) and shares() == {"4"}
        assert slices(api, name)[0]["metadata"]["annotations"] == {f"{DRIVER}/writer": "1000-old-pod"}
        new.start()
        assert wait_until(lambda: old.stats.superseded_by == "2000-new-pod", timeout=10)
        assert new.wait_published(10) and shares() == {"8"}
        writes = sum(old.stats.writes.values())
        request(api, "DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{slices(api, name)[0]['metadata']['name']}")
        assert wait_until(lambda: shares() == {"8"}, timeout=10)  # repaired by the newer instance...
        time.sleep(0.5)
        assert sum(old.stats.writes.values()) == writes  # ...never by the older one
        assert slices(api, name)[0]["metadata"]["annotations"] == {f"{DRIVER}/writer": "2000-new-pod"}
        samples = {s.name: s.value for m in old.collector().collect() for s in m.samples}
        assert samples["gpushare_dra_slices_superseded"] == 1
    finally:
        old.stop()
        new.stop()


def test_a_write_in_between_is_a_409_read_again_and_retried_at_once(publish: Any) -> None:
    publisher, state, info, name, api = publish()
    assert publisher.wait_published(10)
    replace = publisher.api.replace

    def someone_writes_first(obj: dict[str, Any]) -> dict[str, Any]:
        current = request(api, "GET", f"/apis/resource.k8s.io/v1/resourceslices/{obj['metadata']['name']}")
        current["metadata"].setdefault("labels", {})["touched"] = "yes"
        request(api, "PUT", f"/apis/resource.k8s.io/v1/resourceslices/{obj['metadata']['name']}", current)
        publisher.api.replace = replace  # once
        return replace(obj)

    publisher.api.replace = someone_writes_first  # type: ignore[method-assign]
    state.set_health({info.gpus[3].uuid: "XID 31"})
    assert publisher.wait_published(2)
    assert publisher.stats.conflicts == 1 and publisher.stats.errors["publish"] == 0
    devices = slices(api, name)[0]["spec"]["devices"]
    assert [d["name"] for d in devices if d.get("taints")] == [
        d["name"] for d in devices if d["name"].startswith("gpu-3-")
    ]

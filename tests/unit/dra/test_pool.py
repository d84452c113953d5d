"""The pool as slices and the writes from what is stored to it: generation, resourceSliceCount, obsolete slices."""

from __future__ import annotations

from typing import Any

import pytest

from deviceplugin.dra.pool import Pool, Stored, canonical, chunks, owner_reference, slice_name

OWNER = owner_reference("node-a", "uid-1")


def _devices(n: int) -> list[dict[str, Any]]:
    return [{"name": f"gpu-{i}", "capacity": {"memory": {"value": str(1024**3)}}} for i in range(n)]


def _stored(obj: dict[str, Any], rv: str = "1", owners: tuple = (OWNER,)) -> Stored:
    return Stored.from_api(
        {
            "metadata": {
                "name": obj["metadata"]["name"],
                "uid": "u-" + obj["metadata"]["name"],
                "resourceVersion": rv,
                "ownerReferences": list(owners),
            },
            "spec": obj["spec"],
        }
    )


def _published(pool: Pool) -> list[Stored]:
    return [_stored(o) for o in pool.writes([]).creates]


def test_devices_are_cut_into_slices_of_64_and_no_device_is_one_empty_slice() -> None:
    assert [len(c) for c in chunks(_devices(130))] == [64, 64, 2]
    assert chunks([]) == [[]]
    writes = Pool("node-a", "gpu-share.example.com", OWNER, []).writes([])
    assert len(writes.creates) == 1 and writes.creates[0]["spec"]["devices"] == []
    assert writes.creates[0]["spec"]["pool"] == {"name": "node-a", "generation": 1, "resourceSliceCount": 1}


def test_a_first_publish_creates_every_slice_at_generation_1_owned_by_the_node() -> None:
    writes = Pool("node-a", "gpu-share.example.com", OWNER, _devices(100)).writes([])
    assert writes.generation == 1 and not writes.deletes and not writes.updates
    assert [o["metadata"]["name"] for o in writes.creates] == [
        "node-a-gpu-share.example.com-0000",
        "node-a-gpu-share.example.com-0001",
    ]
    for obj in writes.creates:
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "uid-1", "controller": True}
        ]
        assert obj["spec"]["nodeName"] == "node-a" and obj["spec"]["driver"] == "gpu-share.example.com"
        assert obj["spec"]["pool"]["resourceSliceCount"] == 2


def test_nothing_changed_is_no_write_even_when_the_server_rewrote_quantities_and_stamped_taints() -> None:
    devices = _devices(3)
    devices[0]["taints"] = [{"key": "gpu-share.example.com/unhealthy", "value": "xid", "effect": "NoSchedule"}]
    pool = Pool("node-a", "gpu-share.example.com", OWNER, devices)
    stored = pool.writes([]).creates[0]
    stored["spec"]["devices"][1]["capacity"]["memory"]["value"] = "1Gi"
    stored["spec"]["devices"][0]["taints"][0]["timeAdded"] = "2026-12-01T20:00:00Z"
    assert pool.writes([_stored(stored)]).count == 0


def test_one_changed_slice_keeps_the_generation_and_keeps_old_taint_times() -> None:
    before = Pool("node-a", "d.example.com", OWNER, _devices(100))
    stored = _published(before)
    devices = _devices(100)
    devices[70]["taints"] = [{"key": "d.example.com/unhealthy", "value": "xid", "effect": "NoSchedule"}]
    writes = Pool("node-a", "d.example.com", OWNER, devices).writes(stored)
    assert writes.generation == 1 and len(writes.updates) == 1 and not writes.creates
    meta = writes.updates[0]["metadata"]
    assert meta["name"].endswith("-0001") and meta["resourceVersion"] == "1"


def test_a_change_of_two_slices_or_a_missing_slice_moves_every_slice_to_the_next_generation() -> None:
    stored = _published(Pool("node-a", "d.example.com", OWNER, _devices(100)))
    devices = _devices(100)
    for i in (1, 70):
        devices[i]["taints"] = [{"key": "d.example.com/unhealthy", "value": "xid", "effect": "NoSchedule"}]
    two = Pool("node-a", "d.example.com", OWNER, devices).writes(stored)
    assert (
        two.generation == 2 and len(two.updates) == 2 and {o["spec"]["pool"]["generation"] for o in two.updates} == {2}
    )
    wiped = Pool("node-a", "d.example.com", OWNER, _devices(100)).writes(stored[:1])  # one of two deleted
    assert wiped.generation == 2 and len(wiped.updates) == 1 and len(wiped.creates) == 1


def test_fewer_devices_delete_the_obsolete_slice_first_and_recount_the_pool() -> None:
    stored = _published(Pool("node-a", "d.example.com", OWNER, _devices(100)))
    writes = Pool("node-a", "d.example.com", OWNER, _devices(10)).writes(stored)
    assert [s.name for s in writes.deletes] == [stored[1].name]
    assert writes.updates[0]["spec"]["pool"] == {"name": "node-a", "generation": 1, "resourceSliceCount": 1}


def test_a_foreign_slice_name_or_pool_is_deleted_and_a_lost_owner_reference_is_rewritten() -> None:
    pool = Pool("node-a", "d.example.com", OWNER, _devices(2))
    ours = pool.writes([]).creates[0]
    foreign = {"metadata": {"name": "00000-d.example.com-node-a-x1y2z"}, "spec": ours["spec"]}
    other_pool = {
        "metadata": ours["metadata"],
        "spec": {**ours["spec"], "pool": {"name": "elsewhere", "generation": 1, "resourceSliceCount": 1}},
    }
    assert [s.name for s in pool.writes([_stored(foreign), _stored(ours)]).deletes] == [foreign["metadata"]["name"]]
    writes = pool.writes([_stored(other_pool)])
    assert len(writes.deletes) == 1 and len(writes.creates) == 1
    assert len(pool.writes([_stored(ours, owners=())]).updates) == 1


def test_what_the_server_kept_instead_counts_as_written() -> None:
    pool = Pool("node-a", "d.example.com", OWNER, _devices(1))
    ours = pool.writes([]).creates[0]
    kept = {**ours["spec"], "devices": [{"name": "gpu-0"}]}  # a gate off dropped the capacity
    stored = _stored({"metadata": ours["metadata"], "spec": kept})
    assert pool.writes([stored]).count == 1
    assert pool.writes([stored], {ours["metadata"]["name"]: canonical(kept)}).count == 0


@pytest.mark.parametrize("node", ["n", "a" * 253, "a." * 120 + "b"])
def test_slice_names_are_dns_subdomains_unique_and_ordered_by_index(node: str) -> None:
    names = [slice_name(node, "gpu-share.example.com", i) for i in range(12)]
    assert names == sorted(names) and len(set(names)) == 12
    for name in names:
        assert len(name) <= 253 and all(part and part[0].isalnum() and part[-1].isalnum() for part in name.split("."))


def test_the_pool_and_the_taints_load_no_transport() -> None:
    """Like the core (tests/unit/test_transport_free.py): the slice layout and the taints are plain data."""
    import json
    import subprocess
    import sys

    probe = (
        "import json, sys; import deviceplugin.dra.pool, deviceplugin.dra.taints; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'prometheus_client', 'kubernetes') or m.startswith('google.protobuf'))))"
    )
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
    )
    assert loaded == []


def test_stop_is_quiet_when_the_watch_socket_has_just_closed() -> None:
    """The stream can end (and urllib3 close its socket) between the watch thread's last read and stop(): shutting
    that socket down raises EBADF, which stop() must not pass on."""
    import errno

    from deviceplugin.dra.slices import SlicePublisher
    from deviceplugin.state import NodeState
    from tests.conftest import node

    class Closed:
        shut = 0

        def shutdown(self) -> None:
            self.shut += 1
            raise OSError(errno.EBADF, "Bad file descriptor")

    publisher = SlicePublisher(None, "n", "gpu-share.example.com", node("2xT4"), NodeState())
    publisher.watch._response = closed = Closed()
    publisher.stop()
    assert closed.shut == 1 and not publisher.running and not publisher.watch.running

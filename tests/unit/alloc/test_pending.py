"""alloc.pending: which GPUs keep their shape, table-driven over the 2xT4 node."""

from __future__ import annotations

import pytest

from deviceplugin.alloc.pending import changing_gpus, reconcile
from deviceplugin.model.usage import Hold
from tests.conftest import node
from tests.support.resources import resources_of

T4 = node("2xT4")
GPU0, GPU1 = (g.uuid for g in T4.gpus)
MIXED = [
    {"name": "whole", "mode": "exclusive", "gpus": {"indexes": [0]}},
    {"name": "shared", "mode": "shared", "replicas": 4, "gpus": {"indexes": [1]}},
]


def plan(pools: list[dict]):
    return resources_of({"version": "v1", "pools": pools}, T4)


def devices(resources) -> dict[str, set[str]]:
    return {r.name: set(r.devices) for r in resources}


@pytest.mark.parametrize(
    "old, new, holds, pending",
    [
        (MIXED, [{"name": "shared", "mode": "shared", "replicas": 4}], [Hold("example.com/gpu", GPU0)], {GPU0}),
        (
            MIXED,
            [{"name": "shared", "mode": "shared", "replicas": 4}],
            [Hold("example.com/gpu-share", f"{GPU1}::0")],
            set(),
        ),  # GPU 1 keeps its shape
        (MIXED, [{"name": "whole", "mode": "exclusive"}], [Hold("example.com/gpu-share", f"{GPU1}::3")], {GPU1}),
        (MIXED, [{"name": "whole", "mode": "exclusive"}], [], set()),
        (
            [{"name": "s", "mode": "shared", "replicas": 4}],
            [{"name": "s", "mode": "shared", "replicas": 2}],
            [Hold("example.com/gpu-share", f"{GPU0}::3")],
            {GPU0},
        ),
        (
            [{"name": "s", "mode": "shared", "replicas": 4}],
            [{"name": "s", "mode": "shared", "replicas": 4, "backend": "mps"}],
            [Hold("example.com/gpu-share", f"{GPU0}::0")],
            {GPU0},
        ),
        (
            [{"name": "s", "mode": "shared", "replicas": 4}],
            [{"name": "t", "mode": "shared", "replicas": 4, "gpus": {"indexes": [0, 1]}}],
            [Hold("example.com/gpu-share", f"{GPU0}::0")],
            {GPU0},
        ),  # pool renamed
        (
            [{"name": "s", "mode": "shared", "replicas": 4}],
            [{"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [0, 1]}}],
            [Hold("example.com/gpu-share", f"{GPU0}::0")],
            set(),
        ),  # selector only
        (
            MIXED,
            [{"name": "shared", "mode": "shared", "replicas": 4, "gpus": {"indexes": [1]}}],
            [Hold("example.com/gpu", GPU0)],
            set(),
        ),  # GPU 0 leaves every pool
    ],
)
def test_a_held_gpu_whose_shape_changes_is_pending_and_keeps_its_devices(old, new, holds, pending):
    served, wanted = plan(old), plan(new)
    result = reconcile(served, wanted, holds)
    assert set(result.pending) == pending
    for uuid in pending:
        kept = {(r.name, i) for r in result.resources for i, d in r.devices.items() if d.gpu.uuid == uuid}
        assert kept == {(r.name, i) for r in served for i, d in r.devices.items() if d.gpu.uuid == uuid}  # as it was
    for uuid in {GPU0, GPU1} - pending:
        got = {(r.name, i) for r in result.resources for i, d in r.devices.items() if d.gpu.uuid == uuid}
        assert got == {(r.name, i) for r in wanted for i, d in r.devices.items() if d.gpu.uuid == uuid}  # as asked


@pytest.mark.parametrize(
    "new, replicas, left_out",
    [
        ([{"name": "s", "mode": "shared", "replicas": 4}], 4, False),  # the same shape: served at once
        ([{"name": "s", "mode": "shared", "replicas": 8}], 4, True),  # granted in shares of 4: not in shares of 8
        ([{"name": "s", "mode": "shared", "replicas": 4}], None, True),  # the share count is unknown: wait
    ],
)
def test_at_start_up_a_held_gpu_is_served_only_in_the_shape_it_was_granted_in(new, replicas, left_out):
    result = reconcile([], plan(new), [Hold("example.com/gpu-share", f"{GPU0}::1", replicas)])
    assert (GPU0 in result.pending) == left_out
    assert any(d.gpu.uuid == GPU0 for r in result.resources for d in r.devices.values()) != left_out


def test_a_pending_gpu_keeps_its_original_pool_settings_while_merged_into_a_changed_resource():
    served = plan([{"name": "s", "mode": "shared", "replicas": 4}])
    wanted = plan([{"name": "s", "mode": "shared", "replicas": 4, "backend": "mps"}])
    hold = [Hold("example.com/gpu-share", f"{GPU0}::0")]
    first = reconcile(served, wanted, hold)
    assert set(first.pending) == {GPU0} and changing_gpus(first.resources, wanted, first.pending) == {GPU0}
    second = reconcile(first.resources, wanted, hold, first.pending)  # still held: still pending
    assert set(second.pending) == {GPU0}
    assert reconcile(second.resources, wanted, [], second.pending).pending == {}

"""The mode table: one object per sharing mode, looked up from a pool, holding what differs between the modes."""

from __future__ import annotations

import pytest

from deviceplugin.alloc.modes import EXCLUSIVE, MIG, MPS, SHARING_MODES, TIME_SLICED, mode_of
from deviceplugin.config.parse import parse_config
from deviceplugin.model.devices import Unit

from ...conftest import node
from ...support.resources import one_pool

T4 = node("2xT4")
A100_MIG = node("8xA100-80GB-mig")  # GPUs 0-4 MIG-enabled, 5-7 not
MPS_POOL = {"name": "m", "mode": "shared", "backend": "mps", "replicas": 4}


def pool(**keys):
    return parse_config({"version": "v1", "pools": [{"name": "p", **keys}]}).pools()[0]


@pytest.mark.parametrize(
    "keys, mode, name, strategy, placement",
    [
        ({"mode": "exclusive"}, EXCLUSIVE, "exclusive", "none", "topology"),
        ({"mode": "shared"}, TIME_SLICED, "time-slicing", "time-slicing", "policy"),
        ({"mode": "shared", "backend": "mps"}, MPS, "mps", "mps", "policy"),
        ({"mode": "mig"}, MIG, "mig", "none", "in order"),
    ],
)
def test_a_pool_finds_its_mode(keys, mode, name, strategy, placement):
    found = mode_of(pool(**keys))
    assert found is mode
    assert (found.name, found.strategy, found.placement) == (name, strategy, placement)


def test_every_mode_once_by_its_name():
    assert [m.name for m in SHARING_MODES] == ["exclusive", "time-slicing", "mps", "mig"]


@pytest.mark.parametrize(
    "keys, node_name, resources",
    [
        ({"mode": "exclusive"}, "8xA100-80GB-mig", {"example.com/gpu": 3}),  # MIG-enabled GPUs are not whole GPUs
        (
            {"mode": "shared", "replicas": 2},
            "8xA100-80GB-mig",
            {"example.com/gpu-share": 17 + 3},
        ),  # instance by instance
        ({"mode": "shared", "backend": "mps", "replicas": 2}, "2xT4", {"example.com/gpu-share": 2}),
        ({"mode": "mig", "strategy": "single"}, "2xH100-mig-1g", {"example.com/gpu": 14}),
        (
            {"mode": "mig"},
            "8xA100-80GB-mig",
            {
                "example.com/mig-1g.10gb": 10,
                "example.com/mig-2g.20gb": 2,
                "example.com/mig-3g.40gb": 3,
                "example.com/mig-4g.40gb": 1,
                "example.com/mig-7g.80gb": 1,
            },
        ),
    ],
)
def test_resources_are_units_per_mode(keys, node_name, resources):
    p = pool(**keys)
    assert {name: len(units) for name, _, units in mode_of(p).resources(p, list(node(node_name).gpus))} == resources


def test_mps_refuses_mig_enabled_gpus_naming_the_backend():
    p = pool(**{"mode": "shared", "backend": "mps"})
    with pytest.raises(
        ValueError, match=r"pools\[0\]\.backend: mps is not supported on MIG-enabled GPUs \(GPU 0, 1, 2, 3, 4\)"
    ):
        MPS.resources(p, list(A100_MIG.gpus))


def test_the_mps_share_limit_is_explained():
    p = pool(**{"mode": "shared", "backend": "mps", "memoryPerShare": "100Mi"})
    with pytest.raises(ValueError, match=r"limit of 48 shares per GPU or MIG instance \(an MPS server takes"):
        MPS.resources(p, list(T4.gpus))
    with pytest.raises(ValueError, match=r"limit of \d+ shares per GPU or MIG instance; use"):
        TIME_SLICED.resources(pool(**{"mode": "shared", "memoryPerShare": "1Mi"}), list(T4.gpus))


def test_devices_are_whole_units_or_shares():
    gpu = T4.gpus[0]
    unit = Unit(uuid=gpu.uuid, gpu=gpu, memory_mib=gpu.memory_mib, replicas=3)
    assert list(EXCLUSIVE.devices([unit])) == list(MIG.devices([unit])) == [gpu.uuid]
    shares = TIME_SLICED.devices([unit])
    assert list(shares) == [f"{gpu.uuid}::{k}" for k in range(3)] and [d.share for d in shares.values()] == [0, 1, 2]


def test_id_lengths_count_every_id_once_by_its_length():
    gpu = T4.gpus[0]
    unit = Unit(uuid=gpu.uuid, gpu=gpu, memory_mib=gpu.memory_mib, replicas=120)
    assert TIME_SLICED.id_lengths(unit) == [(f"{gpu.uuid}::9", 10), (f"{gpu.uuid}::99", 90), (f"{gpu.uuid}::119", 20)]
    assert EXCLUSIVE.id_lengths(unit) == [(gpu.uuid, 1)]


def test_grant_facts_per_mode():
    exclusive = one_pool(T4, {"name": "e", "mode": "exclusive"})
    assert EXCLUSIVE.grant_facts(exclusive, [(exclusive.units[0], 1)], None) == ({}, ())
    sliced = one_pool(T4, {"name": "s", "mode": "shared", "replicas": 4})
    envs, mounts = TIME_SLICED.grant_facts(sliced, [(sliced.units[0], 2)], True)  # no MPS: no client limits to give
    assert (
        envs
        == {
            "GPU_SHARE_COUNT": "2",
            "GPU_SHARE_TOTAL": "4",
            "GPU_SHARE_MEMORY_LIMIT_MIB": str(15360 // 2),
            "GPU_SHARE_COMPUTE_PERCENT": "50",
        }
        and mounts == ()
    )


@pytest.mark.parametrize(
    "mps_limits, client_limits, limited",
    [("strict", None, False), ("proportional", None, True), ("strict", True, True)],
)
def test_mps_grant_facts_add_the_pipe_and_limits(mps_limits, client_limits, limited):
    resource = one_pool(T4, {**MPS_POOL, "mpsLimits": mps_limits})
    envs, mounts = MPS.grant_facts(resource, [(resource.units[0], 1)], client_limits)
    assert envs["GPU_SHARE_COUNT"] == "1" and envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpu-share/mps/m/pipe"
    assert [m.container_path for m in mounts] == ["/run/gpu-share/mps/m/pipe", "/dev/shm"]
    assert ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in envs) is limited
    if limited:
        assert (envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == (
            "25",
            f"0={15360 // 4}M",
        )


def test_each_mode_says_how_its_limits_hold():
    said = {
        m.name: m.enforcement(pool(**keys), unit, "report")
        for m, keys, unit in [
            (EXCLUSIVE, {"mode": "exclusive"}, one_pool(T4, {"name": "e", "mode": "exclusive"}).units[0]),
            (TIME_SLICED, {"mode": "shared"}, one_pool(T4, {"name": "s", "mode": "shared", "replicas": 4}).units[0]),
            (MPS, {"mode": "shared", "backend": "mps"}, one_pool(T4, MPS_POOL).units[0]),
            (MIG, {"mode": "mig"}, one_pool(A100_MIG, {"name": "m", "mode": "mig"}).units[0]),
        ]
    }
    assert said["exclusive"] == "the whole GPU, no neighbours" and said["mig"] == "isolated by the hardware (MIG)"
    assert said["time-slicing"].startswith("not enforced") and "watchdog reports" in said["time-slicing"]
    assert "active threads 25 %" in said["mps"] and "one share per container" in said["mps"]

"""What a container receives (Allocate) as plain data, and the device nodes it is given (the checks: test_allocator)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.alloc.allocator import AllocationError, ContainerGrant, Refusal, ResourceAllocator
from deviceplugin.alloc.devicenodes import DeviceNode, MissingCapability, mig_capability_devices
from deviceplugin.alloc.modes import Mount
from deviceplugin.alloc.placement import preferred_allocation
from deviceplugin.model.devices import Resource
from tests.conftest import node
from tests.support.resources import one_pool, shared

H100 = node("8xH100-80GB")
T4 = node("2xT4")
U = [g.uuid for g in H100.gpus]
T = [g.uuid for g in T4.gpus]


def container_grant(resource: Resource, ids: list[str]) -> ContainerGrant:
    return ResourceAllocator(resource).grant(ids)


def test_shared_response_facts():
    envs = container_grant(shared(H100, replicas=3), [f"{U[4]}::0", f"{U[4]}::2"]).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == envs["CUDA_VISIBLE_DEVICES"] == U[4]
    assert (envs["GPU_SHARE_COUNT"], envs["GPU_SHARE_TOTAL"]) == ("2", "3")
    assert envs["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(81559 * 2 // 3)
    assert envs["GPU_SHARE_COMPUTE_PERCENT"] == "66"


def test_exclusive_response_lists_every_gpu_in_index_order():
    resource = one_pool(H100, {"name": "e", "mode": "exclusive"})
    envs = container_grant(resource, [U[3], U[1]]).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == f"{U[1]},{U[3]}"


def test_shares_of_mig_instances_stay_on_one_instance():
    a100 = node("8xA100-80GB-mig")
    resource = one_pool(a100, {"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [2]}})
    first, second = (m.uuid for m in a100.gpus[2].mig_devices)
    available = [f"{first}::3"] + [f"{second}::{k}" for k in range(4)]
    ids = preferred_allocation(resource, available, [], 2)
    assert {i.split("::")[0] for i in ids} == {second}
    envs = container_grant(resource, ids).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == envs["CUDA_VISIBLE_DEVICES"] == second
    assert envs["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(40192 * 2 // 4)
    with pytest.raises(AllocationError, match="span 2 MIG instances .* must be on one MIG instance"):
        container_grant(resource, [f"{first}::0", f"{second}::0"])


MPS = "/run/gpu-share/mps/m"


@pytest.mark.parametrize(
    "top, pool, ids, expected",
    [
        # exclusive, envvar: the visible devices only
        (
            {},
            {"name": "e", "mode": "exclusive"},
            [T[1]],
            ContainerGrant(envs={"CUDA_VISIBLE_DEVICES": T[1], "NVIDIA_VISIBLE_DEVICES": T[1]}),
        ),
        # CDI names instead of NVIDIA_VISIBLE_DEVICES
        (
            {"deviceListStrategy": "cdi", "cdiKind": "example.com/gpu"},
            {"name": "e", "mode": "exclusive"},
            [T[1], T[0]],
            ContainerGrant(envs={}, cdi_devices=(f"example.com/gpu={T[0]}", f"example.com/gpu={T[1]}")),
        ),
        # device nodes under deviceRoot: the control nodes, then each GPU's
        (
            {"deviceSpecs": True, "deviceRoot": "/host"},
            {"name": "e", "mode": "exclusive"},
            [T[1]],
            ContainerGrant(
                envs={"CUDA_VISIBLE_DEVICES": T[1], "NVIDIA_VISIBLE_DEVICES": T[1]},
                device_specs=tuple(
                    DeviceNode(p, "/host" + p)
                    for p in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia1")
                ),
            ),
        ),
        # MPS, proportional: the pipe and shm mounts, and per-client limits of the shares' part
        (
            {},
            {"name": "m", "mode": "shared", "backend": "mps", "mpsLimits": "proportional", "replicas": 4},
            [f"{T[0]}::0", f"{T[0]}::3"],
            ContainerGrant(
                envs={
                    "CUDA_VISIBLE_DEVICES": T[0],
                    "NVIDIA_VISIBLE_DEVICES": T[0],
                    "GPU_SHARE_COUNT": "2",
                    "GPU_SHARE_TOTAL": "4",
                    "GPU_SHARE_MEMORY_LIMIT_MIB": "7680",
                    "GPU_SHARE_COMPUTE_PERCENT": "50",
                    "CUDA_MPS_PIPE_DIRECTORY": f"{MPS}/pipe",
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=7680M",
                },
                mounts=(Mount(f"{MPS}/pipe", f"{MPS}/pipe"), Mount("/dev/shm", f"{MPS}/shm")),
            ),
        ),
        # spanning where allowed: the facts add up over the GPUs (compute over 100 %)
        (
            {},
            {"name": "s", "mode": "shared", "replicas": 2, "allowSpanGPUs": True},
            [f"{T[0]}::0", f"{T[0]}::1", f"{T[1]}::1"],
            ContainerGrant(
                envs={
                    "CUDA_VISIBLE_DEVICES": f"{T[0]},{T[1]}",
                    "NVIDIA_VISIBLE_DEVICES": f"{T[0]},{T[1]}",
                    "GPU_SHARE_COUNT": "3",
                    "GPU_SHARE_TOTAL": "2",
                    "GPU_SHARE_MEMORY_LIMIT_MIB": str(15360 + 15360 // 2),
                    "GPU_SHARE_COMPUTE_PERCENT": "150",
                }
            ),
        ),
    ],
)
def test_grants(top, pool, ids, expected):
    grant = container_grant(one_pool(T4, pool, **top), ids)
    assert grant == expected
    assert (
        container_grant(one_pool(T4, pool, **top), list(reversed(ids)) * 2) == grant
    )  # order and repeats do not matter


def test_mig_capability_read_failures_are_refused_and_retried(tmp_path):
    root = str(tmp_path)
    with pytest.raises(MissingCapability, match="cannot read MIG capability"):  # not readable (yet): nothing cached
        mig_capability_devices(root, 3, 1, 0)
    caps = tmp_path / "proc/driver/nvidia/capabilities/gpu3/mig/gi1"
    (caps / "ci0").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 31\n")
    (caps / "ci0" / "access").write_text("no minor here\n")
    with pytest.raises(MissingCapability, match="names no DeviceFileMinor"):
        mig_capability_devices(root, 3, 1, 0)
    (caps / "ci0" / "access").write_text("DeviceFileMinor: 32\n")
    expected = ("/dev/nvidia-caps/nvidia-cap31", "/dev/nvidia-caps/nvidia-cap32")
    assert mig_capability_devices(root, 3, 1, 0) == expected
    (caps / "access").unlink()
    assert mig_capability_devices(root, 3, 1, 0) == expected  # a complete read is kept


def test_a_mig_grant_whose_capability_nodes_cannot_be_read_is_refused(tmp_path):
    a100 = node("8xA100-80GB-mig")
    mig = one_pool(
        a100, {"name": "m", "mode": "mig", "gpus": {"indexes": [2]}}, deviceSpecs=True, deviceRoot=str(tmp_path)
    )
    with pytest.raises(AllocationError, match="cannot read MIG capability") as refused:
        container_grant(mig, [next(iter(mig.devices))])
    assert refused.value.code is Refusal.PRECONDITION


def _dra_grant(tmp_path: Path, pool: dict[str, Any], holdings: list[tuple[int, int]]) -> dict[str, str]:
    """The DRA driver's answer for one claim request holding `k` shares of GPU i: NodePrepareResources' code
    (`Driver.prepare`), the container's environment read back from the CDI spec it writes."""
    from deviceplugin.dra.devices import ClaimError
    from tests.support.dra import claim, make_driver, result

    driver = make_driver(tmp_path, [pool])
    try:
        prepared = driver.prepare(*claim([result(f"gpu-{i}", shares=k) for i, k in holdings]))
    except ClaimError as err:
        raise AllocationError(Refusal.INVALID, str(err)) from None
    spec = json.loads(Path(prepared.cdi_spec).read_text())
    return dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])


def _plugin_grant(pool: dict[str, Any], holdings: list[tuple[int, int]]) -> dict[str, str]:
    """The device plugin's grant for the same holding (k share IDs of GPU i): Allocate's code, as plain data."""
    resource = one_pool(T4, pool)
    return dict(
        ResourceAllocator(resource).allocate([[f"{T[i]}::{s}" for i, k in holdings for s in range(k)]]).grants[0].envs
    )


@pytest.mark.parametrize(
    "pool, holdings, expected",
    [
        # the repro: strict MPS, two GPUs, three shares each: refused (not 150 % and 0=23040M on a T4)
        ({"mpsLimits": "strict"}, [(0, 3), (1, 3)], "span 2 GPUs"),
        ({"mpsLimits": "strict"}, [(0, 3)], "one share per container, got 3"),
        ({"mpsLimits": "proportional"}, [(0, 1), (1, 1)], "span 2 GPUs"),
        # MPS never spans (one MPS server per GPU); shared shares span only with allowSpanGPUs
        (
            {"backend": "timeSlicing", "allowSpanGPUs": True},
            [(0, 3), (1, 1)],
            {"GPU_SHARE_COUNT": "4", "GPU_SHARE_COMPUTE_PERCENT": "100"},
        ),
        ({"backend": "timeSlicing"}, [(0, 1), (1, 1)], "span 2 GPUs"),
        (
            {"mpsLimits": "proportional"},
            [(0, 2)],
            {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=7680M"},
        ),
    ],
)
def test_both_node_apis_grant_or_refuse_the_same_holding(tmp_path, pool, holdings, expected):
    pool = {"name": "m", "mode": "shared", "backend": "mps", "replicas": 4, **pool}
    answers: list[dict[str, str] | str] = []
    for answer in (lambda: _plugin_grant(pool, holdings), lambda: _dra_grant(tmp_path, pool, holdings)):
        try:
            answers.append(answer())
        except AllocationError as err:
            answers.append(err.message)
    if isinstance(expected, str):
        assert all(isinstance(a, str) and expected in a for a in answers), answers
    else:
        for envs in answers:
            assert isinstance(envs, dict) and {k: envs[k] for k in expected} == expected, answers

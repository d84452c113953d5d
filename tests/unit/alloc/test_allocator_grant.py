"""What a container receives (Allocate) as plain data, and the device nodes it is given (the checks: test_allocator)."""

from __future__ import annotations

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
        ({}, {"name": "e", "mode": "exclusive"}, [T[1]], ContainerGrant(envs={"CUDA_VISIBLE_DEVICES": T[1], "NVIDIA_VISIBLE_DEVICES": T[1]})),
        # CDI names instead of NVIDIA_VISIBLE_DEVICES
        (
            {"deviceListStrategy": "cdi", "cdiKind": "example.com/gpu"}, {"name": "e", "mode": "exclusive"}, [T[1], T[0]],
            ContainerGrant(envs={}, cdi_devices=(f"example.com/gpu={T[0]}", f"example.com/gpu={T[1]}")),
        ),
        # device nodes under deviceRoot: the control nodes, then each GPU's
        (
            {"deviceSpecs": True, "deviceRoot": "/host"}, {"name": "e", "mode": "exclusive"}, [T[1]],
            ContainerGrant(
                envs={"CUDA_VISIBLE_DEVICES": T[1], "NVIDIA_VISIBLE_DEVICES": T[1]},
                device_specs=tuple(DeviceNode(p, "/host" + p) for p in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia1")),
            ),
        ),
        # MPS, proportional: the pipe and shm mounts, and per-client limits of the shares' part
        (
            {}, {"name": "m", "mode": "shared", "backend": "mps", "mpsLimits": "proportional", "replicas": 4}, [f"{T[0]}::0", f"{T[0]}::3"],
            ContainerGrant(
                envs={
                    "CUDA_VISIBLE_DEVICES": T[0], "NVIDIA_VISIBLE_DEVICES": T[0], "GPU_SHARE_COUNT": "2", "GPU_SHARE_TOTAL": "4",
                    "GPU_SHARE_MEMORY_LIMIT_MIB": "7680", "GPU_SHARE_COMPUTE_PERCENT": "50", "CUDA_MPS_PIPE_DIRECTORY": f"{MPS}/pipe",
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=7680M",
                },
                mounts=(Mount(f"{MPS}/pipe", f"{MPS}/pipe"), Mount("/dev/shm", f"{MPS}/shm")),
            ),
        ),
        # spanning where allowed: the facts add up over the GPUs (compute over 100 %)
        (
            {}, {"name": "s", "mode": "shared", "replicas": 2, "allowSpanGPUs": True}, [f"{T[0]}::0", f"{T[0]}::1", f"{T[1]}::1"],
            ContainerGrant(envs={
                "CUDA_VISIBLE_DEVICES": f"{T[0]},{T[1]}", "NVIDIA_VISIBLE_DEVICES": f"{T[0]},{T[1]}", "GPU_SHARE_COUNT": "3",
                "GPU_SHARE_TOTAL": "2", "GPU_SHARE_MEMORY_LIMIT_MIB": str(15360 + 15360 // 2), "GPU_SHARE_COMPUTE_PERCENT": "150",
            }),
        ),
    ],
)
def test_grants(top, pool, ids, expected):
    grant = container_grant(one_pool(T4, pool, **top), ids)
    assert grant == expected
    assert container_grant(one_pool(T4, pool, **top), list(reversed(ids)) * 2) == grant  # order and repeats do not matter


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
    mig = one_pool(a100, {"name": "m", "mode": "mig", "gpus": {"indexes": [2]}}, deviceSpecs=True, deviceRoot=str(tmp_path))
    with pytest.raises(AllocationError, match="cannot read MIG capability") as refused:
        container_grant(mig, [next(iter(mig.devices))])
    assert refused.value.code is Refusal.PRECONDITION

"""Placement (GetPreferredAllocation) and responses (Allocate) as pure functions."""

from __future__ import annotations

import grpc
import pytest

from deviceplugin.alloc.allocator import AllocationError, container_response, preferred_allocation
from deviceplugin.config.parse import parse_config
from deviceplugin.alloc.plan import build_resources

from .conftest import node

H100 = node("8xH100-80GB")
U = [g.uuid for g in H100.gpus]


def shared(policy: str = "binpack", replicas: int = 4):
    config = parse_config({"version": "v1", "allocationPolicy": policy, "pools": [{"name": "s", "mode": "shared", "replicas": replicas}]})
    return build_resources(config, H100)[0]


def free(counts: dict[int, int], replicas: int = 4) -> list[str]:
    """Available IDs with `counts[i]` free shares on GPU i (the highest share numbers)."""
    return [f"{U[i]}::{k}" for i, n in counts.items() for k in range(replicas - n, replicas)]


def gpus_of(ids: list[str]) -> set[int]:
    return {U.index(i.split("::")[0]) for i in ids}


def test_binpack_takes_the_fullest_gpu_that_fits():
    available = free({0: 4, 1: 1, 2: 2, 3: 3})
    assert gpus_of(preferred_allocation(shared(), available, [], 2)) == {2}
    assert gpus_of(preferred_allocation(shared(), available, [], 1)) == {1}
    assert gpus_of(preferred_allocation(shared(), available, [], 4)) == {0}


def test_spread_takes_the_emptiest_gpu():
    available = free({0: 2, 1: 4, 2: 3})
    assert gpus_of(preferred_allocation(shared("spread"), available, [], 1)) == {1}


def test_ties_go_to_the_lowest_index_and_shares_in_order():
    ids = preferred_allocation(shared(), free({3: 4, 1: 4}), [], 2)
    assert ids == [f"{U[1]}::0", f"{U[1]}::1"]


def test_must_include_is_kept_and_completed_on_its_gpu():
    available = free({0: 4, 1: 3})
    ids = preferred_allocation(shared(), available, [f"{U[0]}::2"], 3)
    assert ids[0] == f"{U[0]}::2" and len(ids) == 3 and gpus_of(ids) == {0}


def test_size_is_honoured_and_unknown_ids_ignored():
    ids = preferred_allocation(shared(), free({0: 4}) + ["GPU-unknown::0"], [], 3)
    assert len(ids) == 3 and "GPU-unknown::0" not in ids


def test_no_single_gpu_fits_returns_largest_pieces():
    ids = preferred_allocation(shared(), free({0: 2, 1: 3, 2: 1}), [], 5)
    assert len(ids) == 5 and gpus_of(ids) == {0, 1}


def test_exclusive_completes_must_include_on_its_numa_node():
    config = parse_config({"version": "v1", "pools": [{"name": "e", "mode": "exclusive"}]})
    resource = build_resources(config, H100)[0]
    # Equal NVLinks everywhere (NVSwitch): GPU 5 shares GPU 7's NUMA node, GPU 2 does not.
    assert preferred_allocation(resource, [U[5], U[2], U[7]], [U[7]], 2) == [U[7], U[5]]


def test_nvlink_decides_even_when_one_gpu_is_left_to_choose():
    from deviceplugin.model.node import Gpu, Link, NodeInfo

    gpus = tuple(Gpu(index=i, uuid=f"GPU-{i}", model="A100", memory_mib=40960, numa_node=0) for i in range(4))
    links = {(a.uuid, b.uuid): Link(nvlinks=4 if (a.index, b.index) == (1, 3) else 0, pcie="system") for a in gpus for b in gpus if a.index < b.index}
    config = parse_config({"version": "v1", "pools": [{"name": "e", "mode": "exclusive"}]})
    resource = build_resources(config, NodeInfo(gpus=gpus, links=links))[0]
    ids = ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]
    assert preferred_allocation(resource, ids, ["GPU-1"], 2) == ["GPU-1", "GPU-3"]  # GPU 1's NV4 peer
    assert preferred_allocation(resource, ids, [], 2) == ["GPU-1", "GPU-3"]


def test_shared_response_facts():
    envs = container_response(shared(replicas=3), [f"{U[4]}::0", f"{U[4]}::2"]).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == envs["CUDA_VISIBLE_DEVICES"] == U[4]
    assert (envs["GPU_SHARE_COUNT"], envs["GPU_SHARE_TOTAL"]) == ("2", "3")
    assert envs["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(81559 * 2 // 3)
    assert envs["GPU_SHARE_COMPUTE_PERCENT"] == "66"


def test_exclusive_response_lists_every_gpu_in_index_order():
    config = parse_config({"version": "v1", "pools": [{"name": "e", "mode": "exclusive"}]})
    resource = build_resources(config, H100)[0]
    envs = container_response(resource, [U[3], U[1]]).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == f"{U[1]},{U[3]}"


def test_unknown_ids_are_listed_with_a_limit():
    ids = [f"GPU-x::{k}" for k in range(12)]
    with pytest.raises(AllocationError) as err:
        container_response(shared(), ids)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.message.endswith("and 4 more")


def test_shares_of_mig_instances_stay_on_one_instance():
    a100 = node("8xA100-80GB-mig")
    config = parse_config({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [2]}}]})
    resource = build_resources(config, a100)[0]
    first, second = (m.uuid for m in a100.gpus[2].mig_devices)
    available = [f"{first}::3"] + [f"{second}::{k}" for k in range(4)]
    ids = preferred_allocation(resource, available, [], 2)
    assert {i.split("::")[0] for i in ids} == {second}
    envs = container_response(resource, ids).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == envs["CUDA_VISIBLE_DEVICES"] == second
    assert envs["GPU_SHARE_MEMORY_LIMIT_MIB"] == str(40192 * 2 // 4)
    with pytest.raises(AllocationError, match="span 2 MIG instances .* must be on one MIG instance"):
        container_response(resource, [f"{first}::0", f"{second}::0"])


def test_mig_capability_read_failures_are_retried(tmp_path):
    from deviceplugin.alloc.allocator import mig_capability_devices

    root = str(tmp_path)
    assert mig_capability_devices(root, 3, 1, 0) == ()  # not readable (yet): nothing cached
    caps = tmp_path / "proc/driver/nvidia/capabilities/gpu3/mig/gi1"
    (caps / "ci0").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 31\n")
    (caps / "ci0" / "access").write_text("DeviceFileMinor: 32\n")
    expected = ("/dev/nvidia-caps/nvidia-cap31", "/dev/nvidia-caps/nvidia-cap32")
    assert mig_capability_devices(root, 3, 1, 0) == expected
    (caps / "access").unlink()
    assert mig_capability_devices(root, 3, 1, 0) == expected  # a complete read is kept

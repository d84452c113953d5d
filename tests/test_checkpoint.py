"""The kubelet's checkpoint, read only and never trusted: both formats, the share count our Allocate answer carried,
and anything malformed, oversized or truncated unknown (HoldsUnknown), never empty; parsed entry by entry."""

from __future__ import annotations

import base64
import json

import pytest

from deviceplugin.agent import holds
from deviceplugin.agent.holds import HoldsUnknown, read_checkpoint
from deviceplugin.api import deviceplugin_pb2 as pb
from deviceplugin.model.usage import Hold

OURS = {"GPU-a", "GPU-b", "MIG-c"}.__contains__


def answer(total: str | None) -> str:
    envs = {"GPU_SHARE_TOTAL": total} if total is not None else {}
    return base64.b64encode(pb.ContainerAllocateResponse(envs=envs).SerializeToString()).decode()


def write(path, entries) -> None:
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1}))


def test_both_formats_and_the_granted_share_count(tmp_path):
    path = tmp_path / "kubelet_internal_checkpoint"
    write(
        path,
        [
            {
                "PodUID": "u1",
                "ContainerName": "c",
                "ResourceName": "example.com/gpu-share",
                "DeviceIDs": {"0": ["GPU-a::0", "GPU-a::1"]},
                "AllocResp": answer("4"),
            },
            {
                "PodUID": "u2",
                "ContainerName": "c",
                "ResourceName": "example.com/gpu",
                "DeviceIDs": ["GPU-b"],
                "AllocResp": answer(None),
            },  # before 1.20
            {
                "PodUID": "u3",
                "ContainerName": "c",
                "ResourceName": "example.com/gpu-share",
                "DeviceIDs": {"-1": ["MIG-c::3"]},
                "AllocResp": "not base64!",
            },
            {
                "PodUID": "u4",
                "ContainerName": "c",
                "ResourceName": "nvidia.com/gpu",
                "DeviceIDs": {"0": ["GPU-elsewhere"]},
            },  # not on this node
        ],
    )
    found = read_checkpoint(path, OURS)
    assert {k: h.replicas for k, h in found.items()} == {
        ("example.com/gpu-share", "GPU-a::0"): 4,
        ("example.com/gpu-share", "GPU-a::1"): 4,
        ("example.com/gpu", "GPU-b"): 1,  # a whole device
        ("example.com/gpu-share", "MIG-c::3"): None,  # a share whose count the answer does not say: unknown
    }
    assert found[("example.com/gpu", "GPU-b")] == Hold("example.com/gpu", "GPU-b", 1)


def test_a_missing_file_holds_nothing_and_a_malformed_or_oversized_one_is_unknown(tmp_path, monkeypatch):
    """Fail closed: only a missing file (the kubelet has granted nothing) reads as empty."""
    path = tmp_path / "kubelet_internal_checkpoint"
    assert read_checkpoint(path, OURS) == {}
    for text, why in [
        ("{", "no PodDeviceEntries"),
        ('{"Data": 3}', "no PodDeviceEntries"),
        ('{"Data": {"PodDeviceEntries": 3}}', "is not a list"),
        ('{"Data": {"PodDeviceEntries": [1]}}', "without a ResourceName"),
        ('{"Data": {"PodDeviceEntries": [{"ResourceName": 5}]}}', "without a ResourceName"),
        ('{"Data": {"PodDeviceEntries": [{"ResourceName": "r", "DeviceIDs": {"0": [7]}}]}}', "DeviceIDs do not parse"),
        (
            '{"Data": {"PodDeviceEntries": [{"ResourceName": "r", "DeviceIDs": ["GPU-a"]}, {"ResourceName": "r", "Devi',
            "truncated",
        ),
        ('{"Data": {"PodDeviceEntries": [{"ResourceName": "r", "DeviceIDs": ["GPU-a"]} {}]}}', "after an entry"),
    ]:
        path.write_text(text)
        with pytest.raises(HoldsUnknown, match=why):
            read_checkpoint(path, OURS)
    write(path, [])
    assert read_checkpoint(path, OURS) == {}
    path.write_text('{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":0}')  # Go's JSON of none
    assert read_checkpoint(path, OURS) == {}
    monkeypatch.setattr(holds, "MAX_CHECKPOINT_BYTES", 10)
    with pytest.raises(HoldsUnknown, match="is over 10 bytes: not read"):
        read_checkpoint(path, OURS)


def test_a_share_count_that_does_not_parse_is_a_hold_of_unknown_shape(tmp_path):
    """GPU_SHARE_TOTAL="²" passes str.isdigit() and fails int(): the device is held, its shape unknown."""
    path = tmp_path / "kubelet_internal_checkpoint"
    write(
        path,
        [
            {
                "PodUID": "u1",
                "ContainerName": "c",
                "ResourceName": "example.com/gpu-share",
                "DeviceIDs": {"0": ["GPU-a::0"]},
                "AllocResp": answer(total),
            }
            for total in ("²",)
        ]
        + [
            {
                "PodUID": "u2",
                "ContainerName": "c",
                "ResourceName": "example.com/gpu-share",
                "DeviceIDs": {"0": ["GPU-b::1"]},
                "AllocResp": answer("0"),
            }
        ],
    )
    assert {k: h.replicas for k, h in read_checkpoint(path, OURS).items()} == {
        ("example.com/gpu-share", "GPU-a::0"): None,
        ("example.com/gpu-share", "GPU-b::1"): None,
    }


def test_entries_over_their_bounds_are_unknown_not_read_whole(tmp_path, monkeypatch):
    path = tmp_path / "kubelet_internal_checkpoint"
    monkeypatch.setattr(holds, "MAX_ENTRY_BYTES", 1000)
    write(path, [{"ResourceName": "r", "DeviceIDs": ["GPU-a"], "AllocResp": "x" * 2000}])
    with pytest.raises(HoldsUnknown, match="entry over 1000 bytes"):
        read_checkpoint(path, OURS)
    monkeypatch.setattr(holds, "MAX_ENTRIES", 3)
    write(path, [{"ResourceName": "r", "DeviceIDs": ["GPU-a"]}] * 4)
    with pytest.raises(HoldsUnknown, match="over 3 entries"):
        read_checkpoint(path, OURS)


def test_entries_split_across_read_chunks_parse_as_one_file(tmp_path, monkeypatch):
    path = tmp_path / "kubelet_internal_checkpoint"
    entries = [
        {
            "PodUID": f"u{i}",
            "ContainerName": "c",
            "ResourceName": "example.com/gpu-share",
            "DeviceIDs": {"0": [f"GPU-a::{i}"]},
            "AllocResp": answer("8"),
        }
        for i in range(40)
    ]
    path.write_text(
        json.dumps(
            {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {"r": ["é"] * 50}}, "Checksum": 1},
            indent=2,
            ensure_ascii=False,
        )
    )
    monkeypatch.setattr(holds, "CHUNK", 37)
    found = read_checkpoint(path, OURS)
    assert sorted(found) == sorted(("example.com/gpu-share", f"GPU-a::{i}") for i in range(40)) and {
        h.replicas for h in found.values()
    } == {8}


class _Listing:
    """A pod-resources client whose List answers no pods (the holders below are the checkpoint's alone)."""

    def list(self):
        from deviceplugin.api import podresources_pb2 as pr

        return pr.ListPodResourcesResponse()


def test_a_checkpoint_holder_counts_while_its_pod_directory_exists(tmp_path):
    """The kubelet keeps a deleted pod's entry until its next checkpoint write: the pod's directory tells it is gone."""
    from deviceplugin.agent.holds import ContainerHolds

    plugins = tmp_path / "device-plugins"
    plugins.mkdir()
    write(
        plugins / "kubelet_internal_checkpoint",
        [
            {
                "PodUID": "alive",
                "ContainerName": "init",
                "ResourceName": "example.com/gpu",
                "DeviceIDs": {"0": ["GPU-a"]},
            },
            {
                "PodUID": "gone",
                "ContainerName": "init",
                "ResourceName": "example.com/gpu",
                "DeviceIDs": {"0": ["GPU-b"]},
            },
        ],
    )
    holds = ContainerHolds(_Listing(), plugins, OURS)  # type: ignore[arg-type]
    assert {h.device for h in holds()} == {"GPU-a", "GPU-b"}  # no pods directory: cannot tell, both count
    (tmp_path / "pods" / "alive").mkdir(parents=True)
    assert {h.device for h in holds()} == {"GPU-a"}

"""The kubelet's checkpoint, read only and never trusted: both formats, the share count our Allocate answer carried,
and anything malformed or oversized unknown (HoldsUnknown), never empty."""

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
    write(path, [
        {"PodUID": "u1", "ContainerName": "c", "ResourceName": "example.com/gpu-share", "DeviceIDs": {"0": ["GPU-a::0", "GPU-a::1"]}, "AllocResp": answer("4")},
        {"PodUID": "u2", "ContainerName": "c", "ResourceName": "example.com/gpu", "DeviceIDs": ["GPU-b"], "AllocResp": answer(None)},  # before 1.20
        {"PodUID": "u3", "ContainerName": "c", "ResourceName": "example.com/gpu-share", "DeviceIDs": {"-1": ["MIG-c::3"]}, "AllocResp": "not base64!"},
        {"PodUID": "u4", "ContainerName": "c", "ResourceName": "nvidia.com/gpu", "DeviceIDs": {"0": ["GPU-elsewhere"]}},  # not on this node
    ])
    found = read_checkpoint(path, OURS)
    assert {k: h.replicas for k, h in found.items()} == {
        ("example.com/gpu-share", "GPU-a::0"): 4, ("example.com/gpu-share", "GPU-a::1"): 4,
        ("example.com/gpu", "GPU-b"): 1,  # a whole device
        ("example.com/gpu-share", "MIG-c::3"): None,  # a share whose count the answer does not say: unknown
    }
    assert found[("example.com/gpu", "GPU-b")] == Hold("example.com/gpu", "GPU-b", 1)


def test_a_missing_file_holds_nothing_and_a_malformed_or_oversized_one_is_unknown(tmp_path, monkeypatch):
    path = tmp_path / "kubelet_internal_checkpoint"
    assert read_checkpoint(path, OURS) == {}
    for text in ("{", '{"Data": 3}', '{"Data": {"PodDeviceEntries": 5}}', '{"Data": {"PodDeviceEntries": [1]}}',
                 '{"Data": {"PodDeviceEntries": [{"ResourceName": 5}]}}',
                 '{"Data": {"PodDeviceEntries": [{"ResourceName": "r", "DeviceIDs": {"0": [7]}}]}}'):
        path.write_text(text)
        with pytest.raises(HoldsUnknown):
            read_checkpoint(path, OURS)
    monkeypatch.setattr(holds, "MAX_CHECKPOINT_BYTES", 10)
    write(path, [])
    with pytest.raises(HoldsUnknown, match="is over 10 bytes"):
        read_checkpoint(path, OURS)


def test_a_share_count_that_does_not_parse_is_an_unknown_shape(tmp_path):
    """`GPU_SHARE_TOTAL="²"` passes str.isdigit() and fails int(): the hold stays, its share count unknown."""
    path = tmp_path / "kubelet_internal_checkpoint"
    write(path, [{"PodUID": "u", "ContainerName": "c", "ResourceName": "example.com/gpu-share", "DeviceIDs": {"0": ["GPU-a::0"]}, "AllocResp": answer("²")}])
    assert {k: h.replicas for k, h in read_checkpoint(path, OURS).items()} == {("example.com/gpu-share", "GPU-a::0"): None}

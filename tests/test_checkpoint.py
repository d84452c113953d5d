"""The kubelet's checkpoint, read only and never trusted: both formats, the share count our Allocate answer carried,
and anything malformed or oversized skipped."""

from __future__ import annotations

import base64
import json

from deviceplugin.agent import holds
from deviceplugin.agent.holds import read_checkpoint
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


def test_missing_malformed_and_oversized_files_hold_nothing(tmp_path, monkeypatch, caplog):
    path = tmp_path / "kubelet_internal_checkpoint"
    assert read_checkpoint(path, OURS) == {}
    for text in ("{", '{"Data": 3}', '{"Data": {"PodDeviceEntries": [1, "x", {"ResourceName": 5}, {"ResourceName": "r", "DeviceIDs": {"0": [7]}}]}}'):
        path.write_text(text)
        assert read_checkpoint(path, OURS) == {}
    monkeypatch.setattr(holds, "MAX_CHECKPOINT_BYTES", 10)
    write(path, [])
    assert read_checkpoint(path, OURS) == {} and "is over 10 bytes: not read" in caplog.text

"""The committed stubs match proto/ and the wire names match the kubelet's API."""

from __future__ import annotations

import importlib.util

from deviceplugin.api import deviceplugin_pb2 as dp
from deviceplugin.api import podresources_pb2 as pr

from .conftest import ROOT


def _generator():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh():
    stale = _generator().stale_files()
    assert stale == [], f"regenerate with `python proto/generate.py`: {stale}"


def _fields(message) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_deviceplugin_wire_names_and_numbers():
    assert dp.DESCRIPTOR.package == "v1beta1"
    assert _fields(dp.Device) == {"ID": 1, "health": 2, "topology": 3}
    assert _fields(dp.NUMANode) == {"ID": 1}
    assert _fields(dp.RegisterRequest) == {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}
    assert _fields(dp.DevicePluginOptions) == {"pre_start_required": 1, "get_preferred_allocation_available": 2}
    assert _fields(dp.ContainerAllocateRequest) == {"devices_ids": 1}
    assert _fields(dp.ContainerPreferredAllocationRequest) == {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    }
    assert _fields(dp.ContainerPreferredAllocationResponse) == {"deviceIDs": 1}
    assert _fields(dp.ContainerAllocateResponse) == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
    methods = {m.full_name for s in dp.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert methods == {
        "v1beta1.Registration.Register",
        "v1beta1.DevicePlugin.GetDevicePluginOptions",
        "v1beta1.DevicePlugin.ListAndWatch",
        "v1beta1.DevicePlugin.GetPreferredAllocation",
        "v1beta1.DevicePlugin.Allocate",
        "v1beta1.DevicePlugin.PreStartContainer",
    }
    assert dp.DESCRIPTOR.services_by_name["DevicePlugin"].methods_by_name["ListAndWatch"].server_streaming


def test_podresources_wire_names_and_numbers():
    assert pr.DESCRIPTOR.package == "v1"
    assert _fields(pr.PodResources) == {"name": 1, "namespace": 2, "containers": 3, "cpu_ids": 4, "memory": 5}
    assert _fields(pr.ContainerResources) == {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4, "dynamic_resources": 5}
    assert _fields(pr.ContainerDevices) == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert _fields(pr.DynamicResource) == {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4}
    assert _fields(pr.ClaimResource) == {"cdi_devices": 1, "driver_name": 2, "pool_name": 3, "device_name": 4, "share_id": 5}
    methods = {m.name for m in pr.DESCRIPTOR.services_by_name["PodResourcesLister"].methods}
    assert methods == {"List", "GetAllocatableResources", "Get"}

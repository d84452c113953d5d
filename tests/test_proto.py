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
    assert _fields(dp.ContainerAllocateResponse) == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
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
    assert _fields(pr.ContainerResources) == {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    }
    assert _fields(pr.ContainerDevices) == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert _fields(pr.DynamicResource) == {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4}
    assert _fields(pr.ClaimResource) == {
        "cdi_devices": 1,
        "driver_name": 2,
        "pool_name": 3,
        "device_name": 4,
        "share_id": 5,
    }
    methods = {m.name for m in pr.DESCRIPTOR.services_by_name["PodResourcesLister"].methods}
    assert methods == {"List", "GetAllocatableResources", "Get"}


def test_dra_wire_names_and_numbers():
    from deviceplugin.api import dra_health_v1alpha1_pb2 as health
    from deviceplugin.api import dra_v1_pb2 as v1
    from deviceplugin.api import dra_v1beta1_pb2 as v1beta1
    from deviceplugin.api import pluginregistration_v1_pb2 as reg

    assert v1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert v1beta1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    assert health.DESCRIPTOR.package == "v1alpha1"
    assert reg.DESCRIPTOR.package == "pluginregistration"
    assert _fields(v1.Device) == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    }
    assert _fields(v1beta1.Device) == {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4}
    for api in (v1, v1beta1):
        assert _fields(api.Claim) == {"namespace": 1, "uid": 2, "name": 3}
        assert _fields(api.NodePrepareResourceResponse) == {"devices": 1, "error": 2}
        assert _fields(api.NodeUnprepareResourceResponse) == {"error": 1}
    assert _fields(health.DeviceHealth) == {
        "device": 1,
        "health": 2,
        "last_updated_time": 3,
        "health_check_timeout_seconds": 4,
        "message": 5,
    }
    assert _fields(reg.PluginInfo) == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    assert _fields(reg.RegistrationStatus) == {"plugin_registered": 1, "error": 2}
    methods = {
        m.full_name
        for module in (v1, v1beta1, health, reg)
        for s in module.DESCRIPTOR.services_by_name.values()
        for m in s.methods
    }
    assert methods == {
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin.NodePrepareResources",
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin.NodeUnprepareResources",
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin.NodePrepareResources",
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin.NodeUnprepareResources",
        "v1alpha1.DRAResourceHealth.NodeWatchResources",
        "pluginregistration.Registration.GetInfo",
        "pluginregistration.Registration.NotifyRegistrationStatus",
    }
    assert (
        health.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods_by_name["NodeWatchResources"].server_streaming
    )

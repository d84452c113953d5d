"""The real control plane the end-to-end tests share answers with the DRA API of Kubernetes 1.36."""

from __future__ import annotations

from typing import Any


def test_the_control_plane_serves_resource_k8s_io_v1(controlplane: Any) -> None:
    from kubernetes import client

    api = controlplane.api_client()
    groups = {g.name: [v.version for v in g.versions] for g in client.ApisApi(api).get_api_versions().groups}
    assert "v1" in groups["resource.k8s.io"]
    assert client.ResourceV1Api(api).list_resource_slice().items == []

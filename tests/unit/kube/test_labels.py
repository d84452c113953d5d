"""The node labels (GFD's names and values, MIG, sharing) as plain data."""

from __future__ import annotations

from deviceplugin.kube.labels import node_labels
from tests.conftest import node
from tests.support.resources import resources_of


def test_gfd_label_values():
    a100 = node_labels("example.com", node("8xA100-80GB-mig"), [])
    assert a100["example.com/mig.capable"] == "true" and a100["example.com/gpu.family"] == "ampere"
    assert a100["example.com/mig-1g.10gb.count"] == "10" and a100["example.com/mig-1g.10gb.memory"] == "9984"
    assert a100["example.com/mig-7g.80gb.count"] == "1"
    mixed = resources_of({"version": "v1", "pools": [{"name": "m", "mode": "mig"}]}, node("8xA100-80GB-mig"))
    assert node_labels("example.com", node("8xA100-80GB-mig"), mixed)["example.com/mig.strategy"] == "mixed"
    assert node_labels("example.com", node("8xA100-80GB-mig"), mixed)["example.com/gpu-share.m-1g.10gb.replicas"] == "1"
    h100 = node("8xH100-80GB")
    assert node_labels("example.com", h100, [])["example.com/mig.capable"] == "true"  # supported, not enabled
    assert node_labels("example.com", node("2xT4"), [])["example.com/mig.capable"] == "false"
    shared = resources_of(
        {"version": "v1", "pools": [{"name": "s", "mode": "shared", "backend": "mps", "replicas": 4}]}, h100
    )
    labels = node_labels("example.com", h100, shared, shared_product_suffix=True)
    assert (
        labels["example.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"
        and labels["example.com/gpu.family"] == "hopper"
    )
    assert labels["example.com/gpu.sharing-strategy"] == "mps" and labels["example.com/gpu.replicas"] == "4"
    assert node_labels("example.com", h100, shared)["example.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    deprecated = node_labels("example.com", node("2xT4"), [], deprecated_cuda_labels=True)
    assert {k: v for k, v in deprecated.items() if ".driver." in k or ".runtime." in k} == {
        "example.com/cuda.driver.major": "550",
        "example.com/cuda.driver.minor": "54",
        "example.com/cuda.driver.rev": "15",
        "example.com/cuda.runtime.major": "12",
        "example.com/cuda.runtime.minor": "4",
    }
    assert deprecated["example.com/cuda.driver-version.full"] == "550.54.15"  # the current names stay

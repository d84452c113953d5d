"""What the extender parses: a pod's CPU and memory request as kube-scheduler counts it, a Node's allocatable."""

from __future__ import annotations

import pytest

from deviceplugin.extender.inputs import HostCapacity, InputError, host_capacity, host_request


@pytest.mark.parametrize(
    "spec, expected",
    [
        (
            {
                "containers": [
                    {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
                    {"resources": {"limits": {"cpu": "500m", "memory": "1e9"}}},
                ]
            },
            (1500, 1024 + 954),
        ),
        # ordinary init containers run alone (with the sidecars started before them); sidecars run with the containers
        (
            {
                "containers": [{"resources": {"requests": {"cpu": "1"}}}],
                "initContainers": [
                    {"resources": {"requests": {"cpu": "4"}}},
                    {"restartPolicy": "Always", "resources": {"requests": {"cpu": "1", "memory": "1Mi"}}},
                    {"resources": {"requests": {"cpu": "3500m", "memory": "3Gi"}}},
                ],
            },
            (4500, 3073),
        ),
        (
            {"containers": [{"resources": {"requests": {"cpu": "2"}}}], "overhead": {"cpu": "250m", "memory": "64Mi"}},
            (2250, 64),
        ),
        (
            {
                "containers": [{"resources": {"requests": {"cpu": "2"}}}],
                "resources": {"requests": {"cpu": "3", "memory": "0.5Gi"}},
            },
            (3000, 512),
        ),
        ({"containers": [{}]}, (0, 0)),
    ],
)
def test_host_request_counts_as_kube_scheduler_does(spec, expected):
    assert host_request(spec) == expected


def test_bad_quantities_and_missing_allocatable():
    with pytest.raises(InputError, match=r"Pod.spec.containers\[0\].resources.cpu: '1x' is not a quantity"):
        host_request({"containers": [{"resources": {"requests": {"cpu": "1x"}}}]})
    assert host_capacity(
        {"status": {"allocatable": {"cpu": "95500m", "memory": "1Gi", "pods": "110"}}}
    ) == HostCapacity(95500, 1024, 110)
    assert host_capacity({"status": {"allocatable": {"cpu": "9" * 80}}}) == HostCapacity()  # unreadable: unlimited

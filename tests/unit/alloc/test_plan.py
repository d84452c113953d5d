"""The plan: pools x node -> the resources advertised (names, device counts), and refusals that name the config key."""

from __future__ import annotations

import pytest

from deviceplugin.alloc.plan import build_resources
from deviceplugin.config.parse import parse_config
from deviceplugin.config.types import ConfigError
from tests.conftest import node

SHARED = {"name": "s", "mode": "shared"}
EXCLUSIVE = {"name": "e", "mode": "exclusive"}


def plan(pools: list[dict], node_name: str, budget_bytes: int | None = None, **top) -> dict[str, int]:
    config = parse_config({"version": "v1", **top, "pools": pools})
    extra = {} if budget_bytes is None else {"budget_bytes": budget_bytes}
    return {r.name: len(r.devices) for r in build_resources(config, node(node_name), **extra)}


# 8xA100-80GB-mig: GPU 0 7x 1g.10gb; GPU 1 3g.40gb 2g.20gb 1g.10gb 1g.10gb; GPU 2 2x 3g.40gb; GPU 3 4g.40gb 2g.20gb
# 1g.10gb; GPU 4 7g.80gb; GPUs 5-7 without MIG.
@pytest.mark.parametrize(
    "pools, node_name, top, resources",
    [
        ([{**SHARED, "replicas": 4}], "2xT4", {}, {"example.com/gpu-share": 8}),
        ([{**SHARED, "memoryPerShare": "5Gi"}], "2xT4", {}, {"example.com/gpu-share": 6}),  # 15360 MiB: 3 shares each
        ([EXCLUSIVE], "2xT4", {"domain": "acme.io"}, {"acme.io/gpu": 2}),
        (
            [{**EXCLUSIVE, "gpus": {"indexes": [0]}}, {**SHARED, "replicas": 2}],
            "2xT4",
            {},
            {"example.com/gpu": 1, "example.com/gpu-share": 2},
        ),
        ([{**EXCLUSIVE, "gpus": {"models": ["*t4*"]}}], "2xT4", {}, {"example.com/gpu": 2}),
        ([EXCLUSIVE], "8xA100-80GB-mig", {}, {"example.com/gpu": 3}),  # MIG-enabled GPUs are not advertised whole
        (
            [{**SHARED, "replicas": 2}],
            "8xA100-80GB-mig",
            {},
            {"example.com/gpu-share": (17 + 3) * 2},
        ),  # instance by instance
        (
            [{"name": "m", "mode": "mig"}],
            "8xA100-80GB-mig",
            {},
            {
                "example.com/mig-1g.10gb": 10,
                "example.com/mig-2g.20gb": 2,
                "example.com/mig-3g.40gb": 3,
                "example.com/mig-4g.40gb": 1,
                "example.com/mig-7g.80gb": 1,
            },
        ),
        ([{"name": "m", "mode": "mig", "strategy": "single"}], "2xH100-mig-1g", {}, {"example.com/gpu": 14}),
        (
            [{"name": "m", "mode": "mig", "gpus": {"indexes": [5]}}],
            "8xA100-80GB-mig",
            {},
            {},
        ),  # no MIG there: nothing, a warning
    ],
)
def test_resources(pools, node_name, top, resources):
    assert plan(pools, node_name, **top) == resources


@pytest.mark.parametrize(
    "pools, node_name, budget_bytes, problem",
    [
        (
            [{**EXCLUSIVE, "gpus": {"indexes": [5]}}],
            "2xT4",
            None,
            r"pools\[0\]\.gpus\.indexes: no GPU with index 5 on this node \(indexes 0, 1\)",
        ),
        (
            [{**EXCLUSIVE, "gpus": {"uuids": ["GPU-nope"]}}],
            "2xT4",
            None,
            r"pools\[0\]\.gpus\.uuids: no GPU GPU-nope on this node",
        ),
        (
            [{**EXCLUSIVE, "gpus": {"indexes": [0]}}, {**SHARED, "gpus": {"indexes": [0, 1]}}],
            "2xT4",
            None,
            r"pools\[1\]\.gpus: GPU 0 \(GPU-\S+\) is already selected by pools\[0\] \(e\)",
        ),
        (
            [{**SHARED, "memoryPerShare": "20Gi"}],
            "2xT4",
            None,
            r"pools\[0\]\.memoryPerShare: 20480 MiB is larger than GPU 0 \(.*15360 MiB\)",
        ),
        (
            [{**SHARED, "backend": "mps", "memoryPerShare": "100Mi"}],
            "2xT4",
            None,
            r"pools\[0\]\.memoryPerShare: .* makes 153 shares .* limit of 48",
        ),
        (
            [{**SHARED, "backend": "mps"}],
            "8xA100-80GB-mig",
            None,
            r"pools\[0\]\.backend: mps is not supported on MIG-enabled GPUs \(GPU 0, 1, 2, 3, 4\)",
        ),
        (
            [{"name": "m", "mode": "mig", "strategy": "single"}],
            "8xA100-80GB-mig",
            None,
            r"pools\[0\]\.strategy: single needs one MIG profile",
        ),
        (
            [{**SHARED, "replicas": 4}],
            "2xT4",
            400,
            r"pools\[0\]: 8 devices \(2 GPUs, 4 shares each\) .* over the 400 byte budget.*lower replicas",
        ),
        (
            [EXCLUSIVE],
            "2xT4",
            100,
            r"pools\[0\]: 2 devices \(2 GPUs, whole devices\) .* over the 100 byte budget.*select fewer GPUs",
        ),
    ],
)
def test_refusals_name_the_key(pools, node_name, budget_bytes, problem):
    with pytest.raises(ConfigError, match=problem):
        plan(pools, node_name, budget_bytes)


def test_fgdstrand_refuses_more_shares_per_gpu_than_its_model_can_score_naming_the_key():
    """The cluster model splits a GPU in thousandths: 1024 shares would make every GetPreferredAllocation fail."""
    pools = [{"name": "s", "mode": "shared", "replicas": 1024}]
    with pytest.raises(ConfigError) as err:
        build_resources(parse_config({"version": "v1", "allocationPolicy": "fgdstrand", "pools": pools}), node("2xT4"))
    assert (
        "allocationPolicy: fgdstrand" in str(err.value)
        and "at most 1000 shares" in str(err.value)
        and "pools[0]" in str(err.value)
    )
    assert build_resources(parse_config({"version": "v1", "allocationPolicy": "binpack", "pools": pools}), node("2xT4"))
    finest = build_resources(
        parse_config({"version": "v1", "allocationPolicy": "fgdstrand", "pools": [{**pools[0], "replicas": 1000}]}),
        node("2xT4"),
    )
    assert finest[0].units[0].replicas == 1000


def test_fgdstrand_accepts_units_of_unequal_share_counts_which_binpack_places():
    """MIG instances of different sizes under memoryPerShare: the cluster policy does not score them (binpack does),
    so a count over 1000 on one of them is no reason to refuse."""
    pool = {"name": "s", "mode": "shared", "memoryPerShare": "40Mi", "gpus": {"indexes": [3]}}
    resources = build_resources(
        parse_config({"version": "v1", "allocationPolicy": "fgdstrand", "pools": [pool]}), node("8xA100-80GB-mig")
    )
    assert sorted(u.replicas for u in resources[0].units) == [249, 499, 1004]


def test_a_dynamic_mig_pool_is_refused_by_the_device_plugin_naming_the_key():
    pools = [
        {"name": "e", "mode": "exclusive", "gpus": {"indexes": [5, 6, 7]}},
        {"name": "dyn", "mode": "mig", "strategy": "dynamic"},
    ]
    config = parse_config({"version": "v1", "pools": pools})
    with pytest.raises(
        ConfigError,
        match=r"pools\[1\]\.strategy: dynamic makes MIG instances per claim, which only the DRA driver does "
        r"\(gpu-share run --api dra\)",
    ):
        build_resources(config, node("8xA100-80GB-mig"))
    served = build_resources(
        config, node("8xA100-80GB-mig"), dynamic_mig=True
    )  # the DRA driver: every GPU of the pool whole
    assert [(r.name, sorted(u.gpu.index for u in r.units), {u.mig for u in r.units}) for r in served] == [
        ("example.com/gpu", [5, 6, 7], {None}),
        ("example.com/mig-dynamic", [0, 1, 2, 3, 4], {None}),
    ]

"""Config parsing, validation messages and how pools become resources on a node."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from deviceplugin.alloc.plan import LIST_BUDGET_BYTES, build_resources
from deviceplugin.config.parse import load_config, parse_config
from deviceplugin.config.types import ConfigError, default_config
from deviceplugin.model.node import NodeInfo
from tests.conftest import EXAMPLES, node

H100 = node("8xH100-80GB")
T4 = node("2xT4")


def pools(*items, **top):
    return {"version": "v1", "pools": list(items), **top}


def test_default_config_shares_every_gpu_in_ten():
    resources = build_resources(default_config(), H100)
    assert [r.name for r in resources] == ["example.com/gpu-share"]
    assert len(resources[0].devices) == 80
    assert list(resources[0].devices)[:2] == [f"{H100.gpus[0].uuid}::0", f"{H100.gpus[0].uuid}::1"]


@pytest.mark.parametrize("path", sorted((EXAMPLES / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_uses_every_gpu_of_its_node(path):
    target = node("8xA100-80GB-mig") if path.name.startswith("mig") else H100
    resources = build_resources(load_config(path), target)
    assert len({g.uuid for r in resources for g in r.gpus}) == 8, f"{path.name} leaves GPUs out"


def test_mixed_config_splits_the_node():
    config = load_config(EXAMPLES / "config" / "mixed.yaml")
    by_name = {r.name: r for r in build_resources(config, H100)}
    assert [g.index for g in by_name["example.com/gpu"].gpus] == [0, 1, 2, 3]
    assert [g.index for g in by_name["example.com/gpu-share"].gpus] == [4, 5, 6, 7]
    assert len(by_name["example.com/gpu-share"].devices) == 32


def test_model_patterns_are_case_insensitive_and_domain_applies():
    config = load_config(EXAMPLES / "config" / "by-model.yaml")
    names = {r.name: len(r.gpus) for r in build_resources(config, T4)}
    assert names == {"example.com/t4-share": 2}
    names = {r.name: len(r.gpus) for r in build_resources(config, H100)}
    assert names == {"example.com/gpu": 8}


@pytest.mark.parametrize(
    "data, message",
    [
        ("not a mapping", "(top level): must be a mapping, got string 'not a mapping'"),
        ({"pools": []}, "version: is required"),
        (pools({"name": "a", "mode": "shared"}, version="v2"), "version: unsupported version 'v2' (supported: v1)"),
        (
            pools({"name": "a", "mode": "shared"}, colour="red"),
            "colour: unknown key (known keys: allocationPolicy, cdiKind, defaultProfile, deprecatedCudaLabels, "
            "deviceListStrategy, deviceRoot, deviceSpecs, domain, memoryWatchdog, mpsRoot, pools, profiles, "
            "sharedProductSuffix, version)",
        ),
        ({"version": "v1"}, "pools: is required"),
        ({"version": "v1", "pools": []}, "pools: must list at least one pool"),
        ({"version": "v1", "pools": {"a": 1}}, "pools: must be a list, got a mapping"),
        (
            pools({"name": "a", "mode": "shared"}, allocationPolicy="random"),
            "allocationPolicy: must be one of binpack, spread, fgdstrand, got 'random'",
        ),
        (pools({"mode": "shared"}), "pools[0].name: is required"),
        (pools({"name": "A_pool", "mode": "shared"}), "pools[0].name: must be 1-40 characters of [a-z0-9-]"),
        (
            pools({"name": "a", "mode": "timeslice"}),
            "pools[0].mode: must be one of exclusive, shared, mig, got 'timeslice'",
        ),
        (pools({"name": "a", "mode": "shared", "replicas": 0}), "pools[0].replicas: must be >= 1, got 0"),
        (
            pools({"name": "a", "mode": "shared", "replicas": "4"}),
            "pools[0].replicas: must be an integer, got string '4'",
        ),
        (
            pools({"name": "a", "mode": "shared", "replicas": True}),
            "pools[0].replicas: must be an integer, got boolean True",
        ),
        (
            pools({"name": "a", "mode": "exclusive", "replicas": 2}),
            "pools[0].replicas: only applies to mode shared, or mode mig with strategy dynamic "
            "(this pool is exclusive)",
        ),
        (pools({"name": "a", "mode": "shared", "sharing": 2}), "pools[0].sharing: unknown key"),
        (
            pools({"name": "a", "mode": "shared", "resource": "Example.com/gpu"}),
            "pools[0].resource: 'Example.com/gpu' is not a valid extended resource name: "
            "domain must be a lowercase DNS subdomain",
        ),
        (
            pools({"name": "a", "mode": "shared", "resource": "gpu-"}),
            "pools[0].resource: 'example.com/gpu-' is not a valid extended resource name: name part",
        ),
        (
            pools({"name": "a", "mode": "shared", "resource": "kubernetes.io/gpu"}),
            "pools[0].resource: 'kubernetes.io/gpu' is not a valid extended resource name: "
            "must not use the kubernetes.io domain",
        ),
        (
            pools({"name": "a", "mode": "shared", "sharingStrategies": ["timeSlicing"]}),
            "pools[0].sharingStrategies: only applies to backend mps (a timeSlicing pool runs no MPS control daemon",
        ),
        (
            pools({"name": "a", "mode": "shared", "backend": "mps", "sharingStrategies": ["timeSlicing"]}),
            "pools[0].sharingStrategies: must include mps, the pool's backend",
        ),
        (
            pools({"name": "a", "mode": "shared", "backend": "mps", "sharingStrategies": ["mps", "MPS"]}),
            "pools[0].sharingStrategies: each must be one of timeSlicing, mps, got ['mps', 'MPS']",
        ),
        (
            pools(
                {
                    "name": "a",
                    "mode": "shared",
                    "backend": "mps",
                    "exclusiveProcess": True,
                    "sharingStrategies": ["mps", "timeSlicing"],
                }
            ),
            "pools[0].sharingStrategies: timeSlicing cannot be offered with exclusiveProcess: true",
        ),
        (pools({"name": "a", "mode": "shared", "gpus": {}}), "pools[0].gpus: selects no GPU"),
        (
            pools({"name": "a", "mode": "shared", "gpus": {"indexes": [0, "1"]}}),
            "pools[0].gpus.indexes[1]: must be an integer, got string '1'",
        ),
        (
            pools({"name": "a", "mode": "shared", "gpus": {"indexes": [-1]}}),
            "pools[0].gpus.indexes[0]: must be 0-1023, got -1",
        ),
        (pools({"name": "a", "mode": "shared", "gpus": {"names": ["x"]}}), "pools[0].gpus.names: unknown key"),
        (
            pools({"name": "a", "mode": "shared"}, {"name": "a", "mode": "exclusive"}),
            "pools[1].name: 'a' is already used by pools[0]",
        ),
        (
            pools(
                {"name": "a", "mode": "shared", "resource": "x"},
                {"name": "b", "mode": "exclusive", "resource": "x", "gpus": {"indexes": [0]}},
            ),
            "pools[1].resource: 'example.com/x' is already used by pools[0]",
        ),
        (
            pools({"name": "a", "mode": "shared"}, {"name": "b", "mode": "exclusive"}),
            "pools[1].gpus: only one pool may omit gpus (pools[0] already takes the rest)",
        ),
    ],
)
def test_bad_config_names_key_and_reason(data, message):
    with pytest.raises(ConfigError) as err:
        parse_config(data, "cfg.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("cfg.yaml: ")


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        parse_config(
            pools({"name": "a", "mode": "shared", "replicas": 0}, {"name": "b", "mode": "bogus"}, version="v9")
        )
    assert len(err.value.problems) == 3


@pytest.mark.parametrize(
    "selection, message",
    [
        ({"indexes": [0, 9]}, "pools[0].gpus.indexes: no GPU with index 9 on this node (indexes 0, 1)"),
        ({"uuids": ["GPU-missing"]}, "pools[0].gpus.uuids: no GPU GPU-missing on this node"),
    ],
)
def test_selection_of_missing_gpu_is_refused(selection, message):
    config = parse_config(pools({"name": "a", "mode": "exclusive", "gpus": selection}))
    with pytest.raises(ConfigError) as err:
        build_resources(config, T4)
    assert message in str(err.value)


def test_overlapping_selections_are_refused():
    config = parse_config(
        pools(
            {"name": "a", "mode": "exclusive", "gpus": {"indexes": [0]}},
            {"name": "b", "mode": "shared", "gpus": {"models": ["*t4*"]}},
        )
    )
    with pytest.raises(
        ConfigError, match=r"pools\[1\].gpus: GPU 0 \(GPU-[0-9a-f-]+\) is already selected by pools\[0\] \(a\)"
    ):
        build_resources(config, T4)


def test_device_list_over_budget_is_refused():
    config = parse_config(pools({"name": "a", "mode": "shared", "replicas": 1024}))
    assert len(build_resources(config, H100)[0].devices) == 8192
    with pytest.raises(ConfigError) as err:
        build_resources(
            config,
            NodeInfo(
                gpus=tuple(replace(H100.gpus[0], index=i, uuid=f"{H100.gpus[0].uuid[:-3]}{i:03d}") for i in range(64))
            ),
        )
    message = str(err.value)
    assert "pools[0]: 65536 devices (64 GPUs, 1024 shares each) would make a ListAndWatch message of up to" in message
    assert (
        f"over the {LIST_BUDGET_BYTES} byte budget" in message
        and "at most about 3" in message
        and message.endswith("lower replicas")
    )


def test_unreadable_or_invalid_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: [v1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_yaml_round_trip_of_example_is_what_the_docs_say(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(pools({"name": "x", "mode": "shared", "replicas": 3})))
    config = load_config(path)
    assert config.pools()[0].replicas == 3 and config.pools()[0].resource == "example.com/gpu-share"


A100_MIG = node("8xA100-80GB-mig")


def test_mig_pool_advertises_one_resource_per_profile():
    config = load_config(EXAMPLES / "config" / "mig-mixed.yaml")
    by_name = {r.name: r for r in build_resources(config, A100_MIG)}
    assert sorted(by_name) == [
        "example.com/gpu-share",
        "example.com/mig-1g.10gb",
        "example.com/mig-2g.20gb",
        "example.com/mig-3g.40gb",
        "example.com/mig-4g.40gb",
        "example.com/mig-7g.80gb",
        "example.com/mig-share",
    ]
    assert len(by_name["example.com/mig-1g.10gb"].devices) == 7 + 2 + 1
    assert all(i.startswith("MIG-") for i in by_name["example.com/mig-1g.10gb"].devices)
    # GPU 2's two 3g.40gb instances, 4 shares each; the whole GPUs 5-7 in 8 shares each.
    assert len(by_name["example.com/mig-share"].devices) == 8
    assert len(by_name["example.com/gpu-share"].devices) == 24


def test_mig_profile_plus_becomes_dot_and_exclusive_skips_mig_gpus(caplog):
    from deviceplugin.alloc.modes import mig_resource_name

    assert mig_resource_name("example.com", "1g.10gb+me") == "example.com/mig-1g.10gb.me"
    config = parse_config(pools({"name": "whole", "mode": "exclusive"}))
    resources = build_resources(config, A100_MIG)
    assert [g.index for g in resources[0].gpus] == [5, 6, 7]
    assert (
        "GPU 0 (GPU-5d2e8b41-a1f0-4c3e-8d7a-000000000000) has MIG enabled: "
        "pool whole (exclusive) does not advertise it whole" in caplog.text
    )


def test_mig_pool_rejects_resource_and_replicas():
    with pytest.raises(ConfigError) as err:
        parse_config(
            pools(
                {"name": "m", "mode": "mig", "resource": "x", "gpus": {"indexes": [0]}},
                {"name": "n", "mode": "mig", "replicas": 2},
            )
        )
    assert (
        "pools[0].resource: not used by mode mig with strategy mixed: its resources are <domain>/mig-<profile>"
        in str(err.value)
    )
    assert (
        "pools[1].replicas: only applies to mode shared, or mode mig with strategy dynamic (this pool is mig, "
        "strategy mixed)" in str(err.value)
    )


def test_a_dynamic_mig_pool_takes_replicas_as_shares_per_instance():
    (pool,) = parse_config(pools({"name": "d", "mode": "mig", "strategy": "dynamic", "replicas": 4})).pools()
    assert (pool.dynamic_mig, pool.replicas) == (True, 4)
    (pool,) = parse_config(pools({"name": "d", "mode": "mig", "strategy": "dynamic"})).pools()
    assert pool.replicas == 1  # each instance held by one claim, as before the key
    with pytest.raises(ConfigError) as err:
        parse_config(pools({"name": "d", "mode": "mig", "strategy": "dynamic", "replicas": 0, "memoryPerShare": "4Gi"}))
    assert "pools[0].replicas: must be >= 1, got 0" in str(err.value)
    assert "pools[0].memoryPerShare: only applies to mode shared (this pool is mig)" in str(err.value)


def test_two_mig_pools_with_the_same_profile_collide():
    config = parse_config(
        pools(
            {"name": "a", "mode": "mig", "gpus": {"indexes": [0]}},
            {"name": "b", "mode": "mig", "gpus": {"indexes": [1]}},
        )
    )
    with pytest.raises(
        ConfigError, match=r"pools\[1\]: resource example.com/mig-1g.10gb is also advertised by another pool"
    ):
        build_resources(config, A100_MIG)


def test_domain_comes_from_the_environment_when_the_file_has_none(monkeypatch):
    monkeypatch.setenv("GPU_SHARE_DOMAIN", "gpu.acme.io")
    config = parse_config({"version": "v1", "pools": [{"name": "s", "mode": "shared"}]})
    assert config.domain == "gpu.acme.io" and config.pools()[0].resource == "gpu.acme.io/gpu-share"
    assert (
        parse_config({"version": "v1", "domain": "example.org", "pools": [{"name": "s", "mode": "shared"}]}).domain
        == "example.org"
    )
    monkeypatch.setenv("GPU_SHARE_DOMAIN", "Not_A_Domain")
    with pytest.raises(
        ConfigError, match=r"domain \(from \$GPU_SHARE_DOMAIN\): 'Not_A_Domain' is not a lowercase DNS subdomain"
    ):
        parse_config({"version": "v1", "pools": [{"name": "s", "mode": "shared"}]})


def test_an_nvidia_device_plugin_config_points_to_the_migration_guide():
    nvidia = {
        "version": "v1",
        "flags": {"migStrategy": "none"},
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}},
    }
    with pytest.raises(ConfigError) as err:
        parse_config(nvidia)
    assert (
        "flags, sharing: NVIDIA's device plugin config keys; "
        "docs/migration.md maps each onto gpu-share's pools and keys" in err.value.problems
    )


def test_problems_in_a_file_name_the_key_and_its_line():
    from deviceplugin.config.parse import parse_config_text

    text = (
        "version: v1\nprofiles:\n  inference:\n    pools:\n      - name: a\n        mode: shared\n        replicas: 0\n"
        "      - mode: bogus\n"
    )
    with pytest.raises(ConfigError) as err:
        parse_config_text(text, "f.yaml")
    assert err.value.problems == [
        "profiles.inference.pools[0].replicas: must be >= 1, got 0 (line 7)",
        "profiles.inference.pools[1].name: is required (line 8)",  # missing: the line of the pool it is missing from
        "profiles.inference.pools[1].mode: must be one of exclusive, shared, mig, got 'bogus' (line 8)",
        "defaultProfile: 'default' is not a profile (profiles: inference)",  # not in the file: no line
    ]


def test_an_mps_pool_offers_claims_its_backend_or_the_sharing_strategies_it_lists():
    offered = {"name": "a", "mode": "shared", "backend": "mps", "sharingStrategies": ["mps", "timeSlicing"]}
    assert parse_config(pools(offered)).pools()[0].strategies == ("mps", "timeSlicing")
    assert parse_config(pools({"name": "a", "mode": "shared", "backend": "mps"})).pools()[0].strategies == ("mps",)
    assert parse_config(pools({"name": "a", "mode": "shared"})).pools()[0].strategies == ("timeSlicing",)

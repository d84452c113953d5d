"""The per-claim SharingConfig: parsing (bounded, fields named), the config that applies to each request (class
configs first, then the claim's, the last match wins), the checks against the pool and what the claim consumed, and
what the container's CDI env gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.config.schema import SchemaError
from deviceplugin.dra.devices import ClaimError
from deviceplugin.dra.prepare import allocation_digest
from deviceplugin.dra.sharingconfig import api_version, config_for, driver_configs, parse_parameters
from tests.support.dra import DRIVER, claim, make_driver, result

T4 = 15360
OFFERS_BOTH = [
    {
        "name": "s",
        "mode": "shared",
        "replicas": 4,
        "backend": "mps",
        "mpsLimits": "proportional",
        "sharingStrategies": ["mps", "timeSlicing"],
    }
]
TIME_SLICED = [{"name": "t", "mode": "shared", "replicas": 4}]


def sharing(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": api_version(DRIVER), "kind": "SharingConfig", "sharing": fields}


def opaque(
    parameters: Any, source: str = "FromClaim", requests: list[str] | None = None, driver: str = DRIVER
) -> dict[str, Any]:
    entry: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def configured(results: list[dict[str, Any]], *configs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    ref, body = claim(results)
    body["status"]["allocation"]["devices"]["config"] = list(configs)
    return ref, body


def env(spec_path: str, index: int = 0) -> dict[str, str]:
    spec = json.loads(Path(spec_path).read_text())
    return dict(e.split("=", 1) for e in spec["devices"][index]["containerEdits"]["env"])


# --- parsing ---------------------------------------------------------------------------------------


def test_a_full_config_parses_with_nvidias_field_names() -> None:
    config = parse_parameters(
        sharing(
            strategy="mps", mpsConfig={"defaultActiveThreadPercentage": 25, "defaultPinnedDeviceMemoryLimit": "4Gi"}
        ),
        DRIVER,
    )
    assert (config.strategy, config.active_thread_percentage, config.pinned_memory_bytes) == ("mps", 25, 4 * 1024**3)
    assert api_version(DRIVER) == "gpu-share.example.com/v1alpha1"
    assert parse_parameters({"apiVersion": api_version(DRIVER), "kind": "SharingConfig"}, DRIVER).strategy is None


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ("mps", "parameters: must be a JSON object"),
        (
            {**sharing(), "apiVersion": "gpu-share.example.com/v1"},
            "apiVersion: must be gpu-share.example.com/v1alpha1, got 'gpu-share.example.com/v1'",
        ),
        (
            {**sharing(), "apiVersion": "resource.nvidia.com/v1beta1"},
            "apiVersion: must be gpu-share.example.com/v1alpha1",
        ),
        ({**sharing(), "kind": "GpuConfig"}, "kind: must be SharingConfig, got 'GpuConfig'"),
        ({"kind": "SharingConfig"}, "apiVersion: is required"),
        ({**sharing(), "spec": {}}, "spec: unknown key"),
        (sharing(strategy="MPS"), "sharing.strategy: must be one of timeSlicing, mps, got 'MPS'"),
        (sharing(replicas=4), "sharing.replicas: unknown key"),
        (
            sharing(mpsConfig={"defaultPerDevicePinnedMemoryLimit": {"0": "1Gi"}}),
            "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: unknown key",
        ),
        (
            sharing(mpsConfig={"defaultActiveThreadPercentage": "50"}),
            "sharing.mpsConfig.defaultActiveThreadPercentage: must be an integer, got string '50'",
        ),
        (
            sharing(mpsConfig={"defaultActiveThreadPercentage": True}),
            "sharing.mpsConfig.defaultActiveThreadPercentage: must be an integer",
        ),
        (
            sharing(mpsConfig={"defaultActiveThreadPercentage": 0}),
            "sharing.mpsConfig.defaultActiveThreadPercentage: must be 1-100, got 0",
        ),
        (
            sharing(mpsConfig={"defaultActiveThreadPercentage": 101}),
            "sharing.mpsConfig.defaultActiveThreadPercentage: must be 1-100, got 101",
        ),
        (
            sharing(mpsConfig={"defaultPinnedDeviceMemoryLimit": "lots"}),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: not a quantity: 'lots'",
        ),
        (
            sharing(mpsConfig={"defaultPinnedDeviceMemoryLimit": "512Ki"}),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: must be at least 1Mi",
        ),
        (
            sharing(timeSlicingConfig={"interval": "Forever"}),
            "sharing.timeSlicingConfig.interval: must be one of Default, Short, Medium, Long",
        ),
        (sharing(timeSlicingConfig={"replicas": 2}), "sharing.timeSlicingConfig.replicas: unknown key"),
        (sharing(mpsConfig={"x": {"y": {"z": 1}}}), "sharing.mpsConfig.x.y.z: nested deeper than 4 levels"),
        ({**sharing(), **{f"k{i}": i for i in range(17)}}, "parameters: 20 fields, more than 16"),
        (sharing(strategy="mps", mpsConfig={"defaultPinnedDeviceMemoryLimit": "1" * 65}), "longer than 64 characters"),
        ({**sharing(), "note": ["x" * 1000] * 11}, "bytes, more than 10240"),
    ],
)
def test_a_malformed_config_is_refused_naming_the_field(parameters: Any, message: str) -> None:
    with pytest.raises(SchemaError) as err:
        parse_parameters(parameters, DRIVER)
    assert message in str(err.value)


def test_another_drivers_config_is_not_read_and_ours_are_kept_in_the_allocations_order() -> None:
    configs = [
        opaque("not even an object", driver="gpu.nvidia.com"),
        "not a config",
        opaque(sharing(strategy="mps"), source="FromClass"),
        opaque(sharing(strategy="timeSlicing"), requests=["a", "b/big"]),
    ]
    ours = driver_configs(configs, DRIVER)
    assert [(c.where, c.requests, c.config.strategy) for c in ours] == [
        ("config[2] (FromClass)", (), "mps"),
        ("config[3] (FromClaim)", ("a", "b/big"), "timeSlicing"),
    ]
    with pytest.raises(ClaimError, match=r"config\[0\] \(FromClaim\): sharing.strategy: must be one of"):
        driver_configs([opaque(sharing(strategy="MPS"))], DRIVER)
    with pytest.raises(ClaimError, match=r"config\[0\] \(FromClaim\): requests must be a list of at most 32"):
        driver_configs([opaque(sharing(), requests=["r"] * 33)], DRIVER)


def test_the_last_config_whose_requests_match_applies_on_the_full_or_the_base_request_name() -> None:
    configs = driver_configs(
        [
            opaque(sharing(strategy="mps"), source="FromClass"),
            opaque(sharing(strategy="timeSlicing"), requests=["small"]),
            opaque(sharing(mpsConfig={"defaultActiveThreadPercentage": 10}), requests=["big/t4"]),
        ],
        DRIVER,
    )
    picked = {request: config_for(configs, request) for request in ("gpu", "small", "small/t4", "big/t4", "big/a100")}
    assert {r: c.where if c else None for r, c in picked.items()} == {
        "gpu": "config[0] (FromClass)",
        "small": "config[1] (FromClaim)",
        "small/t4": "config[1] (FromClaim)",
        "big/t4": "config[2] (FromClaim)",
        "big/a100": "config[0] (FromClass)",
    }
    assert config_for([], "gpu") is None


# --- prepare: what the container gets --------------------------------------------------------------


def test_lower_mps_limits_reach_the_containers_env_and_the_ledger_still_counts_what_was_paid(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    low = sharing(
        strategy="mps", mpsConfig={"defaultActiveThreadPercentage": 20, "defaultPinnedDeviceMemoryLimit": "3Gi"}
    )
    prepared = driver.prepare(*configured([result("gpu-0", shares=2)], opaque(low)))
    got = env(prepared.cdi_spec)
    assert got["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20" and got["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3072M"
    assert (
        got["GPU_SHARE_COMPUTE_PERCENT"] == "20"
        and got["GPU_SHARE_MEMORY_LIMIT_MIB"] == "3072"
        and got["GPU_SHARE_COUNT"] == "2"
    )
    assert "CUDA_MPS_PIPE_DIRECTORY" in got
    assert driver.ledger() == {"gpu-0": 2} and prepared.devices[0].memory_mib == T4 // 2
    exact = sharing(
        mpsConfig={"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": f"{T4 // 2}Mi"}
    )  # what 2 of 4 shares give
    at_most = env(driver.prepare(*configured([result("gpu-1", shares=2)], opaque(exact))).cdi_spec)
    assert (
        at_most["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        and at_most["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={T4 // 2}M"
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"defaultActiveThreadPercentage": 51},
            r"claim default/c: request gpu: config\[0\] \(FromClaim\): "
            r"sharing.mpsConfig.defaultActiveThreadPercentage: 51 is more than the 50 % the claim consumed "
            r"\(2 of 4 shares of gpu-0\); at most 50",
        ),
        (
            {"defaultPinnedDeviceMemoryLimit": f"{T4 // 2 + 1}Mi"},
            rf"sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: {T4 // 2 + 1} MiB is more than the {T4 // 2} MiB "
            rf"the claim consumed \(2 of 4 shares of gpu-0\); at most {T4 // 2}Mi",
        ),
    ],
)
def test_a_limit_over_what_the_claim_consumed_is_refused_naming_the_field(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    driver = make_driver(tmp_path)
    with pytest.raises(ClaimError, match=message):
        driver.prepare(*configured([result("gpu-0", shares=2)], opaque(sharing(mpsConfig=config))))
    assert driver.ledger() == {} and not list((tmp_path / "cdi").glob("*.json"))


def test_class_configs_come_first_the_claims_win_and_a_requests_filter_limits_a_config(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    results = [result("gpu-0", shares=2, request="a"), result("gpu-1", shares=2, request="b")]
    prepared = driver.prepare(
        *configured(
            results,
            opaque(sharing(mpsConfig={"defaultActiveThreadPercentage": 40}), source="FromClass"),
            opaque(sharing(mpsConfig={"defaultActiveThreadPercentage": 10}), requests=["a"]),
        )
    )
    assert env(prepared.cdi_spec, 0)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"  # request a: the claim's config
    assert env(prepared.cdi_spec, 1)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"  # request b: only the class's applies
    # The last match is used whole: the claim's config without mpsConfig drops the class's limit.
    whole = driver.prepare(
        *configured(
            [result("gpu-0", shares=1)],
            opaque(sharing(mpsConfig={"defaultActiveThreadPercentage": 5}), source="FromClass"),
            opaque(sharing(strategy="mps")),
        )
    )
    assert env(whole.cdi_spec)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_time_slicing_on_a_pool_that_offers_it_runs_outside_mps_and_the_record_says_so(tmp_path: Path) -> None:
    driver = make_driver(tmp_path, pools=OFFERS_BOTH)
    prepared = driver.prepare(
        *configured([result("gpu-0", shares=2)], opaque(sharing(strategy="timeSlicing"), source="FromClass"))
    )
    got = env(prepared.cdi_spec)
    assert not any(k.startswith("CUDA_MPS_") for k in got) and got["GPU_SHARE_COUNT"] == "2"
    assert not json.loads(Path(prepared.cdi_spec).read_text())["devices"][0]["containerEdits"].get(
        "mounts"
    )  # no MPS pipe, no /dev/shm
    assert (
        prepared.devices[0].strategy == "timeSlicing"
        and make_driver(tmp_path, pools=OFFERS_BOTH).prepared()[0].devices[0].strategy == "timeSlicing"
    )
    mps = driver.prepare(*configured([result("gpu-1", shares=1)], opaque(sharing(strategy="mps"))))
    assert "CUDA_MPS_PIPE_DIRECTORY" in env(mps.cdi_spec) and mps.devices[0].strategy == ""  # the pool's own mode


@pytest.mark.parametrize(
    ("pools", "parameters", "message"),
    [
        (
            None,
            sharing(strategy="timeSlicing"),
            "sharing.strategy: timeSlicing is not offered on device gpu-0: pool s offers mps (its sharingStrategies)",
        ),
        (
            TIME_SLICED,
            sharing(strategy="mps"),
            "sharing.strategy: mps is not offered on device gpu-0: pool t is backend timeSlicing: no MPS control",
        ),
        (
            TIME_SLICED,
            sharing(mpsConfig={"defaultActiveThreadPercentage": 10}),
            "sharing.mpsConfig: only applies to strategy mps (this request runs timeSlicing)",
        ),
        (OFFERS_BOTH, sharing(strategy="timeSlicing", mpsConfig={}), "sharing.mpsConfig: only applies to strategy mps"),
        (
            None,
            sharing(timeSlicingConfig={"interval": "Default"}),
            "sharing.timeSlicingConfig: only applies to strategy timeSlicing (this request runs mps)",
        ),
        (
            TIME_SLICED,
            sharing(timeSlicingConfig={"interval": "Long"}),
            "sharing.timeSlicingConfig.interval: Long cannot be set: the time slice is a setting of the whole GPU",
        ),
    ],
)
def test_what_the_pool_does_not_offer_is_refused_naming_the_field(
    tmp_path: Path, pools: Any, parameters: dict[str, Any], message: str
) -> None:
    driver = make_driver(tmp_path, pools=pools)
    with pytest.raises(ClaimError) as err:
        driver.prepare(*configured([result("gpu-0", shares=1)], opaque(parameters)))
    assert message in str(err.value), str(err.value)


def test_a_config_without_a_strategy_runs_the_pools_backend_whatever_order_sharing_strategies_lists(
    tmp_path: Path,
) -> None:
    pools = [{**OFFERS_BOTH[0], "sharingStrategies": ["timeSlicing", "mps"]}]
    driver = make_driver(tmp_path, pools=pools)
    limited = driver.prepare(
        *configured([result("gpu-0", shares=1)], opaque(sharing(mpsConfig={"defaultActiveThreadPercentage": 5})))
    )
    assert env(limited.cdi_spec)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "5" and limited.devices[0].strategy == ""


def test_whole_gpus_time_slice_their_claims_processes_and_take_no_mps(tmp_path: Path) -> None:
    driver = make_driver(tmp_path, pools=[{"name": "w", "mode": "exclusive"}])
    assert driver.prepare(
        *configured(
            [result("gpu-0")], opaque(sharing(strategy="timeSlicing", timeSlicingConfig={"interval": "Default"}))
        )
    ).devices
    with pytest.raises(
        ClaimError, match="mps is not offered on device gpu-1: pool w is mode exclusive: no MPS control daemon"
    ):
        driver.prepare(*configured([result("gpu-1")], opaque(sharing(strategy="mps"))))


def test_one_bad_config_fails_its_claim_only(tmp_path: Path) -> None:
    import asyncio

    from deviceplugin.dra.prepare import prepare_claims
    from tests.support.dra import MemoryClaims

    driver = make_driver(tmp_path)
    good = configured([result("gpu-0", shares=1)], opaque(sharing(strategy="mps")))
    bad = configured([result("gpu-1", shares=1)], opaque(sharing(mpsConfig={"defaultActiveThreadPercentage": 26})))
    source = MemoryClaims()
    source.put(good[1])
    source.put(bad[1])
    outcomes = asyncio.run(prepare_claims(driver, source, [good[0], bad[0]]))
    assert outcomes[good[0].uid].claim is not None and not outcomes[good[0].uid].error
    assert (
        outcomes[bad[0].uid].claim is None
        and "defaultActiveThreadPercentage: 26 is more than the 25 %" in outcomes[bad[0].uid].error
    )


def test_the_configs_are_part_of_the_allocation_a_record_was_prepared_from(tmp_path: Path) -> None:
    plain = claim([result("gpu-0", shares=1)])[1]["status"]["allocation"]
    foreign = {**plain, "devices": {**plain["devices"], "config": [opaque(sharing(), driver="gpu.nvidia.com")]}}
    assert allocation_digest(DRIVER, foreign) == allocation_digest(
        DRIVER, plain
    )  # records made before configs still match
    driver = make_driver(tmp_path)
    ref, body = configured(
        [result("gpu-0", shares=2)], opaque(sharing(mpsConfig={"defaultActiveThreadPercentage": 10}))
    )
    first = driver.prepare(ref, body)
    body["status"]["allocation"]["devices"]["config"] = [
        opaque(sharing(mpsConfig={"defaultActiveThreadPercentage": 30}))
    ]
    again = driver.prepare(ref, body)  # re-allocated under the same UID, same device, another config
    assert again.allocation != first.allocation and env(again.cdi_spec)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    Path(again.cdi_spec).unlink()  # a reboot emptied the CDI tmpfs: the spec is written again with the config
    assert driver.prepare(ref, body) == again and env(again.cdi_spec)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"


def test_the_memory_watchdog_watches_a_claim_that_chose_time_slicing_on_an_mps_pool(tmp_path: Path) -> None:
    from deviceplugin.api import podresources_pb2 as pr
    from deviceplugin.dra.usage import ClaimUsage

    driver = make_driver(tmp_path, pools=OFFERS_BOTH)
    sliced, held = result("gpu-0", shares=1), result("gpu-1", shares=1)
    driver.prepare(*configured([sliced], opaque(sharing(strategy="timeSlicing"))))
    driver.prepare(*claim([held], name="d"))
    containers = [
        pr.ContainerResources(
            name=name,
            dynamic_resources=[
                pr.DynamicResource(
                    claim_name=name,
                    claim_namespace="default",
                    claim_resources=[
                        pr.ClaimResource(
                            driver_name=DRIVER, pool_name="2xT4", device_name=r["device"], share_id=r["shareID"]
                        )
                    ],
                )
            ],
        )
        for name, r in (("c", sliced), ("d", held))
    ]
    listing = pr.ListPodResourcesResponse(
        pod_resources=[pr.PodResources(name="p", namespace="default", containers=containers)]
    )
    usage = ClaimUsage(driver.prepared, lambda: driver.devices, DRIVER, "2xT4")(listing, [])
    assert {s.container: s.time_sliced for s in usage.shares} == {
        "c": True,
        "d": False,
    }  # d runs under MPS, which holds its memory


def test_the_docs_and_the_example_hold_configs_that_parse_and_the_docs_table_names_every_field() -> None:
    import re

    import yaml

    from deviceplugin.dra import sharingconfig
    from tests.conftest import ROOT

    section = (ROOT / "docs" / "dra.md").read_text().split("## Sharing chosen per claim")[1].split("\n## ")[0]
    texts = re.findall(r"```yaml\n(.*?)```", section, flags=re.S) + [
        (ROOT / "daemonset" / "dra" / "examples" / "claim-mps-limits.yaml").read_text()
    ]
    documents = [d for text in texts for d in yaml.safe_load_all(text)]
    specs = [d["spec"] for d in documents if d.get("kind") in ("ResourceClaim", "DeviceClass")] + [
        d["spec"] for d in documents if "kind" not in d
    ]
    configs = [c for spec in specs for c in (spec.get("devices", {}).get("config") or spec.get("config") or [])]
    assert len(configs) == 3  # the docs' claim and class, the example's claim
    for config in configs:
        assert (
            config["opaque"]["driver"] == DRIVER
            and parse_parameters(config["opaque"]["parameters"], DRIVER).strategy == "mps"
        )
    fields = {*sharingconfig._TOP, "sharing.strategy"} - {"sharing"}  # mpsConfig and timeSlicingConfig: their fields
    fields |= {f"sharing.mpsConfig.{k}" for k in sharingconfig._MPS} | {
        f"sharing.timeSlicingConfig.{k}" for k in sharingconfig._TIME_SLICING
    }
    table = set(re.findall(r"^\| `([A-Za-z.]+)` \|", section, flags=re.M))
    assert fields <= table, sorted(fields - table)

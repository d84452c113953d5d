"""Dynamic MIG as partitionable devices: counters and devices from the GPU's profiles, within the API's limits, and
counters that allow exactly the instance pairs NVML (the simulation of it) allows."""

from __future__ import annotations

import itertools
import re

import pytest

from deviceplugin.alloc.plan import build_resources
from deviceplugin.config.parse import parse_config
from deviceplugin.discovery.mig import MigError
from deviceplugin.discovery.migsim import SimulatedMig, model_profiles
from deviceplugin.dra.devices import DraDevice, dra_devices
from deviceplugin.dra.partitions import counter_sets, gpu_counters
from deviceplugin.dra.pool import Pool, owner_reference
from deviceplugin.model.node import Gpu, NodeInfo

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
H100 = ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB")
CONFIG = {"version": "v1", "pools": [{"name": "dyn", "mode": "mig", "strategy": "dynamic"}]}


def h100_node(n: int, mig_off: tuple[int, ...] = ()) -> NodeInfo:
    name, memory, key = H100
    gpus = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-h100-{i}",
            model=name,
            memory_mib=memory,
            mig_capable=True,
            mig_enabled=i not in mig_off,
            mig_profiles=() if i in mig_off else model_profiles(key),
        )
        for i in range(n)
    )
    return NodeInfo(gpus=gpus, driver_version="570.124.06")


def devices_of(node: NodeInfo) -> list[DraDevice]:
    return dra_devices(build_resources(parse_config(CONFIG), node, dynamic_mig=True))


def fits(*devices: dict, sets: list[dict] | None = None) -> bool:
    """The scheduler's rule: the counters the devices consume together stay within their sets' (default: one H100's)."""
    totals = {c["name"]: {k: int(v["value"]) for k, v in c["counters"].items()} for c in sets or SETS}
    used: dict[tuple[str, str], int] = {}
    for d in devices:
        for consumed in d["consumesCounters"]:
            for k, v in consumed["counters"].items():
                key = (consumed["counterSet"], k)
                used[key] = used.get(key, 0) + int(v["value"])
    return all(n <= totals[s][k] for (s, k), n in used.items())


SETS = counter_sets(h100_node(1).gpus)


def test_one_h100_is_one_counter_set_and_a_device_per_profile_and_placement():
    devices = devices_of(h100_node(1))
    assert len(devices) == 7 + 7 + 4 + 3 + 2 + 1 + 1  # 1g.10gb, +me, 1g.20gb, 2g, 3g, 4g, 7g placements
    rendered = [d.to_api("gpu-share.example.com", h100_node(1)) for d in devices]
    assert all(DNS_LABEL.match(d["name"]) for d in rendered)
    assert "gpu-0-mig-1g-10gb-me-3" in {d["name"] for d in rendered}
    counters = gpu_counters(h100_node(1).gpus[0])
    assert (
        len(counters) <= 32
        and counters["compute-slices"] == 7
        and sum(1 for k in counters if k.startswith("memory-slice-")) == 8
    )
    for d in rendered:
        assert "uuid" not in d["attributes"] and d["attributes"]["type"] == {"string": "mig"}
        assert len(d["consumesCounters"]) == 1 and set(d["consumesCounters"][0]["counters"]) <= set(counters)
        assert len(d["attributes"]) + len(d["capacity"]) <= 32 and "allowMultipleAllocations" not in d


def test_the_counters_allow_exactly_the_pairs_nvml_allows():
    """Every pair of placements: both fit the counters iff the simulated NVML creates both."""
    node = h100_node(1)
    devices = devices_of(node)
    rendered = {d.name: d.to_api("gpu-share.example.com", node) for d in devices}
    checked = 0
    for a, b in itertools.combinations(devices, 2):
        mig = SimulatedMig("GPU-h100-0", H100[0], H100[1], enabled=True)
        try:
            for d in (a, b):
                assert d.partition is not None
                mig.create_gpu_instance(d.partition.profile.id, d.partition.start)
            made = True
        except MigError:
            made = False
        assert fits(rendered[a.name], rendered[b.name]) == made, (a.name, b.name)
        checked += 1
    assert checked == 25 * 24 // 2


@pytest.mark.parametrize(
    "mix",
    [
        ["3g-40gb-4", "4g-40gb-0"],
        ["4g-40gb-0", "2g-20gb-4", "1g-10gb-6"],
        [f"1g-10gb-{i}" for i in range(7)],
        ["7g-80gb-0"],
        [
            "3g-40gb-0",
            "2g-20gb-4",
            "1g-20gb-6",
        ],  # 6 compute slices: a 1g could fit, but no memory slice is left for one
    ],
)
def test_full_layouts_fit_and_nothing_more_does(mix):
    node = h100_node(1)
    rendered = {d.name: d.to_api("gpu-share.example.com", node) for d in devices_of(node)}
    chosen = [rendered[f"gpu-0-mig-{m}"] for m in mix]
    assert fits(*chosen)
    assert not any(fits(*chosen, other) for other in rendered.values() if other not in chosen)


def test_eight_gpus_are_one_counter_slice_then_device_slices_of_64():
    node = h100_node(8, mig_off=(7,))
    devices = devices_of(node)
    assert [d.name for d in devices if d.unit.gpu.index == 7] == ["gpu-7"]  # MIG mode off: the GPU whole, as today
    gpus = list({d.unit.gpu.uuid: d.unit.gpu for d in devices if d.partition}.values())
    pool = Pool(
        "node-a",
        "gpu-share.example.com",
        owner_reference("node-a", "uid"),
        [d.to_api("gpu-share.example.com", node) for d in devices],
        counter_sets(gpus),
    )
    specs = list(pool.specs(1).values())
    assert "devices" not in specs[0] and len(specs[0]["sharedCounters"]) == 7
    assert [len(s["devices"]) for s in specs[1:]] == [64, 64, 48]  # 7 x 25 + 1 devices
    assert all("sharedCounters" not in s for s in specs[1:]) and {s["pool"]["resourceSliceCount"] for s in specs} == {4}
    named = {c["name"] for c in specs[0]["sharedCounters"]}
    assert {c["counterSet"] for s in specs[1:] for d in s["devices"] for c in d.get("consumesCounters", [])} == named


def test_nine_gpus_need_two_counter_slices():
    node = h100_node(9)
    pool = Pool("n", "d.example.com", owner_reference("n", "u"), [], counter_sets(node.gpus))
    specs = list(pool.specs(1).values())
    assert [len(s["sharedCounters"]) for s in specs] == [8, 1]  # no empty device slice beside the counters


def test_an_instance_kept_without_a_claim_is_published_as_taken():
    node = h100_node(1)
    gpu = node.gpus[0]
    three = next(p for p in gpu.mig_profiles if p.name == "3g.40gb")
    (kept,) = counter_sets(node.gpus, {gpu.uuid: [(three.id, 4)]})
    counters = {k: int(v["value"]) for k, v in kept["counters"].items()}
    assert [counters[f"memory-slice-{i}"] for i in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0] and counters[
        "compute-slices"
    ] == 4
    rendered = {d.name: d.to_api("gpu-share.example.com", node) for d in devices_of(node)}
    allowed = {name for name, d in rendered.items() if fits(d, sets=[kept])}
    assert (
        "gpu-0-mig-4g-40gb-0" in allowed
        and not {"gpu-0-mig-3g-40gb-4", "gpu-0-mig-7g-80gb-0", "gpu-0-mig-1g-10gb-5"} & allowed
    )

"""dra.shapes.HeldShapes: a reload never changes the shares, memory per share or mode of a GPU a prepared claim holds;
the kubelet plugin and the slice publisher get its old devices until the claim is unprepared, then it switches."""

from __future__ import annotations

from pathlib import Path

import pytest

from deviceplugin.config.parse import parse_config
from deviceplugin.config.types import Config
from deviceplugin.dra.devices import ClaimError, dra_devices
from deviceplugin.dra.shapes import HeldShapes
from deviceplugin.model.devices import Resource
from deviceplugin.state import NodeState
from tests.support.dra import claim, make_driver, node, resources_of, result

SHARED = {"name": "s", "mode": "shared", "replicas": 4}


class Published:
    """Records what a consumer (the slice publisher) is handed."""

    def __init__(self) -> None:
        self.resources: list[Resource] = []

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        self.resources = resources

    def shares(self) -> dict[str, int]:
        return {d.name: d.shares for d in dra_devices(self.resources)}


def _config(replicas: int) -> tuple[Config, list[Resource]]:
    config = parse_config({"version": "v1", "pools": [{**SHARED, "replicas": replicas}]})
    return config, resources_of(config, node("2xT4"))


def test_a_held_gpu_keeps_its_shape_across_a_reload_and_switches_once_its_claim_is_unprepared(tmp_path: Path) -> None:
    state = NodeState()
    driver = make_driver(tmp_path, pools=[SHARED], state=state)
    slices = Published()

    class Plugin:
        def on_config(self, config: Config, resources: list[Resource]) -> None:
            driver.on_config(config, resources)

    shapes = HeldShapes(driver, state, [Plugin(), slices], *_config(4))
    ref, body = claim([result("gpu-0", shares=2)])
    driver.prepare(ref, body)
    shapes.on_config(*_config(8))  # the reload: 2 of 4 held on GPU 0
    assert slices.shares() == {"gpu-0": 4, "gpu-1": 8}  # GPU 0 keeps publishing 4 shares of 3,840 MiB
    assert {d.name: d.shares for d in driver.devices} == {"gpu-0": 4, "gpu-1": 8}
    gpu0 = driver.devices[0].unit.gpu.uuid
    assert list(state.snapshot().pending_gpus) == [gpu0] and {h.device for h in state.snapshot().holds["dra"]} == {gpu0}
    with pytest.raises(
        ClaimError, match=r"device gpu-0 is Unhealthy: GPU 0 .* is held by 1 holder\(s\) \(claim default/c\)"
    ):  # no new work
        driver.prepare(*claim([result("gpu-0", shares=1)]))
    assert driver.prepare(*claim([result("gpu-1", shares=8)])).devices[0].memory_mib == 15360
    driver.unprepare(ref)
    shapes.check()
    assert slices.shares() == {"gpu-0": 8, "gpu-1": 8} and state.snapshot().pending_gpus == {}
    assert driver.prepare(*claim([result("gpu-0", shares=6)])).devices[0].memory_mib == 6 * 15360 // 8


def test_a_reload_that_keeps_a_held_gpus_shape_applies_at_once(tmp_path: Path) -> None:
    state = NodeState()
    driver = make_driver(tmp_path, pools=[SHARED], state=state)
    slices = Published()
    shapes = HeldShapes(driver, state, [slices], *_config(4))
    driver.prepare(*claim([result("gpu-0", shares=2)]))
    config = parse_config({"version": "v1", "pools": [{**SHARED, "gpus": {"indexes": [0]}}]})
    shapes.on_config(config, resources_of(config, node("2xT4")))
    assert slices.shares() == {"gpu-0": 4} and shapes.guard.pending == {}


def test_a_damaged_claim_record_holds_every_gpu_in_its_shape(tmp_path: Path) -> None:
    """A record that fails to read is unknown, never empty: no GPU changes shape until it is released."""
    prepared = make_driver(tmp_path, pools=[SHARED]).prepare(*claim([result("gpu-1", shares=1)]))
    record = next(p for p in (tmp_path / "claims").iterdir() if prepared.uid in p.name)
    record.write_bytes(record.read_bytes()[:-7] + b"garbage")
    state = NodeState()
    driver = make_driver(tmp_path, pools=[SHARED], state=state)  # a restart: the record fails its check
    assert driver.checkpoint.damaged and driver.prepared() == []
    slices = Published()
    shapes = HeldShapes(driver, state, [slices], *_config(4))
    shapes.on_config(*_config(8))
    assert slices.shares() == {"gpu-0": 4, "gpu-1": 4} and len(shapes.guard.pending) == 2

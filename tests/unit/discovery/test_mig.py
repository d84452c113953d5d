"""MIG instance management through both backends: real NVML's code over the fake pynvml, and the simulated node.

Both answer from discovery.migsim, so each test runs on each backend: the calls, the placement tables per model and
NVML's error codes must be the same through either.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pynvml as real
import pytest

from deviceplugin.discovery import mig as codes
from deviceplugin.discovery.mig import MigControl, MigError
from deviceplugin.discovery.nvml import NvmlInventory
from deviceplugin.discovery.simulated import SimulatedInventory
from deviceplugin.model.node import Gpu, NodeInfo
from tests.support.fake_pynvml import FakeGpu, FakeNvml

MODELS = {  # GPU name, memory MiB, the profile names NVML lists
    "A100-40GB": (
        "NVIDIA A100-SXM4-40GB",
        40960,
        ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
    ),
    "A100-80GB": (
        "NVIDIA A100-SXM4-80GB",
        81920,
        ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    ),
    "H100-80GB": (
        "NVIDIA H100 80GB HBM3",
        81559,
        ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    ),
    "H200-141GB": (
        "NVIDIA H200",
        143771,
        ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
    ),
    "B200-180GB": (
        "NVIDIA B200",
        183359,
        ["1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"],
    ),
}
# The MIG user guide's placements (start memory slices) by compute slices and memory slices: the same on every model.
PLACEMENTS = {
    (1, 1): (0, 1, 2, 3, 4, 5, 6),
    (1, 2): (0, 2, 4, 6),
    (2, 2): (0, 2, 4),
    (3, 4): (0, 4),
    (4, 4): (0,),
    (7, 8): (0,),
}
UUID = "GPU-0c1e9d27-55a0-4b1f-9e3d-000000000000"


class Backend:
    """One backend over one GPU, with a way to put a process on a MIG device."""

    def __init__(self, kind: str, name: str, memory: int, enabled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kind = kind
        if kind == "nvml":
            self.fake = FakeNvml(
                [
                    FakeGpu(
                        uuid=UUID,
                        name=name,
                        memory_mib=memory,
                        bus_id="00000000:18:00.0",
                        capability=(9, 0),
                        mig={},
                        mig_mode=enabled,
                    )
                ]
            )
            monkeypatch.setitem(sys.modules, "pynvml", self.fake)
            self.control: MigControl = NvmlInventory(sysfs_root="/nonexistent")
        else:
            gpu = Gpu(index=0, uuid=UUID, model=name, memory_mib=memory, mig_enabled=enabled, mig_capable=True)
            self.simulated = SimulatedInventory(NodeInfo(gpus=(gpu,)))
            self.control = self.simulated

    def run_process(self, mig_uuid: str, gi: int, ci: int) -> None:
        if self.kind == "nvml":
            self.fake.gpus[0].processes.append((4242, 1 << 20, gi, ci))
        else:
            self.simulated.add_process(4242, UUID, 1, mig_uuid=mig_uuid)

    def stop_process(self) -> None:
        if self.kind == "nvml":
            self.fake.gpus[0].processes.clear()
        else:
            self.simulated.remove_process(4242)


@pytest.fixture(params=["nvml", "simulated"])
def backend(request, monkeypatch):
    made = []

    def make(model: str = "H100-80GB", enabled: bool = True) -> Backend:
        name, memory, _ = MODELS[model]
        b = Backend(request.param, name, memory, enabled, monkeypatch)
        made.append(b)
        return b

    yield make
    for b in made:
        b.control.close()  # type: ignore[attr-defined]


def test_codes_are_nvmls():
    assert (
        codes.INVALID_ARGUMENT,
        codes.NOT_SUPPORTED,
        codes.NOT_FOUND,
        codes.GPU_IS_LOST,
        codes.IN_USE,
        codes.INSUFFICIENT_RESOURCES,
    ) == (
        real.NVML_ERROR_INVALID_ARGUMENT,
        real.NVML_ERROR_NOT_SUPPORTED,
        real.NVML_ERROR_NOT_FOUND,
        real.NVML_ERROR_GPU_IS_LOST,
        real.NVML_ERROR_IN_USE,
        real.NVML_ERROR_INSUFFICIENT_RESOURCES,
    )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_profiles_and_placements_per_model(backend, model):
    profiles = backend(model).control.mig_profiles(UUID)
    assert sorted(p.name for p in profiles) == sorted(MODELS[model][2])  # in NVML's enum order, not this one
    for p in profiles:
        assert p.placements == PLACEMENTS[(p.compute_slices, p.memory_slices)], p.name
    whole = max(profiles, key=lambda p: p.memory_slices)
    assert (whole.compute_slices, whole.memory_slices) == (7, 8)
    assert all(p.memory_mib * 8 <= whole.memory_mib * p.memory_slices for p in profiles)  # memory follows the slices
    media = [p for p in profiles if p.name.endswith("+me")]
    assert len(media) == 1 and media[0].ofa_engines == whole.ofa_engines == 1 and media[0].instance_count == 1


def test_create_list_destroy(backend):
    b = backend()
    by_name = {p.name: p for p in b.control.mig_profiles(UUID)}
    gi = b.control.create_gpu_instance(UUID, by_name["3g.40gb"].id, 4)
    assert [(i.gi_id, i.start, i.size, i.ci_id) for i in b.control.mig_instances(UUID)] == [(gi, 4, 4, None)]
    made = b.control.create_compute_instance(UUID, gi)
    assert made.uuid.startswith("MIG-") and made.ci_id is not None
    assert b.control.mig_instances(UUID) == (made,)
    b.control.destroy_compute_instance(UUID, gi, made.ci_id)
    b.control.destroy_gpu_instance(UUID, gi)
    assert b.control.mig_instances(UUID) == ()
    with pytest.raises(MigError) as gone:
        b.control.destroy_gpu_instance(UUID, gi)
    assert gone.value.code == codes.NOT_FOUND


def test_a_taken_placement_is_insufficient_resources(backend):
    b = backend()
    by_name = {p.name: p for p in b.control.mig_profiles(UUID)}
    b.control.create_gpu_instance(UUID, by_name["2g.20gb"].id, 2)
    for name, start in (("1g.10gb", 3), ("3g.40gb", 0), ("7g.80gb", 0), ("2g.20gb", 2)):
        with pytest.raises(MigError) as taken:
            b.control.create_gpu_instance(UUID, by_name[name].id, start)
        assert taken.value.code == codes.INSUFFICIENT_RESOURCES, name
    assert b.control.create_gpu_instance(UUID, by_name["3g.40gb"].id, 4)  # the other half is free
    me = by_name["1g.10gb+me"].id
    b.control.create_gpu_instance(UUID, me, 0)
    with pytest.raises(MigError) as second:  # one media-extension instance per GPU
        b.control.create_gpu_instance(UUID, me, 1)
    assert second.value.code == codes.INSUFFICIENT_RESOURCES


def test_a_start_the_profile_may_not_take_is_invalid(backend):
    b = backend()
    two = next(p for p in b.control.mig_profiles(UUID) if p.name == "2g.20gb")
    with pytest.raises(MigError) as bad:
        b.control.create_gpu_instance(UUID, two.id, 1)
    assert bad.value.code == codes.INVALID_ARGUMENT


def test_destroying_what_is_used_is_in_use(backend):
    b = backend()
    one = next(p for p in b.control.mig_profiles(UUID) if p.name == "1g.10gb")
    gi = b.control.create_gpu_instance(UUID, one.id, 0)
    made = b.control.create_compute_instance(UUID, gi)
    with pytest.raises(MigError) as with_ci:
        b.control.destroy_gpu_instance(UUID, gi)
    assert with_ci.value.code == codes.IN_USE
    b.run_process(made.uuid, gi, made.ci_id)
    with pytest.raises(MigError) as with_process:
        b.control.destroy_compute_instance(UUID, gi, made.ci_id)
    assert with_process.value.code == codes.IN_USE
    b.stop_process()
    b.control.destroy_compute_instance(UUID, gi, made.ci_id)
    b.control.destroy_gpu_instance(UUID, gi)
    assert b.control.mig_instances(UUID) == ()


def test_mig_mode_off_is_not_supported(backend):
    b = backend(enabled=False)
    for call, args in (("mig_profiles", ()), ("create_gpu_instance", (0, 0)), ("mig_instances", ())):
        with pytest.raises(MigError) as off:
            getattr(b.control, call)(UUID, *args)
        assert off.value.code == codes.NOT_SUPPORTED, call


def test_discovery_reads_the_profiles_while_mig_is_on(backend):
    on = backend().control.discover()  # type: ignore[attr-defined]
    assert "7g.80gb" in [p.name for p in on.gpus[0].mig_profiles]
    off = backend(enabled=False).control.discover()  # type: ignore[attr-defined]
    assert off.gpus[0].mig_profiles == () and off.gpus[0].mig_capable


def test_processes_in_an_instance_made_after_discovery_are_attributed_to_it(backend):
    b = backend()
    b.control.discover()  # type: ignore[attr-defined]
    one = next(p for p in b.control.mig_profiles(UUID) if p.name == "1g.10gb")
    made = b.control.create_compute_instance(UUID, b.control.create_gpu_instance(UUID, one.id, 2))
    b.run_process(made.uuid, made.gi_id, made.ci_id)
    assert [p.mig_uuid for p in b.control.processes(UUID)] == [made.uuid]  # type: ignore[attr-defined]


def test_a_node_files_instances_are_placed_where_they_all_fit():
    """GPU 1 of 8xA100-80GB-mig: 3g.40gb, 2g.20gb and two 1g.10gb fit only with the 3g at slices 4-7."""
    inventory = SimulatedInventory.from_file(
        Path(__file__).resolve().parents[3] / "examples" / "nodes" / "8xA100-80GB-mig.yaml"
    )
    for gpu in inventory.discover().gpus:
        placed = inventory.mig_instances(gpu.uuid) if gpu.mig_enabled else ()
        assert len(placed) == len(gpu.mig_devices) and {i.uuid for i in placed} == {m.uuid for m in gpu.mig_devices}, (
            gpu.index
        )
    layout = {i.size: i.start for i in inventory.mig_instances(inventory.discover().gpus[1].uuid) if i.size == 4}
    assert layout == {4: 4}

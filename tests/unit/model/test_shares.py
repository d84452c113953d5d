"""The share math: what k shares of a unit are given in memory and compute, and what part of a GPU they are."""

from __future__ import annotations

import pytest

from deviceplugin.model.devices import Unit
from deviceplugin.model.node import Gpu, MigDevice
from deviceplugin.model.shares import share_compute_percent, share_gpu_fraction, share_memory_mib

H100 = Gpu(index=0, uuid="GPU-0", model="H100", memory_mib=81559)
A100 = Gpu(index=1, uuid="GPU-1", model="A100", memory_mib=81920)
MIG_3G = MigDevice(uuid="MIG-3g", profile="3g.40gb", memory_mib=40192, gi_id=1, ci_id=0, index=0)


@pytest.mark.parametrize(
    "unit, shares, memory, compute, fraction",
    [
        (Unit("GPU-0", H100, 81559), 1, 81559, 100, 1.0),  # a whole device is one replica
        (Unit("GPU-0", H100, 81559, replicas=3), 1, 27186, 33, 1 / 3),  # rounded down
        (Unit("GPU-0", H100, 81559, replicas=3), 2, 54372, 66, 2 / 3),
        (Unit("GPU-0", H100, 81559, replicas=4), 4, 81559, 100, 1.0),  # every share: all of it
        (Unit("GPU-0", H100, 81559, replicas=7), 1, 11651, 14, 1 / 7),
        (Unit("GPU-0", H100, 81559, replicas=48), 1, 1699, 2, 1 / 48),  # the MPS client limit keeps 1 % or more
        (Unit("GPU-0", H100, 15360, replicas=1024), 1, 15, 0, 1 / 1024),  # time slicing's most: under 1 %
        (Unit("MIG-3g", A100, 40192, mig=MIG_3G, replicas=4), 2, 20096, 50, 0.5 * 40192 / 81920),  # its part of the GPU
        (Unit("MIG-3g", A100, 40192, mig=MIG_3G), 1, 40192, 100, 40192 / 81920),
    ],
)
def test_share_math(unit, shares, memory, compute, fraction):
    assert share_memory_mib(unit, shares) == memory
    assert share_compute_percent(unit, shares) == compute
    assert share_gpu_fraction(unit, shares) == pytest.approx(fraction, rel=1e-12)


@pytest.mark.parametrize("replicas", [1, 2, 3, 7, 10, 48, 1024])
def test_one_share_is_the_default_and_k_shares_never_exceed_the_unit(replicas):
    unit = Unit("GPU-0", H100, 81559, replicas=replicas)
    assert share_memory_mib(unit) == share_memory_mib(unit, 1) == 81559 // replicas
    assert share_compute_percent(unit) == 100 // replicas
    assert [share_memory_mib(unit, k) for k in range(replicas + 1)] == sorted(
        share_memory_mib(unit, k) for k in range(replicas + 1)
    )
    assert share_memory_mib(unit, replicas) == 81559 and share_compute_percent(unit, replicas) == 100

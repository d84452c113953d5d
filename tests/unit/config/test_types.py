"""The config's types: which settings a resource carries (and so restart its server on reload), GPU selectors, share
limits."""

from __future__ import annotations

import dataclasses

import pytest

from deviceplugin.config.types import (
    BACKENDS,
    DEFAULT_RESOURCE,
    MODES,
    AllocationSettings,
    Config,
    GpuSelector,
    max_replicas,
    one_of,
)
from deviceplugin.model.node import Gpu

ALLOCATION_FIELDS = [f.name for f in dataclasses.fields(AllocationSettings)]
CHANGED = {
    "allocation_policy": "spread",
    "device_list_strategy": "cdi",
    "cdi_kind": "example.com/gpu",
    "device_specs": True,
    "device_root": "/host",
    "mps_root": "/var/mps",
    "shared_product_suffix": True,
    "watchdog_policy": "kill",
    "quarantine": True,
    "default_profile": "other",
    "source": "elsewhere.yaml",
}


@pytest.mark.parametrize("name, value", sorted(CHANGED.items()))
def test_allocation_settings_are_exactly_what_decides_allocate(name, value):
    config = Config()
    changed = dataclasses.replace(config, **{name: value})
    assert (changed.allocation_settings() != config.allocation_settings()) == (name in ALLOCATION_FIELDS)
    if name in ALLOCATION_FIELDS:
        assert getattr(changed.allocation_settings(), name) == value


def test_every_allocation_setting_is_a_config_field():
    assert (
        set(ALLOCATION_FIELDS) <= {f.name for f in dataclasses.fields(Config)}
        and set(ALLOCATION_FIELDS) <= CHANGED.keys()
    )


T4 = Gpu(index=1, uuid="GPU-aaa", model="Tesla T4", memory_mib=15360)


@pytest.mark.parametrize(
    "selector, matches, rest",
    [
        (GpuSelector(), False, True),  # selects the GPUs no other pool selects
        (GpuSelector(indexes=(1,)), True, False),
        (GpuSelector(indexes=(0, 2)), False, False),
        (GpuSelector(uuids=("GPU-aaa",)), True, False),
        (GpuSelector(models=("*t4*",)), True, False),  # globs, case-insensitive
        (GpuSelector(models=("TESLA T4",)), True, False),
        (GpuSelector(models=("A100*",)), False, False),
        (GpuSelector(indexes=(0,), models=("*T4",)), True, False),  # any of them
    ],
)
def test_gpu_selectors(selector, matches, rest):
    assert (selector.matches(T4), selector.selects_rest) == (matches, rest)


@pytest.mark.parametrize("backend, most", [("mps", 48), ("timeSlicing", 1024)])
def test_most_shares_per_unit(backend, most):
    assert max_replicas(backend) == most


@pytest.mark.parametrize(
    "value, allowed, default, expected",
    [
        ("mps", BACKENDS, "timeSlicing", "mps"),
        ("MPS", BACKENDS, "timeSlicing", "timeSlicing"),  # choices are case-sensitive, as the file's keys are
        (None, MODES, "shared", "shared"),
        (3, MODES, "shared", "shared"),
        ("mig", MODES, "shared", "mig"),
    ],
)
def test_one_of_gives_the_typed_choice_or_the_default(value, allowed, default, expected):
    assert one_of(value, allowed, default) == expected


def test_the_choice_tuples_are_their_literal_types():
    """parse.py checks against the tuples, mypy against the Literal types: they are one list."""
    assert MODES == ("exclusive", "shared", "mig") and BACKENDS == ("timeSlicing", "mps")
    assert set(DEFAULT_RESOURCE) == set(MODES)

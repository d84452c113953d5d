"""The share math, in one place: what k shares of a unit are worth in memory, compute and GPUs.

A unit of N replicas is split evenly: k shares get k/N of its memory (MiB, rounded down) and of its compute
(percent of the unit's GPU, rounded down). A whole device is a unit of one replica.
"""

from __future__ import annotations

from .devices import Unit


def share_memory_mib(unit: Unit, shares: int = 1) -> int:
    """The memory `shares` shares of `unit` are given (one share when not said)."""
    return unit.memory_mib * shares // unit.replicas


def share_compute_percent(unit: Unit, shares: int = 1) -> int:
    """The percent of the unit's compute `shares` shares of it are given: 100 for a whole unit."""
    return 100 * shares // unit.replicas


def share_gpu_fraction(unit: Unit, shares: int) -> float:
    """How much of a physical GPU `shares` shares of `unit` are: a MIG instance counts as its part of the GPU's
    memory."""
    of_gpu = unit.memory_mib / unit.gpu.memory_mib if unit.mig else 1.0
    return shares / unit.replicas * of_gpu

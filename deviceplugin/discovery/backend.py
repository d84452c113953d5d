"""Choosing the discovery backend: the simulated node from a file, else real NVML."""

from __future__ import annotations

from .inventory import Inventory
from .simulated import SimulatedInventory


def open_inventory(node_file: str | None) -> Inventory:
    """The simulated node when a file is given, else real NVML (InventoryError when it cannot load)."""
    if node_file:
        return SimulatedInventory.from_file(node_file)
    from .nvml import NvmlInventory

    return NvmlInventory()

"""A simulated GPU node built from a node description file (YAML).

File format::

    name: 2xT4                     # optional, for logs
    driverVersion: "550.54.15"     # optional
    cudaDriverVersion: "12.4"      # optional
    gpus:
      - index: 0
        uuid: GPU-6a3c...          # must start with GPU-
        model: Tesla T4
        memoryMiB: 15360
        numaNode: 0                # optional
        pciBusId: "0000:3b:00.0"   # optional
        computeCapability: "7.5"   # optional
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .inventory import Gpu, InventoryError, NodeInfo
from .schema import SchemaError, Fields

_GPU_KEYS = {
    "index": int,
    "uuid": str,
    "model": str,
    "memoryMiB": int,
    "numaNode": int,
    "pciBusId": str,
    "computeCapability": str,
}
_REQUIRED_GPU_KEYS = ("index", "uuid", "model", "memoryMiB")


def parse_node(data: Any, source: str = "node file") -> NodeInfo:
    """Validate a node description; errors name the key and the reason."""
    try:
        top = Fields(data, "", {"name": str, "driverVersion": str, "cudaDriverVersion": str, "gpus": list})
        gpus = [_parse_gpu(item, f"gpus[{i}]") for i, item in enumerate(top.get("gpus", [], required=True))]
    except SchemaError as err:
        raise InventoryError(f"{source}: {err}") from None
    _check_unique(gpus, source)
    return NodeInfo(
        gpus=tuple(sorted(gpus, key=lambda g: g.index)),
        driver_version=top.get("driverVersion", ""),
        cuda_driver_version=top.get("cudaDriverVersion", ""),
        extra={"name": top.get("name", Path(source).stem)},
    )


def _parse_gpu(item: Any, path: str) -> Gpu:
    fields = Fields(item, path, _GPU_KEYS)
    values = {key: fields.get(key, required=True) for key in _REQUIRED_GPU_KEYS}
    fields.check(values["index"] >= 0, "index", f"must be >= 0, got {values['index']}")
    fields.check(values["uuid"].startswith(("GPU-", "MIG-")), "uuid", f"must start with 'GPU-', got {values['uuid']!r}")
    fields.check(values["memoryMiB"] > 0, "memoryMiB", f"must be > 0, got {values['memoryMiB']}")
    numa = fields.get("numaNode", None)
    return Gpu(
        index=values["index"],
        uuid=values["uuid"],
        model=values["model"],
        memory_mib=values["memoryMiB"],
        numa_node=numa if numa is not None and numa >= 0 else None,
        pci_bus_id=fields.get("pciBusId", ""),
        compute_capability=fields.get("computeCapability", ""),
    )


def _check_unique(gpus: list[Gpu], source: str) -> None:
    for attr in ("index", "uuid"):
        seen: set[object] = set()
        for i, gpu in enumerate(gpus):
            value = getattr(gpu, attr)
            if value in seen:
                raise InventoryError(f"{source}: gpus[{i}].{attr}: duplicate value {value!r}")
            seen.add(value)


class SimulatedInventory:
    """Inventory backend over a node description file."""

    def __init__(self, node: NodeInfo) -> None:
        self._node = node

    @classmethod
    def from_file(cls, path: str | Path) -> "SimulatedInventory":
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as err:
            raise InventoryError(f"cannot read node file {path}: {err.strerror}") from None
        except yaml.YAMLError as err:
            raise InventoryError(f"node file {path} is not valid YAML: {err}") from None
        return cls(parse_node(data, str(path)))

    def discover(self) -> NodeInfo:
        return self._node

    def close(self) -> None:
        pass

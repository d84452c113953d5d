"""`gpu-share discover`: what the node has, as a table or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..model.devices import HEALTHY
from ..model.node import Gpu, NodeInfo
from .inventory import Inventory


def node_report(node: NodeInfo, inventory: Inventory) -> dict:
    """Everything `discover --json` prints, in the node file format (so `--node` accepts it), with current health."""
    index = {gpu.uuid: gpu.index for gpu in node.gpus}
    return {
        "name": node.name,
        "driverVersion": node.driver_version,
        "cudaDriverVersion": node.cuda_driver_version,
        "gpus": [_gpu_entry(gpu, inventory.check(gpu.uuid) or HEALTHY) for gpu in node.gpus],
        "links": [
            {"gpus": [index[a], index[b]], "nvlinks": link.nvlinks, "pcie": link.pcie}
            for (a, b), link in node.links.items()
        ],
    }


def _gpu_entry(gpu: Gpu, health: str) -> dict:
    entry: dict = {"index": gpu.index, "uuid": gpu.uuid, "model": gpu.model, "memoryMiB": gpu.memory_mib}
    optional = {
        "numaNode": gpu.numa_node,
        "pciBusId": gpu.pci_bus_id,
        "computeCapability": gpu.compute_capability,
        "minorNumber": gpu.minor_number,
    }
    entry.update({key: value for key, value in optional.items() if value not in (None, "")})
    if gpu.mig_enabled:
        entry["mig"] = [
            {"uuid": m.uuid, "profile": m.profile, "memoryMiB": m.memory_mib, "giId": m.gi_id, "ciId": m.ci_id}
            for m in gpu.mig_devices
        ]
    entry["migCapable"] = gpu.mig_capable
    entry["health"] = health
    return entry


def render_json(node: NodeInfo, inventory: Inventory) -> str:
    return json.dumps(node_report(node, inventory), indent=2)


def render_table(node: NodeInfo, inventory: Inventory) -> str:
    lines = [
        f"Node {node.name or '?'}: {len(node.gpus)} GPUs, driver {node.driver_version or '?'}, "
        f"CUDA {node.cuda_driver_version or '?'}",
        "",
    ]
    rows = [("IDX", "UUID", "MODEL", "MEMORY", "MIG", "NUMA", "PCI", "HEALTH")]
    for gpu in node.gpus:
        health = inventory.check(gpu.uuid) or HEALTHY
        numa = "-" if gpu.numa_node is None else str(gpu.numa_node)
        mig = "enabled" if gpu.mig_enabled else "-"
        rows.append(
            (str(gpu.index), gpu.uuid, gpu.model, f"{gpu.memory_mib} MiB", mig, numa, gpu.pci_bus_id or "-", health)
        )
        for mig_device in gpu.mig_devices:
            rows.append(
                (
                    f"{gpu.index}/{mig_device.index}",
                    mig_device.uuid,
                    f"  MIG gi={mig_device.gi_id} ci={mig_device.ci_id}",
                    f"{mig_device.memory_mib} MiB",
                    mig_device.profile,
                    numa,
                    "",
                    "",
                )
            )
    lines += _table(rows)
    if len(node.gpus) > 1:
        lines += ["", "Links (NVn = n NVLinks, else the PCIe common ancestor):"]
        header = ("", *(f"GPU{g.index}" for g in node.gpus))
        matrix = [header] + [
            (f"GPU{a.index}", *("X" if a is b else node.link(a, b).describe() for b in node.gpus)) for a in node.gpus
        ]
        lines += _table(matrix)
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]

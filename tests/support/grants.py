"""The promise, checked from what the built-in kubelet recorded: no GPU is handed out twice."""

from __future__ import annotations

from fractions import Fraction

from deviceplugin.alloc.modes import ENV_MEMORY_LIMIT, ENV_SHARE_COUNT, ENV_SHARE_TOTAL
from deviceplugin.model.node import NodeInfo
from deviceplugin.sim.kubelet import KubeletSimulator


def overcommitted(kubelet: KubeletSimulator, node: NodeInfo) -> list[str]:
    """Why the live allocations hand some GPU out twice (empty: they do not). Per GPU or MIG instance the fractions
    every container was given (k/N for k of N shares, 1 for a whole unit) add up to at most 1, and so do their
    memory limits to at most its memory; a GPU held whole has nothing on its MIG instances; no device ID is held
    twice."""
    parent = {m.uuid: g.uuid for g in node.gpus for m in g.mig_devices}
    memory = {g.uuid: g.memory_mib for g in node.gpus} | {
        m.uuid: m.memory_mib for g in node.gpus for m in g.mig_devices
    }
    given: dict[str, Fraction] = {}
    limits: dict[str, int] = {}
    holders: dict[str, list[str]] = {}
    ids: dict[str, str] = {}
    problems = []
    for uid, container, resource, devices, response in kubelet.grants():
        who = f"{uid[:8]}/{container} ({resource} {', '.join(devices)})"
        for device in devices:
            if device in ids:
                problems.append(f"device {device} held by {ids[device]} and {who}")
            ids[device] = who
        units = sorted({d.split("::")[0] for d in devices})  # the GPU or MIG UUIDs the IDs are on
        envs = response.envs
        for unit in units:
            part = (
                Fraction(int(envs[ENV_SHARE_COUNT]), int(envs[ENV_SHARE_TOTAL]))
                if ENV_SHARE_TOTAL in envs
                else Fraction(1)
            )
            given[unit] = given.get(unit, Fraction(0)) + part
            limits[unit] = limits.get(unit, 0) + (
                int(envs[ENV_MEMORY_LIMIT]) if ENV_MEMORY_LIMIT in envs else memory[unit]
            )
            holders.setdefault(unit, []).append(who)
    for unit, total in given.items():
        if total > 1 or limits[unit] > memory[unit]:
            problems.append(
                f"{unit}: {total} of it and {limits[unit]} of {memory[unit]} MiB given to {'; '.join(holders[unit])}"
            )
    for mig, gpu in parent.items():
        if mig in given and gpu in given:
            problems.append(
                f"{gpu} held whole by {'; '.join(holders[gpu])} while its MIG instance {mig} is held "
                f"by {'; '.join(holders[mig])}"
            )
    return problems

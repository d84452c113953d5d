"""The residue guard's judgement: GPU memory a finished tenant left behind, and which free devices it holds back.

Residue is reported when a process of an ended container still holds memory; it quarantines its GPU (with
`quarantine` on) only once seen in two rounds in a row — a process that started between the pod list and NVML's is
not a leftover — and never on a stale pod list. The quarantined GPU's free devices are advertised Unhealthy; those
held by active containers stay as they are.
"""

from __future__ import annotations

import logging

from ..model.devices import Resource

log = logging.getLogger(__name__)


def reportable(found: dict[str, int], previous: dict[str, int], fresh: bool) -> dict[str, int]:
    """The residue to report: all that was found on a fresh pod list; on a stale one only what was already known
    (no new residue is judged on stale usage)."""
    return dict(found) if fresh else {u: mib for u, mib in found.items() if u in previous}


def quarantined_gpus(
    residue: dict[str, int], previous_residue: dict[str, int], was: frozenset[str], enabled: bool
) -> frozenset[str]:
    """GPUs whose residue is confirmed (seen in the previous round too), when the guard quarantines; logs changes."""
    confirmed = frozenset(u for u in residue if u in previous_residue) if enabled else frozenset()
    for uuid in sorted(confirmed - was):
        log.warning(
            "GPU %s holds %d MiB of a finished tenant: its free devices are Unhealthy until released",
            uuid,
            residue[uuid],
        )
    for uuid in sorted(was - confirmed):
        log.info("GPU %s: leftover memory released, quarantine lifted", uuid)
    return confirmed


def quarantined_devices(resources: list[Resource], gpus: frozenset[str], allocated: frozenset[str]) -> frozenset[str]:
    """The free devices on quarantined GPUs."""
    return frozenset(
        d.id for r in resources for d in r.devices.values() if d.gpu.uuid in gpus and d.id not in allocated
    )

"""Who holds what in DRA mode, as the node agent's usage map (model.usage): the driver's checkpoint of prepared
claims says what each claim holds (devices, shares, memory), the kubelet's pod-resources `List` says which
containers use which claim (`ContainerResources.dynamic_resources`, by claim namespace and name).

A claim is counted only where both agree: a claim prepared here that no active container reports (prepared before
its pod starts, or left by an ended one) holds nothing in the map, and a claim pod-resources reports that this
driver did not prepare (another driver's, or unprepared since) is ignored, as are devices of other drivers or pools.
Each container of a claim gets the claim's shares (containers sharing a claim share its devices); the meter counts
them once per pod (agent.loop). A prepared device that the current config no longer yields (a reload since) has
no unit to map onto and is left out until its claim is unprepared.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from ..agent.usage import container_share
from ..alloc.modes import TIME_SLICED
from ..api import podresources_pb2 as pr
from ..model.devices import Resource
from ..model.usage import ContainerShare, Usage
from .checkpoint import PreparedClaim, PreparedDevice
from .devices import DraDevice
from .migdynamic import instance_device

log = logging.getLogger(__name__)

MAX_SHARES = 65_536  # container shares in one map; pod-resources lists far fewer on any node


def claim_usage(
    response: pr.ListPodResourcesResponse,
    prepared: Iterable[PreparedClaim],
    devices: Mapping[str, DraDevice],
    driver: str,
    pool: str,
) -> Usage:
    """The usage map of one pod-resources List against the prepared claims; `devices` are the driver's, by name."""
    records: dict[tuple[str, str], list[PreparedClaim]] = {}
    for claim in prepared:
        records.setdefault((claim.namespace, claim.name), []).append(claim)
    # (container, unit UUID) -> what the container holds on it, each prepared device once: a container or pod listed
    # twice, or one claim reported under two names, merges into one record
    held: dict[tuple[tuple[str, str, str], str], dict[str, tuple[PreparedDevice, DraDevice]]] = {}
    active = set()
    for pod in response.pod_resources:
        for container in pod.containers:
            key = (pod.namespace, pod.name, container.name)
            active.add(key)
            for dynamic in container.dynamic_resources:
                for claim, device in _reported(
                    records.get((dynamic.claim_namespace, dynamic.claim_name), []), dynamic, driver, pool
                ):
                    known = devices.get(device.device)
                    if known is None or device.shares <= 0:  # admin access holds no share
                        continue
                    if (
                        known.partition and device.mig and device.mig.uuid
                    ):  # dynamic MIG: the instance made for the claim
                        known = instance_device(known, device.mig)
                    if (key, known.unit.uuid) not in held and len(held) >= MAX_SHARES:
                        log.warning(
                            "pod-resources lists more than %d DRA container shares; "
                            "the rest are not watched or metered",
                            MAX_SHARES,
                        )
                        return _usage(held, active)
                    held.setdefault((key, known.unit.uuid), {}).setdefault(
                        f"{claim.uid}/{device.device}/{device.share_id or ''}", (device, known)
                    )
    return _usage(held, active)


def _usage(
    held: dict[tuple[tuple[str, str, str], str], dict[str, tuple[PreparedDevice, DraDevice]]],
    active: set[tuple[str, str, str]],
) -> Usage:
    shares: list[ContainerShare] = []
    for (key, _), items in held.items():
        first = next(iter(items.values()))[1]
        unit, resource = first.unit, first.resource
        devices = [d for d, _ in items.values()]
        shares.append(
            container_share(
                key,
                resource,
                unit,
                list(items),
                sum(d.shares for d in devices),
                sum(d.memory_mib for d in devices),
                # a SharingConfig's on an MPS pool, or shares of a dynamic MIG instance: the watchdog judges them
                time_sliced=any(d.strategy == "timeSlicing" for d in devices) or first.sharing_mode is TIME_SLICED,
            )
        )
    return Usage(shares=tuple(shares), active_containers=frozenset(active))


def _reported(
    claims: list[PreparedClaim], dynamic: pr.DynamicResource, driver: str, pool: str
) -> Iterable[tuple[PreparedClaim, PreparedDevice]]:
    """The prepared devices of the claim(s) of this name that pod-resources reports for the container, each once."""
    wanted = {
        (r.device_name, r.share_id if r.HasField("share_id") else None)
        for r in dynamic.claim_resources
        if r.driver_name == driver and r.pool_name == pool
    }
    names = {name for name, _ in wanted}
    seen: set[tuple[str, str | None]] = set()
    for (
        claim
    ) in claims:  # two records of one name: a replaced claim whose old pod still ends; share IDs tell them apart
        for device in claim.devices:
            key = (device.device, device.share_id)
            # a device held whole has no share ID; a kubelet that reports none matches on the device name
            matches = device.device in names and (
                device.share_id is None or key in wanted or (device.device, None) in wanted
            )
            if matches and key not in seen:
                seen.add(key)
                yield claim, device


class ClaimUsage:
    """The node agent's usage builder in DRA mode (agent.observe): pod-resources against the driver's checkpoint."""

    def __init__(
        self,
        prepared: Callable[[], Iterable[PreparedClaim]],
        devices: Callable[[], Iterable[DraDevice]],
        driver: str,
        pool: str,
    ) -> None:
        self.prepared = prepared
        self.devices = devices
        self.driver = driver
        self.pool = pool

    def __call__(self, response: pr.ListPodResourcesResponse, resources: list[Resource]) -> Usage:
        return claim_usage(response, self.prepared(), {d.name: d for d in self.devices()}, self.driver, self.pool)

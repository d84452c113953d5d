"""The admission policy's params: the largest shares of one unit per shared resource, from the same plan as
`config check`, so the policy refuses exactly the containers no node of the fleet could place.

The params ConfigMap (daemonset/admission/, the chart's admission.yaml) maps `domain` to the domain and each
shared resource's name after `<domain>/` to that count; its CEL reads both from there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from ..config.types import Config, ConfigError
from ..model.devices import Resource
from ..model.node import NodeInfo
from .modes import mode_of
from .plan import build_resources

PARAMS_NAME = "gpu-share-admission-limits"


def admission_limits(resources: Iterable[Resource]) -> dict[str, int]:
    """Per shared resource whose container shares come from one unit (not `allowSpanGPUs`), the largest shares of
    one unit, keyed by the full resource name."""
    limits: dict[str, int] = {}
    for resource in resources:
        if not mode_of(resource.pool).may_span(resource.pool):
            limits[resource.name] = max(limits.get(resource.name, 0), *(u.replicas for u in resource.units))
    return limits


@dataclass(frozen=True)
class FleetLimits:
    """The params for a config over a fleet: `limits` by full resource name, and what was left out, said why."""

    domain: str
    limits: dict[str, int]
    skipped: list[str]  # resources outside the domain, profiles no node can serve, ...: one line each

    def in_domain(self) -> dict[str, int]:
        """Each resource of the domain by its name after `<domain>/`, sorted: the policy's `limits`."""
        prefix = self.domain + "/"
        return {name[len(prefix) :]: count for name, count in sorted(self.limits.items()) if name.startswith(prefix)}

    def cel(self) -> str:
        """`in_domain` as the CEL map literal of the policy's `limits` variable, e.g. {'gpu-share': 20}."""
        return "{" + ", ".join(f"'{name}': {count}" for name, count in self.in_domain().items()) + "}"


def fleet_limits(config: Config, nodes: Iterable[NodeInfo]) -> FleetLimits:
    """The largest shares of one unit per shared resource over every profile on every node.

    Without nodes, only pools with `replicas` can be counted (their count is the same on every GPU); a
    `memoryPerShare` pool's count depends on the GPU's memory, so it is an error naming the pool.
    A profile that a node cannot serve (an index it lacks, ...) counts nothing there, as `run` would not start.
    """
    nodes = list(nodes)
    limits: dict[str, int] = {}
    skipped: list[str] = []
    if not nodes:
        problems = []
        for pools in config.profiles.values():
            for pool in pools:
                if mode_of(pool).may_span(pool):
                    continue
                if pool.memory_per_share_mib is not None:
                    problems.append(
                        f"{pool.key_path}.memoryPerShare: the share count depends on the GPU's memory: give "
                        "--node FILE for each GPU model of the fleet"
                    )
                else:
                    limits[pool.resource] = max(limits.get(pool.resource, 0), pool.replicas)
        if problems:
            raise ConfigError(problems, config.source)
    for profile in sorted(config.profiles):
        served = False
        for node in nodes:
            try:
                resources = build_resources(config, node, profile)
            except ConfigError:
                continue
            served = True
            for name, count in admission_limits(resources).items():
                limits[name] = max(limits.get(name, 0), count)
        if nodes and not served:
            skipped.append(f"profile {profile}: no given node can serve it (gpu-share config check --node shows why)")
    prefix = config.domain + "/"
    skipped += [
        f"{name}: not under the domain {config.domain}, not checked"
        for name in sorted(limits)
        if not name.startswith(prefix)
    ]
    return FleetLimits(config.domain, limits, skipped)


def config_sha256(text: str) -> str:
    """The digest the chart compares (Helm's sha256sum of the config text) to see its params are for this config."""
    return hashlib.sha256(text.encode()).hexdigest()

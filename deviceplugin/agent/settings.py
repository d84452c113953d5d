"""The node agent's settings: how often it polls pod-resources, how far it backs off, whether it quarantines."""

from __future__ import annotations

from dataclasses import dataclass

from .. import defaults


@dataclass(frozen=True)
class AgentSettings:
    interval: float = defaults.POD_RESOURCES_INTERVAL
    backoff_max: float = defaults.POD_RESOURCES_BACKOFF_MAX  # longest poll interval after RESOURCE_EXHAUSTED
    quarantine: bool = False

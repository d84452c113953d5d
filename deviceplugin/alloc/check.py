"""The plan check behind `gpu-share config check` (rendered by cli/config_check.py): what one profile yields on a node,
with the warnings the plan logs on the way, as data."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..config.types import Config, ConfigError
from ..model.devices import Resource
from ..model.node import NodeInfo
from .plan import build_resources


@dataclass(frozen=True)
class ProfileCheck:
    profile: str
    resources: list[Resource]  # empty when `error`
    warnings: list[str]  # what the plan logged (a pool without GPUs, a GPU skipped)
    error: ConfigError | None


def check_profile(config: Config, node: NodeInfo, profile: str) -> ProfileCheck:
    """What `profile` yields on `node`, with the plan's warnings; a profile that yields nothing is an error."""
    with collect_warnings() as warnings:
        try:
            resources, error = profile_resources(config, node, profile), None
        except ConfigError as err:
            resources, error = [], err
    return ProfileCheck(profile, resources, list(warnings), error)


def profile_resources(config: Config, node: NodeInfo, profile: str) -> list[Resource]:
    """The resources `profile` yields on `node`; a profile that yields none is an error (the node would advertise
    nothing)."""
    resources = build_resources(config, node, profile)
    if not resources:
        raise ConfigError(
            [f"profile {profile!r} advertises no resource on node {node.name} (no pool has a usable GPU there)"],
            config.source,
        )
    return resources


@contextmanager
def collect_warnings() -> Iterator[list[str]]:
    """The plugin's warnings logged inside the block (a pool without GPUs, a GPU skipped), kept to show them to the user
    instead of as log lines."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("deviceplugin")
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]

"""`gpu-share config check`: validate a config, then show what it yields on a node.

"valid" is printed last, only when everything passed: the file, and on `--node` the profile that would
run there (or, with `--all-profiles`, every profile), each yielding at least one resource.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

from ..config.types import Config, ConfigError
from ..config.parse import load_config
from ..discovery.backend import open_inventory
from ..model.node import NodeInfo
from ..model.devices import Resource
from ..model.shares import share_memory_mib
from .plan import build_resources

Out = Callable[[str], None]


def check_config(file: str, node_file: str | None, profile: str | None, all_profiles: bool, out: Out = print) -> int:
    """0 when the config is valid (on the node, when given); ConfigError otherwise (with --all-profiles, after every profile's report)."""
    config = load_config(file)
    if profile:
        config.pools(profile)  # an unknown profile is an error even without a node
    names = sorted(config.profiles) if all_profiles or not node_file else [profile or config.default_profile]
    if not node_file:
        for name in names:
            for pool in config.pools(name):
                out(f"  {name}: {pool.path} {pool.name}: mode {pool.mode}, resource {pool.resource or '<domain>/mig-<profile>'}")
        out(f"{file}: valid; profiles {', '.join(names)} (default {config.default_profile}); give --node to check one on a node")
        return 0
    inventory = open_inventory(node_file)
    try:
        node = inventory.discover()
    finally:
        inventory.close()
    failed: list[tuple[str, ConfigError]] = []
    for name in names:
        default = " (defaultProfile)" if name == config.default_profile else ""
        out(f"Profile {name}{default} on {node.name}:")
        try:
            with collect_warnings() as warnings:
                try:
                    resources = profile_resources(config, node, name)
                finally:
                    for warning in warnings:
                        out(f"  warning: {warning}")
            _show(resources, out)
        except ConfigError as err:
            if not all_profiles:
                raise
            failed.append((name, err))
            out("  FAILED: " + "\n          ".join(err.problems))
    if failed:
        raise ConfigError([f"{len(failed)} of {len(names)} profiles fail on {node.name}: {', '.join(n for n, _ in failed)}"], file)
    out(f"{file}: valid on {node.name} ({'every profile' if all_profiles else 'profile ' + names[0]})")
    return 0


def profile_resources(config: Config, node: NodeInfo, profile: str) -> list[Resource]:
    """The resources `profile` yields on `node`; a profile that yields none is an error (the node would advertise nothing)."""
    resources = build_resources(config, node, profile)
    if not resources:
        raise ConfigError([f"profile {profile!r} advertises no resource on node {node.name} (no pool has a usable GPU there)"], config.source)
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


def _show(resources: list[Resource], out: Out) -> None:
    for resource in resources:
        backend = f", {resource.pool.backend}" if resource.pool.shared else ""
        out(f"  {resource.name} ({resource.pool.mode}{backend}): {len(resource.devices)} devices")
        for unit in resource.units:
            what = f"GPU {unit.gpu.index}" + (f" MIG {unit.mig.profile} ({unit.uuid})" if unit.mig else f" ({unit.gpu.model})")
            if resource.pool.shared:
                out(f"    {what}: {unit.replicas} shares of {share_memory_mib(unit)} MiB")
            else:
                out(f"    {what}: 1 device, {unit.memory_mib} MiB")

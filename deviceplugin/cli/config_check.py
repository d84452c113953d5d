"""`gpu-share config check`: validate a config, then show what it yields on a node.

"valid" is printed last, only when everything passed: the file, and on `--node` the profile that would
run there (or, with `--all-profiles`, every profile), each yielding at least one resource. The plan check itself
is alloc/check.py; this module reads the files and renders (parsing and discovery load only when it runs).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..config.types import ConfigError, WatchdogPolicy
from ..model.devices import Resource
from ..model.shares import share_memory_mib
from . import flags

Out = Callable[[str], None]

HELP = "validate a config and show what it yields on a node"


def add_arguments(check: argparse.ArgumentParser) -> None:
    flags.add_logging(check, level="error")  # the plugin's warnings are shown under each profile
    check.add_argument("file", help="config file")
    check.add_argument("--node", help="node description file, or `discover --json` output (default: only validate)")
    which = check.add_mutually_exclusive_group()
    which.add_argument(
        "--profile", help="profile to check on the node (default: defaultProfile, as `run --profile` would serve)"
    )
    which.add_argument(
        "--all-profiles", action="store_true", help="check every profile on the node and report each one's result"
    )
    check.add_argument(
        "--labels", action="store_true", help="with --node: also show the node labels the plugin would publish there"
    )


def run(args: argparse.Namespace) -> int:
    return check_config(args.file, args.node, args.profile, args.all_profiles, labels=args.labels)


def check_config(
    file: str, node_file: str | None, profile: str | None, all_profiles: bool, out: Out = print, labels: bool = False
) -> int:
    """0 when the config is valid (on the node, when given); ConfigError otherwise (with --all-profiles, after every
    profile's report)."""
    from ..config.parse import load_config

    config = load_config(file)
    if profile:
        config.pools(profile)  # an unknown profile is an error even without a node
    names = sorted(config.profiles) if all_profiles or not node_file else [profile or config.default_profile]
    if not node_file:
        for name in names:
            for pool in config.pools(name):
                out(
                    f"  {name}: {pool.key_path} {pool.name}: mode {pool.mode}, "
                    f"resource {pool.resource or '<domain>/mig-<profile>'}"
                )
        out(
            f"{file}: valid; profiles {', '.join(names)} (default {config.default_profile}); give --node to "
            "check one on a node"
        )
        return 0
    from ..alloc.check import check_profile
    from ..discovery.backend import open_inventory

    inventory = open_inventory(node_file)
    try:
        node = inventory.discover()
    finally:
        inventory.close()
    failed: list[str] = []
    for name in names:
        default = " (defaultProfile)" if name == config.default_profile else ""
        out(f"Profile {name}{default} on {node.name}:")
        result = check_profile(config, node, name)
        for warning in result.warnings:
            out(f"  warning: {warning}")
        if result.error is None:
            _show(result.resources, config.watchdog_policy, out)
            if labels:
                from ..kube.labels import node_labels

                published = node_labels(
                    config.domain, node, result.resources, config.shared_product_suffix, config.deprecated_cuda_labels
                )
                out(
                    f"  node labels the plugin would publish ({len(published)}; a label someone else set first "
                    "is left alone):"
                )
                for key, value in sorted(published.items()):
                    out(f"    {key}={value}")
        elif not all_profiles:
            raise result.error
        else:
            failed.append(name)
            out("  FAILED: " + "\n          ".join(result.error.problems))
    if failed:
        raise ConfigError([f"{len(failed)} of {len(names)} profiles fail on {node.name}: {', '.join(failed)}"], file)
    out(f"{file}: valid on {node.name} ({'every profile' if all_profiles else 'profile ' + names[0]})")
    return 0


def _show(resources: list[Resource], watchdog_policy: WatchdogPolicy, out: Out) -> None:
    from ..alloc.preview import container_preview

    for resource in resources:
        backend = f", {resource.pool.backend}" if resource.pool.shared else ""
        out(f"  {resource.name} ({resource.pool.mode}{backend}): {len(resource.devices)} devices")
        for unit in resource.units:
            what = f"GPU {unit.gpu.index}" + (
                f" MIG {unit.mig.profile} ({unit.uuid})" if unit.mig else f" ({unit.gpu.model})"
            )
            if resource.pool.shared:
                out(f"    {what}: {unit.replicas} shares of {share_memory_mib(unit)} MiB")
            else:
                out(f"    {what}: 1 device, {unit.memory_mib} MiB")
        preview = container_preview(resource, watchdog_policy)
        out(
            f"    a container of {preview.what} receives: memory {preview.memory_mib} MiB, "
            f"compute {preview.compute_percent} %; {preview.enforced}"
        )
        out("      env " + " ".join(f"{k}={v}" for k, v in sorted(preview.envs.items())))

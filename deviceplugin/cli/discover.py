"""`gpu-share discover`: the node's GPUs, MIG instances, topology and health, as a table or JSON."""

from __future__ import annotations

import argparse

from ..model.node import NodeInfo
from . import flags

HELP = "show the node's GPUs, MIG instances, topology and health"


def add_arguments(discover: argparse.ArgumentParser) -> None:
    flags.add_logging(discover, level="warning")
    discover.add_argument("--node", help="simulated node description file (default: real GPUs through NVML)")
    discover.add_argument(
        "--json", action="store_true", help="print JSON instead of a table (the node file format: no pools)"
    )
    discover.add_argument(
        "--config", help="config whose pools the table places each GPU in (default: `run`'s, every GPU shared in 10)"
    )
    discover.add_argument("--profile", help="the profile of --config (default: defaultProfile)")


def run(args: argparse.Namespace) -> int:
    from ..discovery.backend import open_inventory
    from ..discovery.report import render_json, render_table

    inventory = open_inventory(args.node)
    try:
        node = inventory.discover()
        if args.json:
            print(render_json(node, inventory))
            return 0
        print(render_table(node, inventory))
    finally:
        inventory.close()
    print("\n" + "\n".join(pool_lines(node, args.config, args.profile)))
    return 0


def pool_lines(node: NodeInfo, config_file: str | None, profile: str | None) -> list[str]:
    """Which pool and resource each GPU (or MIG instance) lands in under the config's profile, and the GPUs in none."""
    from ..alloc.check import collect_warnings
    from ..alloc.plan import build_resources
    from ..config.parse import load_config
    from ..config.types import default_config

    config = load_config(config_file) if config_file else default_config()
    name = profile or config.default_profile
    with collect_warnings() as warnings:
        resources = build_resources(config, node, name)
    lines = [f"Pools (profile {name} of {config_file or 'the default config: every GPU shared in 10'}):"]
    placed: set[str] = set()
    for resource in resources:
        for unit in resource.units:
            placed.add(unit.gpu.uuid)
            what = f"GPU {unit.gpu.index}" + (f" MIG {unit.mig.profile} ({unit.uuid})" if unit.mig else "")
            shares = f", {unit.replicas} shares" if resource.pool.shared else ""
            lines.append(f"  {what}: pool {resource.pool.name} ({resource.pool.mode}{shares}) -> {resource.name}")
    lines += [
        f"  GPU {g.index}: not advertised (in no pool, or skipped: see the warnings)"
        for g in node.gpus
        if g.uuid not in placed
    ]
    return lines + [f"  warning: {w}" for w in warnings]

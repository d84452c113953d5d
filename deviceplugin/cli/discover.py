"""`gpu-share discover`: the node's GPUs, MIG instances, topology and health, as a table or JSON."""

from __future__ import annotations

import argparse

from . import flags

HELP = "show the node's GPUs, MIG instances, topology and health"


def add_arguments(discover: argparse.ArgumentParser) -> None:
    flags.add_logging(discover, level="warning")
    discover.add_argument("--node", help="simulated node description file (default: real GPUs through NVML)")
    discover.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from ..discovery.backend import open_inventory
    from ..discovery.report import render_json, render_table

    inventory = open_inventory(args.node)
    try:
        node = inventory.discover()
        print(render_json(node, inventory) if args.json else render_table(node, inventory))
    finally:
        inventory.close()
    return 0

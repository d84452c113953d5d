"""`gpu-share demo`: the plugin against the built-in kubelet on a simulated node."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import flags

BUILTIN = Path(__file__).parent.parent / "builtin"

HELP = "run the plugin against the built-in kubelet on a simulated node"


def add_arguments(demo: argparse.ArgumentParser) -> None:
    flags.add_logging(demo, level="error")
    demo.add_argument("--node", help="simulated node description file (default: the built-in node, four A100 80GB)")
    demo.add_argument(
        "--config",
        help="config file (default: with --node, `run`'s default, every GPU shared in 10; "
        "without, the built-in demo config)",
    )
    demo.add_argument("--profile", help="config profile to serve (default: defaultProfile)")


def run(args: argparse.Namespace) -> int:
    from ..sim.demo import run_demo

    if args.node is None:
        return run_demo(
            str(BUILTIN / "demo-node.yaml"), args.config or str(BUILTIN / "demo-config.yaml"), profile=args.profile
        )
    return run_demo(args.node, args.config, profile=args.profile)

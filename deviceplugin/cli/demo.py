"""`gpu-share demo`: the plugin against the built-in kubelet on a simulated node."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import flags

BUILTIN = Path(__file__).parent.parent / "builtin"

HELP = "run the plugin against the built-in kubelet on a simulated node"


def add_arguments(demo: argparse.ArgumentParser) -> None:
    flags.add_logging(demo, level="error")
    demo.add_argument("--node", default=str(BUILTIN / "demo-node.yaml"), help="simulated node description file")
    demo.add_argument("--config", default=str(BUILTIN / "demo-config.yaml"), help="config file")
    demo.add_argument("--profile", help="config profile to serve (default: defaultProfile)")


def run(args: argparse.Namespace) -> int:
    from ..sim.demo import run_demo

    return run_demo(args.node, args.config, profile=args.profile)

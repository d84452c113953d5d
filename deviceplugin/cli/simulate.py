"""`gpu-share simulate`: replay a GPU-sharing trace through the cluster packing policies (cluster/report.py)."""

from __future__ import annotations

import argparse

from . import flags

HELP = "replay a GPU-sharing trace through the cluster packing policies (FGD paper's protocol)"


def add_arguments(simulate: argparse.ArgumentParser) -> None:
    from ..cluster.report import add_arguments as add_simulate_arguments

    flags.add_logging(simulate, level="warning")
    add_simulate_arguments(simulate)


def run(args: argparse.Namespace) -> int:
    from ..cluster.report import run_simulate

    return run_simulate(args)

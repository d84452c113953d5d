"""`gpu-share mps`: the MPS control daemons of the node's MPS pools, on the same plan as `run`, following config
reloads."""

from __future__ import annotations

import argparse
import logging

from .. import defaults
from ..runtime.startup import check_executable
from ..signals import catch_signals, wait_for_signal
from . import flags

log = logging.getLogger("gpu-share")

HELP = "run and supervise the MPS control daemons of the MPS pools"


def add_arguments(mps: argparse.ArgumentParser) -> None:
    flags.add_logging(mps)
    flags.add_plan(mps)
    mps.add_argument(
        "--mps-control", default=defaults.MPS_CONTROL_BINARY, help="the control binary (default %(default)s)"
    )
    mps.add_argument(
        "--pools",
        type=flags.name_list,
        default=frozenset(),
        metavar="NAMES",
        help="comma-separated MPS pools to serve (default: every MPS pool of the node's profile); one container "
        "per pool gives each daemon the pool's /dev/shm",
    )
    mps.add_argument(
        "--backoff-max",
        type=flags.positive_float,
        default=defaults.MPS_BACKOFF_MAX,
        help="longest wait before restarting a daemon (default %(default)g)",
    )
    mps.add_argument(
        "--reload-interval",
        type=flags.positive_float,
        default=defaults.RELOAD_INTERVAL,
        metavar="SECONDS",
        help="seconds between checks of the config file and the profile label (default %(default)g)",
    )
    mps.add_argument(
        "--profile-label-interval",
        type=flags.positive_float,
        default=defaults.PROFILE_LABEL_INTERVAL,
        metavar="SECONDS",
        help="seconds between reads of the node's profile label (default %(default)g)",
    )


def run(args: argparse.Namespace) -> int:
    catch_signals()
    flags.check_plan_flags(args)
    check_executable("--mps-control", args.mps_control, "it comes with the NVIDIA driver's user-space tools")
    from ..discovery.backend import open_inventory
    from ..kube.client import NodeClient
    from ..mps.supervisor import MpsSupervisor
    from ..runtime.plan import plan_node, read_config
    from ..runtime.reload import ConfigReloader

    def connect() -> NodeClient | None:
        return NodeClient.connect(kubeconfig=args.kubeconfig)

    start = read_config(args.config)  # a bad config fails before NVML is touched
    inventory = open_inventory(args.node)
    try:
        plan = plan_node(inventory, start, args.profile, args.profile_label_interval, connect)
    finally:
        inventory.close()  # the node is known; the daemons need no NVML
    # Without --profile the node label picks it, from now on too.
    profiles = plan.profiles if args.profile else plan.profiles.reading(plan.profiles.client or connect())
    supervisor = MpsSupervisor(args.mps_control, args.backoff_max, pools=args.pools)
    supervisor.on_config(plan.config, plan.resources)
    reloader = ConfigReloader(args.config, plan.node, profiles, args.reload_interval, [supervisor])
    reloader.start(plan.config, plan.digest)
    wait_for_signal()
    reloader.stop()
    supervisor.stop()
    return 0

"""`gpu-share extender`: the kube-scheduler extender (filter, prioritize) for share pods."""

from __future__ import annotations

import argparse

from .. import defaults
from ..config.types import DEFAULT_DOMAIN, DOMAIN_ENV
from ..signals import catch_signals, wait_for_signal
from . import flags

HELP = "run the kube-scheduler extender (filter, prioritize) for share pods"


def add_arguments(extender: argparse.ArgumentParser) -> None:
    flags.add_logging(extender)
    extender.add_argument("--domain", default=DEFAULT_DOMAIN,
                          help=f"resources <domain>/* are managed; reads the <domain>/gpu-share.inventory annotation (default: ${DOMAIN_ENV}, else example.com)")
    extender.add_argument("--port", type=flags.port, default=defaults.EXTENDER_PORT, metavar="PORT",
                          help="HTTP port of /filter, /prioritize, /metrics, /healthz, /readyz (default %(default)s)")
    extender.add_argument("--policy", default=defaults.EXTENDER_POLICY,
                          help="cluster placement policy scoring the nodes (default %(default)s): binpack, bestfit, dotproduct, gpupacking, spread, fgd, fgdstrand")
    extender.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, then ~/.kube/config)")
    extender.add_argument("--reservation-ttl", type=flags.positive_float, default=defaults.RESERVATION_TTL, metavar="SECONDS",
                          help="how long a pod passed by the filter counts on its nodes before its binding shows (default %(default)g)")
    extender.add_argument("--dra-class", action="append", metavar="NAME",
                          help="a DeviceClass whose ResourceClaims ask the DRA driver gpu-share.<domain> for shares: score them too, on "
                               "/all/filter and /all/prioritize (repeatable; default: no DRA, no ResourceSlice or claim watches)")


def run(args: argparse.Namespace) -> int:
    from ..extender.service import run_extender

    catch_signals()
    return run_extender(args, wait_for_signal)

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
    extender.add_argument(
        "--domain",
        default=DEFAULT_DOMAIN,
        help="resources <domain>/* are managed; reads the <domain>/gpu-share.inventory annotation (default: "
        f"${DOMAIN_ENV}, else example.com)",
    )
    extender.add_argument(
        "--port",
        type=flags.port,
        default=defaults.EXTENDER_PORT,
        metavar="PORT",
        help="HTTP(S) port of /filter, /prioritize, /metrics, /healthz, /readyz (default %(default)s)",
    )
    extender.add_argument(
        "--address",
        type=flags.ip_address,
        metavar="IP",
        help="address to serve on (default: 0.0.0.0 with --client-ca-file, else 127.0.0.1: without client "
        "authentication, beyond loopback only with --allow-unauthenticated)",
    )
    extender.add_argument(
        "--tls-cert-file",
        metavar="FILE",
        help="serve HTTPS with this PEM certificate (chain); reloaded when it changes",
    )
    extender.add_argument(
        "--tls-private-key-file",
        metavar="FILE",
        help="the PEM private key of --tls-cert-file; reloaded when it changes",
    )
    extender.add_argument(
        "--client-ca-file",
        metavar="FILE",
        help="PEM CA certificates: POST /filter and /prioritize need a client certificate they signed "
        "(401 without one); a certificate they did not sign fails the handshake",
    )
    extender.add_argument(
        "--client-names",
        type=certificate_names,
        metavar="NAMES",
        help="comma-separated: a client certificate's subject CN or a DNS/URI SAN must be one of them "
        "(403 otherwise; default: any certificate --client-ca-file signed)",
    )
    extender.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve the verbs beyond loopback without --client-ca-file (only where a NetworkPolicy admits the "
        "scheduler alone)",
    )
    extender.add_argument(
        "--policy",
        default=defaults.EXTENDER_POLICY,
        help="cluster placement policy scoring the nodes (default %(default)s): binpack, bestfit, dotproduct, "
        "gpupacking, spread, fgd, fgdstrand",
    )
    extender.add_argument(
        "--workload",
        metavar="FILE",
        help="the task shapes of fgd/fgdstrand from this pod list (CSV: name,cpu_milli,memory_mib,num_gpu,gpu_milli; "
        "gpu_milli per GPU as the pods ask here: k shares of N = k*1000/N) instead of learning them from the pods "
        "bound now (docs/scheduler.md)",
    )
    extender.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, then ~/.kube/config)")
    extender.add_argument(
        "--reservation-ttl",
        type=flags.positive_float,
        default=defaults.RESERVATION_TTL,
        metavar="SECONDS",
        help="how long a pod passed by the filter counts on its nodes before its binding shows (default %(default)g)",
    )
    extender.add_argument(
        "--dra-class",
        action="append",
        metavar="NAME",
        help="a DeviceClass whose ResourceClaims ask the DRA driver gpu-share.<domain> for shares: score them too, on "
        "/all/filter and /all/prioritize (repeatable; default: no DRA, no ResourceSlice or claim watches)",
    )


def certificate_names(text: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"must be comma-separated certificate names (CN or DNS/URI SAN), got {text!r}")
    return names


def run(args: argparse.Namespace) -> int:
    from ..extender.service import run_extender

    catch_signals()
    return run_extender(args, wait_for_signal)

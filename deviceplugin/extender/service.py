"""The composition root of `gpu-share extender`: cache <- watches, verbs -> HTTP server."""

from __future__ import annotations

import ipaddress
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from .. import defaults
from ..cluster import TaskShapes
from ..config.types import DEFAULT_DOMAIN
from ..errors import FlagError
from ..kube.annotation import ANNOTATION
from ..kube.dranames import driver_name
from ..kube.rest import RestClient
from .cache import ClusterCache
from .http import READ_TIMEOUT, ExtenderHTTPServer
from .inputs import MODEL_LABEL
from .metrics import ExtenderMetrics
from .score import Scorer
from .tls import ServerTLS, TLSSettings
from .verbs import Extender
from .watch import ClusterWatch, WatchSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtenderOptions:
    domain: str = DEFAULT_DOMAIN  # resources <domain>/* are managed; the annotation is <domain>/gpu-share.inventory
    port: int = defaults.EXTENDER_PORT
    host: str = (
        "127.0.0.1"  # anything but loopback needs tls with a client CA, or allow_unauthenticated (check_exposure)
    )
    policy: str = defaults.EXTENDER_POLICY
    shapes: TaskShapes | None = None  # the workload file's task shapes (fgd, fgdstrand); None: learned
    workers: int = 8
    read_timeout: float = READ_TIMEOUT  # for a request head, and again for its body
    reservation_ttl: float = defaults.RESERVATION_TTL
    dra_classes: tuple[
        str, ...
    ] = ()  # DeviceClasses whose claims ask the DRA driver gpu-share.<domain> for shares; (): no DRA
    watch: WatchSettings = field(default_factory=WatchSettings)
    tls: TLSSettings | None = None  # None: plain HTTP
    allow_unauthenticated: bool = False


def check_exposure(options: ExtenderOptions) -> None:
    """The verbs reserve shares for whoever calls them: beyond loopback only for an authenticated scheduler, unless
    the operator said otherwise."""
    authenticated = options.tls is not None and options.tls.authenticates
    if authenticated or options.allow_unauthenticated or ipaddress.ip_address(options.host).is_loopback:
        return
    raise FlagError(
        "--address",
        options.host,
        "serves /filter to the network without client authentication: any pod could reserve every GPU",
        "give --tls-cert-file, --tls-private-key-file and --client-ca-file (docs/security.md), "
        "or --allow-unauthenticated where a NetworkPolicy alone admits the scheduler",
    )


class ExtenderService:
    def __init__(self, api: RestClient, options: ExtenderOptions) -> None:
        """FlagError (a ValueError) for a bad TLS file or an unauthenticated exposure; OSError when the port is
        taken."""
        check_exposure(options)
        tls = ServerTLS(options.tls) if options.tls is not None else None
        prefix = options.domain + "/"
        model_label = prefix + MODEL_LABEL
        managed = lambda name: name.startswith(prefix)  # noqa: E731
        driver = driver_name(options.domain) if options.dra_classes else ""
        self.cache = ClusterCache(
            reservation_ttl=options.reservation_ttl, driver=driver, classes=frozenset(options.dra_classes)
        )
        self.registry = CollectorRegistry()
        self.metrics = ExtenderMetrics(self.registry, self.cache.counts)
        self.watch = ClusterWatch(
            api,
            self.cache,
            f"{options.domain}/{ANNOTATION}",
            managed,
            options.watch,
            lambda kind: self.metrics.watch_restarts.labels(kind).inc(),
            model_label,
        )
        scorer = Scorer(options.policy, workload=self.cache.workload, shapes=options.shapes, size=self.cache.pod_count)
        self.extender = Extender(self.cache, scorer, managed, self.metrics, model_label)
        self.server = ExtenderHTTPServer(
            self.extender,
            self.metrics,
            self.watch.ready,
            options.port,
            options.host,
            options.workers,
            read_timeout=options.read_timeout,
            tls=tls,
        )

    def start(self) -> None:
        self.server.start()
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()
        self.server.stop()


def tls_settings(args) -> TLSSettings | None:
    """The TLS flags, each needing the ones it builds on; None without --tls-cert-file (plain HTTP)."""
    if bool(args.tls_cert_file) != bool(args.tls_private_key_file):
        raise ValueError("--tls-cert-file and --tls-private-key-file go together")
    if args.client_ca_file and not args.tls_cert_file:
        raise ValueError(
            "--client-ca-file needs --tls-cert-file and --tls-private-key-file (client certificates come with TLS)"
        )
    if args.client_names and not args.client_ca_file:
        raise ValueError("--client-names needs --client-ca-file (the names are checked on certificates that CA signed)")
    if not args.tls_cert_file:
        return None
    return TLSSettings(
        args.tls_cert_file, args.tls_private_key_file, args.client_ca_file or "", args.client_names or frozenset()
    )


def workload_shapes(path: str) -> TaskShapes:
    """The task shapes of a pod list (traces.load_pods' CSV) for fgd/fgdstrand; its `gpu_spec` models are values of the
    nodes' <domain>/gpu.product label."""
    from ..cluster.traces import TraceError, load_pods

    try:
        pods = load_pods(Path(path))
    except TraceError as err:
        raise FlagError(
            "--workload", path, str(err), "a pod list: name,cpu_milli,memory_mib,num_gpu,gpu_milli"
        ) from None
    if not any(p.num_gpu for p in pods):
        raise FlagError("--workload", path, "no pod of the list asks for a GPU", "the shapes are GPU pods' shapes")
    shapes = TaskShapes.from_pods(pods)
    log.info("task shapes: %d from %d pods of --workload %s", len(shapes.shapes), len(pods), path)
    return shapes


def run_extender(args, wait: Callable[[], None]) -> int:
    """`gpu-share extender`: serve until `wait()` returns (a signal); 2 for a bad option or no API access."""
    from ..kube.rest import ApiAccessError, connect

    try:
        api = connect(args.kubeconfig)
    except ApiAccessError as err:
        print(f"gpu-share: error: no Kubernetes API access: {err}", file=sys.stderr)
        return 2
    try:
        tls = tls_settings(args)
        host = args.address or ("0.0.0.0" if tls is not None and tls.authenticates else "127.0.0.1")
        options = ExtenderOptions(
            domain=args.domain,
            port=args.port,
            host=host,
            policy=args.policy,
            shapes=workload_shapes(args.workload) if args.workload else None,
            reservation_ttl=args.reservation_ttl,
            dra_classes=tuple(args.dra_class or ()),
            tls=tls,
            allow_unauthenticated=args.allow_unauthenticated,
        )
        service = ExtenderService(api, options)
    except ValueError as err:
        print(f"gpu-share: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"gpu-share: error: cannot serve on port {args.port}: {err.strerror}", file=sys.stderr)
        return 1
    service.start()
    wait()
    service.stop()
    return 0

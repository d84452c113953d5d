"""The composition root of `gpu-share extender`: cache <- watches, verbs -> HTTP server."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from .. import defaults
from ..config.types import DEFAULT_DOMAIN
from ..kube.annotation import ANNOTATION
from ..kube.dranames import driver_name
from .cache import ClusterCache
from .http import READ_TIMEOUT, ExtenderHTTPServer
from .metrics import ExtenderMetrics
from .score import Scorer
from .verbs import Extender
from .watch import ClusterWatch, WatchSettings


@dataclass(frozen=True)
class ExtenderOptions:
    domain: str = DEFAULT_DOMAIN  # resources <domain>/* are managed; the annotation is <domain>/gpu-share.inventory
    port: int = defaults.EXTENDER_PORT
    host: str = "0.0.0.0"
    policy: str = defaults.EXTENDER_POLICY
    workers: int = 8
    read_timeout: float = READ_TIMEOUT  # for a request head, and again for its body
    reservation_ttl: float = defaults.RESERVATION_TTL
    dra_classes: tuple[str, ...] = ()  # DeviceClasses whose claims ask the DRA driver gpu-share.<domain> for shares; (): no DRA
    watch: WatchSettings = field(default_factory=WatchSettings)


class ExtenderService:
    def __init__(self, api, options: ExtenderOptions) -> None:
        prefix = options.domain + "/"
        managed = lambda name: name.startswith(prefix)  # noqa: E731
        driver = driver_name(options.domain) if options.dra_classes else ""
        self.cache = ClusterCache(reservation_ttl=options.reservation_ttl, driver=driver, classes=frozenset(options.dra_classes))
        self.registry = CollectorRegistry()
        self.metrics = ExtenderMetrics(self.registry, self.cache.counts)
        resource_api = None
        if driver:
            from kubernetes import client

            resource_api = client.ResourceV1Api(api.api_client)
        self.watch = ClusterWatch(
            api, self.cache, f"{options.domain}/{ANNOTATION}", managed, options.watch, lambda kind: self.metrics.watch_restarts.labels(kind).inc(),
            resource_api,
        )
        self.extender = Extender(self.cache, Scorer(options.policy, workload=self.cache.workload), managed, self.metrics)
        self.server = ExtenderHTTPServer(
            self.extender, self.metrics, self.watch.ready, options.port, options.host, options.workers, read_timeout=options.read_timeout
        )

    def start(self) -> None:
        self.server.start()
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()
        self.server.stop()


def run_extender(args, wait: Callable[[], None]) -> int:
    """`gpu-share extender`: serve until `wait()` returns (a signal); 2 for a bad option or no API access."""
    from ..kube.client import ApiAccessError, core_api

    try:
        api = core_api(args.kubeconfig)
    except ApiAccessError as err:
        print(f"gpu-share: error: no Kubernetes API access: {err}", file=sys.stderr)
        return 2
    try:
        options = ExtenderOptions(domain=args.domain, port=args.port, policy=args.policy, reservation_ttl=args.reservation_ttl,
                                  dra_classes=tuple(args.dra_class or ()))
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

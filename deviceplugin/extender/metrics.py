"""The extender's Prometheus metrics: requests, latency, refused clients, filtered-out nodes by reason, cache sizes."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .fit import REASONS

VERBS = ("filter", "prioritize")
UNAUTHENTICATED = ("handshake", "no-certificate", "name")


class ExtenderMetrics:
    def __init__(self, registry: CollectorRegistry, counts: Callable[[], dict[str, int]]) -> None:
        self.registry = registry
        self.requests = Counter(
            "gpushare_extender_requests",
            "Extender calls by verb and outcome (ok, error: a bad request)",
            ["verb", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "gpushare_extender_request_duration_seconds",
            "Time to answer one extender call",
            ["verb"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=registry,
        )
        self.filtered_out = Counter(
            "gpushare_extender_filtered_out_nodes", "Nodes the filter refused, by reason", ["reason"], registry=registry
        )
        self.watch_restarts = Counter(
            "gpushare_extender_watch_restarts",
            "Watches of the API server restarted after an error or a dropped stream",
            ["kind"],
            registry=registry,
        )
        self.unauthenticated = Counter(
            "gpushare_extender_unauthenticated",
            "Connections and calls refused for want of a client certificate the client CA signed "
            "(handshake: a TLS handshake that failed; no-certificate: a POST without one, 401; name: a name not "
            "allowed, 403)",
            ["reason"],
            registry=registry,
        )
        for reason in UNAUTHENTICATED:
            self.unauthenticated.labels(reason)
        for verb in VERBS:
            self.latency.labels(verb)
            for outcome in ("ok", "error"):
                self.requests.labels(verb, outcome)
        for reason in REASONS:
            self.filtered_out.labels(reason)
        for kind in ("nodes", "pods"):
            self.watch_restarts.labels(kind)
        registry.register(_CacheCollector(counts))


class _CacheCollector:
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self):
        gauge = GaugeMetricFamily("gpushare_extender_cache", "What the extender's cache holds", labels=["kind"])
        for kind, value in self.counts().items():
            gauge.add_metric([kind], value)
        yield gauge

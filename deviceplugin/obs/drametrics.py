"""Prometheus metrics of the DRA driver (`gpu-share run --api dra`): calls as they happen, holdings read on scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..model.node import MIB

if TYPE_CHECKING:  # annotations only: the exporter must not import the driver it observes
    from ..dra.prepare import Driver

OPERATIONS = ("prepare", "unprepare")
STATUS_RESULTS = ("ok", "retried", "failed", "gone", "dropped")  # of a claim's status.devices write (dra.claimstatus)


class DraMetrics:
    """What the kubelet plugin feeds per call: its latency, and per claim whether it succeeded."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.claims = Counter(
            "gpushare_dra_claims",
            "Claims in NodePrepareResources / NodeUnprepareResources calls, by operation and result (ok, error).",
            ["operation", "result"],
            registry=registry,
        )
        self.seconds = Histogram(
            "gpushare_dra_request_duration_seconds",
            "Time to answer one NodePrepareResources / NodeUnprepareResources call.",
            ["operation"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0, 45.0),
            registry=registry,
        )
        self.status_writes = Counter(
            "gpushare_dra_claim_status_writes",
            "Writes of prepared claims' status.devices, by result: ok, retried (an attempt failed, another follows),"
            " failed (given up), gone (the claim was deleted), dropped (the queue was full).",
            ["result"],
            registry=registry,
        )
        for result in STATUS_RESULTS:
            self.status_writes.labels(result)
        for operation in OPERATIONS:
            self.seconds.labels(operation)
            for result in ("ok", "error"):
                self.claims.labels(operation, result)

    def called(self, operation: str, seconds: float, ok: int, failed: int) -> None:
        self.seconds.labels(operation).observe(seconds)
        if ok:
            self.claims.labels(operation, "ok").inc(ok)
        if failed:
            self.claims.labels(operation, "error").inc(failed)


class DraCollector(Collector):
    """Prepared claims and, per published device, shares and memory they hold (from the driver's ledger)."""

    def __init__(self, driver: Driver, registered: Callable[[], bool]) -> None:
        self.driver = driver
        self.registered = registered

    def collect(self) -> Iterator[Metric]:
        self.driver.reread()  # a twin's prepares and unprepares, on every scrape
        claims = self.driver.prepared()
        yield GaugeMetricFamily(
            "gpushare_dra_prepared_claims",
            "ResourceClaims prepared on this node (the driver's checkpoint).",
            value=len(claims),
        )
        labels = ["device", "gpu", "uuid"]
        total = GaugeMetricFamily(
            "gpushare_dra_device_shares",
            "Shares a published device has (1 for a whole GPU or MIG instance).",
            labels=labels,
        )
        held = GaugeMetricFamily(
            "gpushare_dra_shares_prepared", "Shares of the device that prepared claims hold.", labels=labels
        )
        memory = GaugeMetricFamily(
            "gpushare_dra_memory_prepared_bytes",
            "GPU memory of the device that prepared claims' shares give.",
            labels=labels,
        )
        held_memory: dict[str, int] = {}
        for claim in claims:
            for prepared in claim.devices:
                if prepared.shares:
                    held_memory[prepared.device] = held_memory.get(prepared.device, 0) + prepared.memory_mib
        ledger = self.driver.ledger()
        for device in self.driver.devices:
            values = [device.name, str(device.unit.gpu.index), device.unit.uuid]
            total.add_metric(values, device.shares if device.shared else 1)
            held.add_metric(values, ledger.get(device.name, 0))
            memory.add_metric(values, held_memory.get(device.name, 0) * MIB)
        yield from (total, held, memory)
        yield GaugeMetricFamily(
            "gpushare_dra_registered",
            "1 while the kubelet has registered the DRA driver.",
            value=1 if self.registered() else 0,
        )
        checkpoint = self.driver.checkpoint
        yield GaugeMetricFamily(
            "gpushare_dra_damaged_records",
            "Claims whose checkpoint record is damaged (quarantined); their devices are fenced.",
            value=len(checkpoint.damaged),
        )
        yield CounterMetricFamily(
            "gpushare_dra_records_quarantined",
            "Checkpoint records this process found damaged and quarantined.",
            value=checkpoint.quarantined,
        )
        yield CounterMetricFamily(
            "gpushare_dra_reallocated_claims",
            "Prepared claims re-allocated under the same UID, prepared again from the new allocation.",
            value=self.driver.reallocated,
        )
        mig = self.driver.mig
        yield CounterMetricFamily(
            "gpushare_dra_mig_instances_made", "Dynamic-MIG instances this process made at prepare.", value=mig.made
        )
        destroyed = "Dynamic-MIG instances this process destroyed (unprepare, start-up sweep)."
        yield CounterMetricFamily("gpushare_dra_mig_instances_destroyed", destroyed, value=mig.destroyed)
        unclaimed = (
            "MIG instances on dynamic-MIG GPUs that no readable claim record names, published taken: kept by the "
            "start-up sweep (GPU busy or unreadable, a damaged record, a refused destroy) or found by the re-read."
        )
        unlisted = len(mig.unlisted())
        yield GaugeMetricFamily("gpushare_dra_mig_unclaimed_instances", unclaimed, value=len(mig.unclaimed) - unlisted)
        yield GaugeMetricFamily(
            "gpushare_dra_mig_unlisted_gpus",
            "Dynamic-MIG GPUs whose MIG instances could not be listed at the last read: all of each published taken.",
            value=unlisted,
        )

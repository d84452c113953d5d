"""Metering: who held how much of which GPU, over time — the counters behind chargeback.

Every node-agent round with a fresh pod-resources `List` reports what each (namespace, pod, resource) holds now:
shares, the GPU fraction they stand for, and the GPU memory its processes use. The meter integrates those
holdings over time (each round's holdings count until the next round: a left Riemann sum) into ever-growing totals:
share-seconds, GPU-seconds and GPU-memory-byte-seconds.

Nothing is persisted and nothing is rebuilt from history: after a plugin restart the totals start again at 0 and
grow from the first round (the holdings come from pod-resources again), so Prometheus sees an ordinary counter
reset, which `increase()`/`rate()` handle, and never a jump that would count time twice. The cost is the time the
plugin was down (plus one round), which is not counted. A gap between two fresh rounds longer than `max_gap`
(a long pod-resources outage) is not counted either rather than guessed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MeterKey = tuple[str, str, str]  # (namespace, pod, resource)


@dataclass(frozen=True)
class Holding:
    """What one pod holds of one resource at one moment."""

    shares: int = 0  # devices: shares, whole GPUs or MIG instances
    gpus: float = 0.0  # the same as a fraction of physical GPUs (a share of a 4-way GPU: 0.25)
    memory_bytes: int = 0  # GPU memory its processes use (NVML)


@dataclass
class Totals:
    share_seconds: float = 0.0
    gpu_seconds: float = 0.0
    memory_byte_seconds: float = 0.0
    last_held: float = 0.0  # clock time the pod last held anything


class Meter:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_gap: float = 60.0,
        retention: float = 900.0,
        max_series: int = 20_000,
    ) -> None:
        self.clock = clock
        self.max_gap = max_gap  # longer gaps between rounds are not counted
        self.retention = retention  # seconds a pod's totals stay exported after it last held anything
        self.max_series = max_series  # hard cap on exported series; the longest-ended pods go first
        self.skipped_seconds = 0.0  # gaps not counted
        self._totals: dict[MeterKey, Totals] = {}
        self._held: dict[MeterKey, Holding] = {}
        self._last: float | None = None

    def observe(self, holdings: dict[MeterKey, Holding]) -> None:
        """One round's holdings: the previous round's count for the time since it; these count from now."""
        now = self.clock()
        if self._last is not None:
            elapsed = now - self._last
            if 0 <= elapsed <= self.max_gap:
                for key, held in self._held.items():
                    totals = self._totals[key]
                    totals.share_seconds += held.shares * elapsed
                    totals.gpu_seconds += held.gpus * elapsed
                    totals.memory_byte_seconds += held.memory_bytes * elapsed
            else:
                self.skipped_seconds += max(0.0, elapsed)
                log.warning(
                    "metering: %.0fs since the last usable round (over %.0fs): that gap is not counted",
                    elapsed,
                    self.max_gap,
                )
        for key in holdings:
            self._totals.setdefault(key, Totals()).last_held = now
        self._held = dict(holdings)
        self._last = now
        self._forget(now)

    def totals(self) -> dict[MeterKey, Totals]:
        return dict(self._totals)

    def _forget(self, now: float) -> None:
        """Drop pods that ended long ago, and the longest-ended first beyond max_series: the series stay bounded."""
        ended = sorted((t.last_held, k) for k, t in self._totals.items() if k not in self._held)
        excess = len(self._totals) - self.max_series
        for last_held, key in ended:
            if now - last_held > self.retention or excess > 0:
                del self._totals[key]
                excess -= 1

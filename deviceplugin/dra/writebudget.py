"""The slice publisher's write budget: a token bucket of `burst` write rounds, refilled at `rate` per second.

Two writers that disagree about the slices (two driver versions side by side in a rolling update, a foreign
controller) then cost the API server a few writes per second, not a loop at its full speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class WriteBudget:
    """Write rounds that may start: `take()` spends one token or says how long until one is there."""

    def __init__(self, burst: int, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or rate <= 0:
            raise ValueError(f"write budget: burst must be >= 1 and rate > 0 (burst={burst}, rate={rate})")
        self.burst = burst
        self.rate = rate
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def take(self) -> float:
        """0 when a writing round may start now (a token taken), else the seconds until one may."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate

"""Clocks for the parts that take one (`clock=`): moved by hand, or real time the test can jump forward."""

from __future__ import annotations

import time


class ManualClock:
    """A `deviceplugin.loop.Clock` that moves only when the test moves it (`now`, or `advance`)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SteppedClock:
    """`time.monotonic()` plus the jumps the test makes: the parts still run in real time, and a test skips a quiet
    period instead of sleeping through it."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds

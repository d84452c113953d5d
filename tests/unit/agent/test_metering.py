"""The meter on a hand-moved clock: long gaps are not counted, ended pods are forgotten, series are bounded."""

from __future__ import annotations

from tests.support.clock import ManualClock

SHARE = "example.com/gpu-share"


def test_metering_drops_long_gaps_and_forgets_ended_pods():
    from deviceplugin.agent.metering import Holding, Meter

    clock = ManualClock()
    meter = Meter(clock=clock, max_gap=30, retention=100, max_series=2)
    a, b, c = ("ns", "a", SHARE), ("ns", "b", SHARE), ("ns", "c", SHARE)
    meter.observe({a: Holding(shares=1, gpus=0.25)})
    clock.now += 60  # longer than max_gap: not counted
    meter.observe({a: Holding(shares=1, gpus=0.25)})
    assert meter.totals()[a].share_seconds == 0 and meter.skipped_seconds == 60
    clock.now += 10
    meter.observe({b: Holding(shares=2)})  # a ended: its last 10 s counted, its series kept a while
    assert meter.totals()[a].share_seconds == 10
    clock.now += 10
    meter.observe({b: Holding(shares=2), c: Holding(shares=1)})  # 3 series > max_series: the ended one goes
    assert set(meter.totals()) == {b, c}
    clock.now += 10
    meter.observe({})
    clock.now += 101
    meter.observe({})
    assert meter.totals() == {}  # ended longer ago than retention

"""dra.writebudget: the slice publisher's token bucket of write rounds."""

from __future__ import annotations

import pytest

from deviceplugin.dra.writebudget import WriteBudget


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_is_spent_then_the_wait_is_until_the_next_token() -> None:
    clock = _Clock()
    budget = WriteBudget(3, 2.0, clock)
    assert [budget.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert budget.take() == pytest.approx(0.5)
    clock.now += 0.5
    assert budget.take() == 0.0
    assert budget.take() == pytest.approx(0.5)


def test_refill_stops_at_the_burst() -> None:
    clock = _Clock()
    budget = WriteBudget(2, 1.0, clock)
    clock.now += 3600
    assert [budget.take() for _ in range(3)][:2] == [0.0, 0.0]
    assert budget.take() > 0


@pytest.mark.parametrize(("burst", "rate"), [(0, 1.0), (1, 0.0), (1, -1.0)])
def test_a_budget_that_could_never_write_is_refused(burst: int, rate: float) -> None:
    with pytest.raises(ValueError, match="write budget"):
        WriteBudget(burst, rate)

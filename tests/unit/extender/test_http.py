"""The extender's in-flight body budget: bodies read and answered at once never hold more than its limit."""

from __future__ import annotations

import threading

from deviceplugin.extender.http import _Budget


def test_the_budget_refuses_what_would_go_over_and_a_give_lets_a_waiter_in():
    budget = _Budget(1000)
    assert budget.take(600, timeout=0) and budget.take(400, timeout=0)
    assert not budget.take(1, timeout=0) and budget.used == 1000
    budget.give(400)
    assert not budget.take(500, timeout=0) and budget.take(400, timeout=0)
    took = threading.Event()
    waiter = threading.Thread(target=lambda: budget.take(700, timeout=30) and took.set())
    waiter.start()
    budget.give(600)
    budget.give(400)
    waiter.join(timeout=30)
    assert took.is_set() and budget.used == 700
